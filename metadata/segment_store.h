// SegmentStore: the in-memory Store (store.h), the embedded metadata
// service's table and the base of DurableStore. Thread-safe.
//
// Expired segments are removed by the next change (a lookup of an expired
// one already says NotFound).
#ifndef FERRY_METADATA_SEGMENT_STORE_H_
#define FERRY_METADATA_SEGMENT_STORE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "metadata/proto/metadata.pb.h"
#include "metadata/store.h"
#include "metadata/validation.h"

namespace ferry::metadata {

class SegmentStore final : public Store {
 public:
  // Bounds the table so a client cannot exhaust the server's memory.
  static constexpr size_t kMaxSegments = 1 << 16;
  // Longest lease a segment may ask for.
  static constexpr absl::Duration kMaxLeaseTtl = absl::Hours(1);

  // Memory a client may fill. Bytes are what the store holds in memory for
  // a descriptor (its messages, map nodes and the assembled copy readers
  // share: about 25 times its encoded size for buffers with a few NIC
  // keys), not its encoding, so that the limits bound the server's RSS;
  // a watched segment's change log adds at most half as much again
  // (kMaxRememberedChanges). A segment is charged to the client that put
  // it (updates too).
  struct Limits {
    uint64_t max_bytes = uint64_t{2} << 30;
    uint64_t max_client_bytes = uint64_t{256} << 20;
    size_t max_client_segments = 4096;
  };

  // Leases expire on `clock` (null: the system clock), which must outlive
  // the store.
  explicit SegmentStore(Clock* clock = RealClock())
      : clock_(ClockOrReal(clock)) {}
  // Before use.
  void SetLimits(const Limits& limits) { limits_ = limits; }
  // Bytes of memory the descriptors held now take, as charged to the
  // limits.
  uint64_t bytes() const;

  // Store. Updates of k buffers in a segment of n cost O(k log n).
  absl::StatusOr<uint64_t> Put(const PutSegmentRequest& request) override {
    return PutFrom(request, "");
  }
  absl::StatusOr<uint64_t> PutFrom(const PutSegmentRequest& request,
                                   const std::string& client) override;
  absl::StatusOr<absl::Duration> KeepAlive(
      const KeepAliveRequest& request) override;
  absl::StatusOr<uint64_t> UpdateBuffers(
      const UpdateBuffersRequest& request) override;
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override;
  absl::Status Remove(const RemoveSegmentRequest& request) override;
  absl::StatusOr<std::vector<std::string>> List() override;
  std::string Describe() const override { return "memory"; }
  SegmentStore* watchable() override { return this; }

  // For a backend that replays its own history (DurableStore): Put without
  // the ownership check (the history is already decided), with the given
  // version, charged to `client` as the original Put was; later versions
  // continue after it. The lease starts now.
  absl::StatusOr<uint64_t> Restore(const PutSegmentRequest& request,
                                   uint64_t version,
                                   const std::string& client = "");
  // Every stored segment as the PutSegmentRequest that recreates it (owner
  // key and lease TTL included), with the version each has; and the next
  // version the store would assign.
  struct Snapshot {
    struct Segment {
      PutSegmentRequest put;
      uint64_t version = 0;
      std::string client;  // Charged to it.
    };
    std::vector<Segment> segments;
    uint64_t next_version = 1;
  };
  Snapshot TakeSnapshot() const;
  // Makes the next assigned version at least `version`.
  void AdvanceVersion(uint64_t version);
  // The version the next change would get.
  uint64_t NextVersion() const;
  // Off while a backend replays its history: what was accepted once is
  // restored even if the limits (kMaxSegments, Limits) are lower now.
  void EnforceLimits(bool on);
  // Largest encoded descriptor: it must fit one GetSegment answer.
  static constexpr uint64_t kMaxDescriptorBytes = kMaxRpcMessageBytes - 4096;

  // For a backend that must make a change durable before anyone can see it
  // (DurableStore): `fn` is called with the store's lock held, once a
  // change (put, update, removal; not a lease renewal or expiry) has been
  // checked and before it is applied -- so before any reader sees it or
  // any watcher hears of it -- with the version the change will have (0
  // for a removal). A non-OK status refuses the change, which then leaves
  // nothing behind. `fn` must not call the store. Set before concurrent
  // use; null (the default): none.
  using WriteAhead = std::function<absl::Status(uint64_t version)>;
  void SetWriteAhead(WriteAhead fn);

  // Watching (MetadataService.WatchSegment). `fn` is called, with the
  // store's lock held, after each change of `name` (put, update, removal,
  // expiry): it must only note the fact (queue work for another thread)
  // and never call into the store. Returns an id for Unsubscribe, after
  // which `fn` is not called again.
  using Listener = std::function<void()>;
  uint64_t Subscribe(const std::string& name, Listener fn);
  void Unsubscribe(uint64_t id);
  // The next event for a watcher that has `after_version` (0: nothing):
  // the change made right after it, the whole descriptor if the store no
  // longer remembers that change (or the segment was published again),
  // `gone` if the segment is not stored, or nothing if the watcher is up
  // to date.
  std::optional<SegmentEvent> EventSince(const std::string& name,
                                         uint64_t after_version);
  // Changes remembered per segment for watchers: at most this many, and
  // at most half the memory the segment is charged for (one copy of it:
  // the charge counts two), or kMinChangeLogBytes for small ones, so that
  // a segment's change log never costs more than a part of what its
  // owner's quota is charged. A watcher further behind gets the whole
  // descriptor, as one that starts does.
  static constexpr size_t kMaxRememberedChanges = 1024;
  static constexpr uint64_t kMinChangeLogBytes = 16 << 10;
  // Memory the changes `name` remembers take (0 if none or no such
  // segment); for tests.
  uint64_t ChangeLogBytesForTesting(const std::string& name) const;

 private:
  struct Entry {
    // Everything but the buffers, which are kept by address, so that an
    // update of k buffers costs O(k log n), not a pass over all n.
    descriptor::SegmentDescriptor segment;
    std::map<uint64_t, descriptor::Buffer> buffers;
    size_t keys = 0;     // NIC keys over all buffers.
    size_t devices = 0;  // Devices over all transports.
    absl::flat_hash_set<std::string> device_names;
    std::string owner_key;
    std::string client;  // Charged for it; empty: no per-client quota.
    uint64_t bytes = 0;  // Encoded size of the descriptor.
    uint64_t held = 0;   // Memory it takes, as charged (HeldSegmentBytes).
    absl::Duration ttl;  // Zero: no lease.
    absl::Time expires = absl::InfiniteFuture();
    // The whole descriptor as last assembled for a reader; reset by every
    // change. Readers copy it outside the lock, so a large segment's Gets
    // hold the lock only to take a reference (after the first Get that
    // follows a change, which assembles it).
    mutable std::shared_ptr<const descriptor::SegmentDescriptor> assembled;
    // The version of the last Put, and the buffer changes since, oldest
    // first (at most kMaxRememberedChanges), for watchers.
    uint64_t put_version = 0;
    struct Change {
      uint64_t prev_version = 0;
      uint64_t version = 0;
      std::vector<descriptor::Buffer> add;
      std::vector<uint64_t> remove;
      uint64_t bytes = 0;  // Memory it takes, about.
    };
    std::deque<Change> changes;
    uint64_t change_bytes = 0;  // Of `changes`.
  };
  // Tells the listeners of `name` that it changed.
  void NotifyLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The write-ahead hook's verdict on a checked change (OK if none).
  absl::Status WriteAheadLocked(uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The descriptor of `e`, buffers in address order.
  static descriptor::SegmentDescriptor Assemble(const Entry& e);
  // Removes the segments whose lease has expired.
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> PutLocked(const PutSegmentRequest& request,
                                     bool check_owner,
                                     const std::string& client)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ResourceExhausted if `client` (with `old` of its bytes given back)
  // cannot take `bytes` more, or one more segment if `new_segment`.
  absl::Status CheckQuotaLocked(const std::string& client, uint64_t old_bytes,
                                uint64_t bytes, bool new_segment) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ChargeLocked(const std::string& client, int64_t bytes, int segments)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erases a segment, giving its memory back.
  void EraseLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets `e`'s expiry from now and its TTL.
  void RenewLocked(const std::string& name, Entry* e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Expired(const Entry& e) const { return e.expires <= clock_->Now(); }

  Clock* const clock_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, Entry> segments_ ABSL_GUARDED_BY(mu_);
  // Leased segments by expiry, soonest first.
  std::set<std::pair<absl::Time, std::string>> expiry_ ABSL_GUARDED_BY(mu_);
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
  WriteAhead write_ahead_ ABSL_GUARDED_BY(mu_);
  Limits limits_;
  bool enforce_limits_ ABSL_GUARDED_BY(mu_) = true;
  struct Usage {
    uint64_t bytes = 0;
    size_t segments = 0;
  };
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  uint64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Freed since the allocator last gave memory back to the system.
  uint64_t freed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  struct Subscription {
    std::string name;
    Listener fn;
  };
  absl::flat_hash_map<uint64_t, Subscription> subscriptions_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::vector<uint64_t>> listeners_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_subscription_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_SEGMENT_STORE_H_
