// SegmentStore: the metadata service's in-memory table of segment
// descriptors, each with an optional lease. Thread-safe: every method may
// be called concurrently.
//
// A segment put with a lease TTL is removed once that long has passed
// since its last Put or KeepAlive: the segment of an engine that crashed
// goes away by itself. Expired segments are removed by the next call of
// any method (a lookup of an expired one already says NotFound).
#ifndef FERRY_METADATA_SEGMENT_STORE_H_
#define FERRY_METADATA_SEGMENT_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "metadata/proto/metadata.pb.h"

namespace ferry::metadata {

class SegmentStore {
 public:
  // Bounds the table so a client cannot exhaust the server's memory.
  static constexpr size_t kMaxSegments = 1 << 16;
  // Longest lease a segment may ask for.
  static constexpr absl::Duration kMaxLeaseTtl = absl::Hours(1);

  using Clock = std::function<absl::Time()>;
  explicit SegmentStore(Clock clock = [] { return absl::Now(); })
      : clock_(std::move(clock)) {}

  // Validates and stores `segment`, replacing any entry of the same name,
  // with a lease of `lease_ttl` (zero: none; at most kMaxLeaseTtl).
  // Returns the version assigned to it.
  absl::StatusOr<uint64_t> Put(SegmentDescriptor segment,
                               absl::Duration lease_ttl = absl::ZeroDuration());

  // Renews the lease of `name` held by run `incarnation`: NotFound if the
  // segment is not (or no longer) here, FailedPrecondition if another run
  // holds it. Returns the lease's TTL (zero: the segment has none).
  absl::StatusOr<absl::Duration> KeepAlive(const std::string& name,
                                           uint64_t incarnation);

  // Adds and removes buffers of an existing segment, in O(k log n) for k
  // buffers in a segment of n. Fails with NotFound if the segment does not
  // exist, FailedPrecondition if `incarnation` is not the stored one (a
  // stale engine), InvalidArgument if a buffer is bad, overlaps another or
  // names a NIC the segment does not have, ResourceExhausted past the
  // per-segment limits, NotFound if an address to remove is not
  // registered. Nothing changes on failure.
  absl::StatusOr<uint64_t> UpdateBuffers(const UpdateBuffersRequest& request);

  // Returns a copy of the named descriptor or NotFound.
  absl::StatusOr<SegmentDescriptor> Get(const std::string& name) const;

  // Removes the named segment if `incarnation` is its owner's
  // (FailedPrecondition otherwise; InvalidArgument for 0, which once meant
  // "any": any client could then remove any engine's segment by name).
  // NotFound if absent.
  absl::Status Remove(const std::string& name, uint64_t incarnation);

  std::vector<std::string> List() const;

 private:
  struct Entry {
    // Everything but the buffers, which are kept by address, so that an
    // update of k buffers costs O(k log n), not a pass over all n.
    SegmentDescriptor segment;
    std::map<uint64_t, Buffer> buffers;
    size_t keys = 0;     // NIC keys over all buffers.
    size_t devices = 0;  // Devices over all transports.
    absl::flat_hash_set<std::string> device_names;
    absl::Duration ttl;  // Zero: no lease.
    absl::Time expires = absl::InfiniteFuture();
    // The whole descriptor as last assembled for a reader; reset by every
    // change. Readers copy it outside the lock, so a large segment's Gets
    // hold the lock only to take a reference (after the first Get that
    // follows a change, which assembles it).
    mutable std::shared_ptr<const SegmentDescriptor> assembled;
  };
  // The descriptor of `e`, buffers in address order.
  static SegmentDescriptor Assemble(const Entry& e);
  // Removes the segments whose lease has expired.
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets `e`'s expiry from now and its TTL.
  void RenewLocked(const std::string& name, Entry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Expired(const Entry& e) const { return e.expires <= clock_(); }

  const Clock clock_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, Entry> segments_ ABSL_GUARDED_BY(mu_);
  // Leased segments by expiry, soonest first.
  std::set<std::pair<absl::Time, std::string>> expiry_ ABSL_GUARDED_BY(mu_);
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_SEGMENT_STORE_H_
