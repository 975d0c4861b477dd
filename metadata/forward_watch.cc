#include "metadata/forward_watch.h"

#include <utility>

#include "common/happens_before.h"
#include "metadata/grpc_status.h"

namespace ferry::metadata {

ForwardWatchReactor::ForwardWatchReactor(Store* store, const std::string& name,
                                         uint64_t after_version,
                                         std::function<void()> on_done)
    : on_done_(std::move(on_done)) {
  auto watch = store->WatchSegment(
      name, after_version, [this](const SegmentEvent& ev) { Push(ev); });
  MutexLock lock(&mu_);
  if (!watch.ok()) {
    FinishLocked(ToGrpcStatus(watch.status()));
  } else {
    watch_ = std::move(*watch);
  }
  HappensBefore(this);  // Callbacks run on gRPC's threads after this.
}

void ForwardWatchReactor::Push(const SegmentEvent& ev) {
  MutexLock lock(&mu_);
  if (finished_) return;
  if (queue_.size() >= kMaxQueued) {
    FinishLocked(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                              "the watcher does not take its events: "
                              "refresh on a miss"));
    return;
  }
  queue_.push_back(ev);
  NextLocked();
}

void ForwardWatchReactor::NextLocked() {
  if (writing_ || finished_ || queue_.empty()) return;
  writing_ = true;
  StartWrite(&queue_.front());
}

void ForwardWatchReactor::OnWriteDone(bool ok) {
  HappensAfter(this);
  MutexLock lock(&mu_);
  writing_ = false;
  queue_.pop_front();
  if (!ok) {
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
    return;
  }
  NextLocked();
}

void ForwardWatchReactor::OnCancel() {
  HappensAfter(this);
  MutexLock lock(&mu_);
  FinishLocked(grpc::Status::CANCELLED);
}

void ForwardWatchReactor::OnDone() {
  HappensAfter(this);
  // Outside mu_: ending the watch waits for a Push in progress.
  watch_.reset();
  on_done_();
  delete this;
}

void ForwardWatchReactor::FinishLocked(const grpc::Status& s) {
  if (finished_) return;
  finished_ = true;
  // A write in flight keeps its event until OnWriteDone; the rest go.
  if (writing_) {
    queue_.erase(queue_.begin() + 1, queue_.end());
  } else {
    queue_.clear();
  }
  Finish(s);
}

}  // namespace ferry::metadata
