// ForwardWatchReactor: a MetadataService.WatchSegment stream fed by the
// store's own WatchSegment (a metadata_server on etcd: etcd's watch,
// through EtcdStore), for stores without an in-memory table.
//
// The store pushes events from its thread; they queue here and are written
// one at a time. A client that does not take them fast enough (more than
// kMaxQueued, or kMaxQueuedBytes, waiting) has its stream ended with
// RESOURCE_EXHAUSTED, and refreshes on a miss as any watcher whose stream
// ends. Every queued event is charged to the service's WatchBudget for its
// caller until it is written or dropped, and one that does not fit ends
// the stream the same way.
#ifndef FERRY_METADATA_FORWARD_WATCH_H_
#define FERRY_METADATA_FORWARD_WATCH_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "grpcpp/grpcpp.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/store.h"
#include "metadata/validation.h"
#include "metadata/watch_budget.h"

namespace ferry::metadata {

class ForwardWatchReactor final
    : public grpc::ServerWriteReactor<SegmentEvent> {
 public:
  static constexpr size_t kMaxQueued = 256;
  // Bytes of queued events (ByteSizeLong) past which an event overflows
  // the queue as one past kMaxQueued does. By count alone, a watcher that
  // stops reading a large segment (each re-publication is pushed whole,
  // up to kMaxRpcMessageBytes) pinned 256 copies of it. Two of the largest
  // events: the one being written and one more always fit, and an event
  // that finds the queue empty is always taken, so no segment is too big
  // to watch. (The caller's WatchBudget may still refuse an event, when its
  // other streams hold the rest of its bytes.)
  static constexpr size_t kMaxQueuedBytes = 2 * size_t{kMaxRpcMessageBytes};

  // Starts watching `name` in `store` (which must outlive the stream) for
  // `caller` (AddressGroup), whose events are charged to `budget` (which
  // must outlive the stream too); `on_done` runs once the stream is over,
  // before the reactor goes. If the store refuses, the stream ends with
  // its status.
  ForwardWatchReactor(Store* store, const std::string& name,
                      uint64_t after_version, WatchBudget* budget,
                      std::string caller, std::function<void()> on_done);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  void Push(const SegmentEvent& ev);
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLocked(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  WatchBudget* const budget_;
  const std::string caller_;
  const std::function<void()> on_done_;
  std::unique_ptr<Watch> watch_;  // Ended in OnDone, outside mu_.
  Mutex mu_;
  struct Queued {
    SegmentEvent event;
    size_t bytes;  // Its ByteSizeLong, counted in queued_bytes_.
  };
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  // What queue_ holds, all of it charged to budget_: given back as events
  // leave the queue.
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_FORWARD_WATCH_H_
