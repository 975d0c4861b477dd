// Store: where segment descriptors live, seen by whoever publishes and looks
// them up. One interface over every backend, so that the metadata service,
// the engines and the shared test suite (store_conformance.h) do not care
// which one is in use:
//   - SegmentStore: in memory (the embedded default);
//   - DurableStore: SegmentStore plus a snapshot and an fsync'd log, for
//     tools/metadata_server;
//   - MetadataClient: a Ferry metadata service over gRPC (itself backed by
//     one of the others).
//
// Ownership. Every change carries the owner key of the engine run that
// published the segment: a random secret, never returned by Get. Put of a
// name held by another key fails AlreadyExists while the holder's lease
// lives (or, without a lease, until the holder removes it); KeepAlive,
// UpdateBuffers and Remove with another key fail FailedPrecondition. A
// client that can read a descriptor therefore cannot take over, change or
// remove the segment.
//
// Leases. A segment put with a lease TTL goes away that long after its
// last Put, KeepAlive or UpdateBuffers (its engine crashed).
//
// Thread-safe: every method may be called concurrently.
#ifndef FERRY_METADATA_STORE_H_
#define FERRY_METADATA_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "metadata/proto/metadata.pb.h"

namespace ferry::metadata {

class SegmentStore;

// A watch started by Store::Watch; destroying it ends the watch (after
// which its callback is not called again).
class Watch {
 public:
  virtual ~Watch() = default;
};

class Store {
 public:
  virtual ~Store() = default;

  // Validates and stores the segment (its buffers included) with the
  // request's lease and owner key, replacing an entry of the same owner.
  // Returns the version assigned to it.
  virtual absl::StatusOr<uint64_t> Put(const PutSegmentRequest& request) = 0;

  // Renews the segment's lease. NotFound if the segment is not (or no
  // longer) stored: the owner publishes it again. Returns the lease TTL
  // (zero: the segment has none).
  virtual absl::StatusOr<absl::Duration> KeepAlive(
      const KeepAliveRequest& request) = 0;

  // Adds and removes buffers of a stored segment, all or nothing; renews
  // its lease. NotFound if the segment is not stored, InvalidArgument if a
  // buffer is bad, overlaps another or names a NIC the segment does not
  // have, NotFound if an address to remove is not registered,
  // ResourceExhausted past the per-segment limits.
  virtual absl::StatusOr<uint64_t> UpdateBuffers(
      const UpdateBuffersRequest& request) = 0;

  // Put on behalf of `client` (a metadata service's caller, by address),
  // which the segment is charged to where the store keeps quotas
  // (SegmentStore::Limits; its later updates are charged to it too).
  // Others ignore `client`.
  virtual absl::StatusOr<uint64_t> PutFrom(const PutSegmentRequest& request,
                                           const std::string& client) {
    (void)client;
    return Put(request);
  }

  // The named descriptor (without owner key) or NotFound.
  virtual absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) = 0;

  // Removes the segment. NotFound if it is not stored.
  virtual absl::Status Remove(const RemoveSegmentRequest& request) = 0;

  // Names of the stored segments, sorted.
  virtual absl::StatusOr<std::vector<std::string>> List() = 0;

  // Where the store is, for messages ("embedded", "host:port", a path).
  virtual std::string Describe() const = 0;

  // Pushes each change of segment `name` after `after_version` to `fn`
  // (SegmentEvent: the whole descriptor, a buffer delta, or gone), from a
  // thread of the store's; `fn` must not block. Unimplemented where the
  // backend cannot push (readers then refresh on a miss). A watch that
  // ends before it is destroyed (a remote service refused or dropped the
  // stream) says `gone` once: what was pushed can no longer be trusted to
  // be current.
  using EventFn = std::function<void(const SegmentEvent&)>;
  virtual absl::StatusOr<std::unique_ptr<Watch>> WatchSegment(
      const std::string& name, uint64_t after_version, EventFn fn) {
    (void)name, (void)after_version, (void)fn;
    return absl::UnimplementedError(
        absl::StrCat(Describe(), " cannot push segment changes"));
  }

  // The in-memory table whose changes a metadata service pushes to its
  // watchers (SegmentStore::Subscribe), or null.
  virtual SegmentStore* watchable() { return nullptr; }
};

// Bytes of an owner key: enough randomness that it cannot be guessed.
constexpr size_t kMinOwnerKeyBytes = 16;
constexpr size_t kMaxOwnerKeyBytes = 64;

// A fresh random owner key, for an engine run.
std::string NewOwnerKey();

// InvalidArgument unless `key` is an owner key of a valid length.
absl::Status ValidateOwnerKey(absl::string_view key);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_STORE_H_
