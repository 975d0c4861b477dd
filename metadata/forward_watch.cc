#include "metadata/forward_watch.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/happens_before.h"
#include "metadata/grpc_status.h"

namespace ferry::metadata {

ForwardWatchReactor::ForwardWatchReactor(Store* store, const std::string& name,
                                         uint64_t after_version,
                                         WatchBudget* budget,
                                         std::string caller,
                                         std::function<void()> on_done)
    : budget_(budget),
      caller_(std::move(caller)),
      on_done_(std::move(on_done)) {
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
  // Measured on our copy: ByteSizeLong caches the size in the message,
  // and `ev` is the store's.
  Queued q{ev, 0};
  q.bytes = q.event.ByteSizeLong();
  if (queue_.size() >= kMaxQueued ||
      (!queue_.empty() && queued_bytes_ + q.bytes > kMaxQueuedBytes)) {
    FinishLocked(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("the watcher does not take its events (", queue_.size(),
                     " events, ", queued_bytes_,
                     " bytes waiting; the most one stream may hold is ",
                     kMaxQueued, " events or ", kMaxQueuedBytes,
                     " bytes): refresh on a miss")));
    return;
  }
  // And what all the caller's streams hold: its other streams may be
  // holding theirs.
  if (absl::Status charged = budget_->Charge(caller_, q.bytes); !charged.ok()) {
    FinishLocked(ToGrpcStatus(charged));
    return;
  }
  queued_bytes_ += q.bytes;
  queue_.push_back(std::move(q));
  NextLocked();
}

void ForwardWatchReactor::NextLocked() {
  if (writing_ || finished_ || queue_.empty()) return;
  writing_ = true;
  StartWrite(&queue_.front().event);
}

void ForwardWatchReactor::OnWriteDone(bool ok) {
  HappensAfter(this);
  MutexLock lock(&mu_);
  writing_ = false;
  const size_t written = queue_.front().bytes;
  queued_bytes_ -= written;
  queue_.pop_front();
  budget_->Release(caller_, written);
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
  {
    // Nothing is queued by now (FinishLocked dropped the queue, and the
    // write in flight, if any, was done before OnDone); should anything
    // be, its bytes must not stay charged to the caller for ever.
    MutexLock lock(&mu_);
    budget_->Release(caller_, queued_bytes_);
    queued_bytes_ = 0;
    queue_.clear();
  }
  on_done_();
  delete this;
}

void ForwardWatchReactor::FinishLocked(const grpc::Status& s) {
  if (finished_) return;
  finished_ = true;
  // A write in flight keeps its event (and its charge) until OnWriteDone;
  // the rest go, and give their bytes back.
  const size_t kept = writing_ ? queue_.front().bytes : 0;
  if (writing_) {
    queue_.erase(queue_.begin() + 1, queue_.end());
  } else {
    queue_.clear();
  }
  budget_->Release(caller_, queued_bytes_ - kept);
  queued_bytes_ = kept;
  Finish(s);
}

}  // namespace ferry::metadata
