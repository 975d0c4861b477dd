// WatchBudget: the bytes of events that WatchSegment streams hold, over
// one metadata service and per caller (AddressGroup(CallerAddress): an
// IPv4 address, an IPv6 /64).
//
// A stream holds an event from when it is computed (or queued, for a
// forwarded watch) until gRPC has written it, which for a client that
// stops reading (an HTTP/2 receive window of zero) is never. Stream counts
// (kMaxWatchesPerCaller) and each forwarded stream's queue cap do not
// bound that: one address's 256 streams on a segment whose descriptor
// encodes to tens of MiB pinned gigabytes, and sixteen addresses, every
// stream of the service, tens of gigabytes. So every event a stream holds
// is charged here first, and a stream whose event does not fit ends
// RESOURCE_EXHAUSTED (its watcher refreshes on a miss, as with a store
// that cannot push). Thread-safe; a leaf lock (takes no other).
#ifndef FERRY_METADATA_WATCH_BUDGET_H_
#define FERRY_METADATA_WATCH_BUDGET_H_

#include <cstddef>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "metadata/validation.h"

namespace ferry::metadata {

class WatchBudget {
 public:
  // What every watch stream of a service may hold at once: what clients
  // that do not read can pin, counted in encoded bytes (ByteSizeLong; the
  // memory is a small multiple: the message, and gRPC's encoding of it
  // while it is written). Of the order of the store's own cap on its
  // descriptors (SegmentStore::Limits, 2 GiB), and enough for 4,096
  // streams (kMaxWatches) of 256 KiB descriptors each in flight at once.
  static constexpr size_t kMaxBytes = size_t{1} << 30;
  // What one caller's streams may hold: a sixteenth, the share rule of the
  // stream count (kMaxWatchesPerCaller = kMaxWatches / 16), so that
  // sixteen hosts are needed to fill the service. 64 MiB, as a caller's
  // unread unary responses (CallPoolOptions): two of the largest events,
  // so that a caller with nothing held can always be sent one, and more
  // besides. A reading engine holds an event only for the moment it takes
  // to send it.
  static constexpr size_t kMaxBytesPerCaller = kMaxBytes / 16;
  static_assert(kMaxBytesPerCaller >= 2 * size_t{kMaxRpcMessageBytes},
                "a caller must always fit the largest event");

  // Limits below 1 are taken as 1.
  explicit WatchBudget(size_t max_bytes = kMaxBytes,
                       size_t max_bytes_per_caller = kMaxBytesPerCaller);
  WatchBudget(const WatchBudget&) = delete;
  WatchBudget& operator=(const WatchBudget&) = delete;

  // Replaces the limits (tests: smaller ones, to reach them with small
  // events). What is held stays held.
  void SetLimits(size_t max_bytes, size_t max_bytes_per_caller);

  // Charges an event of `bytes` that a stream of `caller` is about to
  // hold: all or nothing. ResourceExhausted, saying what the caller (or
  // the service) holds and the limit, if it would pass either.
  absl::Status Charge(const std::string& caller, size_t bytes);
  // Gives back `bytes` charged for `caller` (the event was written, or
  // dropped). Releasing more than is held takes what is held.
  void Release(const std::string& caller, size_t bytes);

  // What `caller` holds, and all callers together.
  size_t held(const std::string& caller) const;
  size_t total() const;

 private:
  mutable Mutex mu_;
  size_t max_bytes_ ABSL_GUARDED_BY(mu_);
  size_t max_bytes_per_caller_ ABSL_GUARDED_BY(mu_);
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
  // Callers holding nothing are not kept.
  absl::flat_hash_map<std::string, size_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_WATCH_BUDGET_H_
