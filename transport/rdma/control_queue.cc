#include "transport/rdma/control_queue.h"

#include <algorithm>
#include <utility>

namespace ferry::rdma {

void ControlQueue::Push(ControlJob job) {
  MutexLock lock(&mu_);
  jobs_.push_back(std::move(job));
  cv_.SignalAll();
}

bool ControlQueue::MayStartConnectLocked(const Peer* peer) const {
  auto it = connects_running_.find(peer);
  const int running = it == connects_running_.end() ? 0 : it->second;
  return running < (peer->reached.load(std::memory_order_relaxed)
                        ? kMaxConnectsPerPeer
                        : 1);
}

std::optional<ControlJob> ControlQueue::TakeLocked(bool* over) {
  *over = false;
  if (farewell_ && clock_->Now() > farewell_deadline_) {
    *over = true;
    return std::nullopt;
  }
  auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](const ControlJob& j) {
    mu_.AssertHeld();  // Called right here, under the lock.
    if (farewell_) return j.kind == ControlJob::Kind::kNotice;
    return j.kind != ControlJob::Kind::kConnect ||
           MayStartConnectLocked(j.ep->peer());
  });
  if (it == jobs_.end()) {
    // Until Shutdown sets the deadline, a peer request in progress may
    // still queue a notice (a DISCONNECT): the threads wait for it.
    *over = farewell_ && farewell_deadline_ != absl::InfiniteFuture();
    return std::nullopt;
  }
  ControlJob job = std::move(*it);
  jobs_.erase(it);
  if (job.kind == ControlJob::Kind::kConnect) {
    ++connects_running_[job.ep->peer()];
  }
  return job;
}

std::optional<ControlJob> ControlQueue::Take() {
  MutexLock lock(&mu_);
  while (true) {
    bool over = false;
    std::optional<ControlJob> job = TakeLocked(&over);
    if (job.has_value() || over) return job;
    cv_.Wait(&mu_);
  }
}

std::optional<ControlJob> ControlQueue::TryTake(bool* over) {
  MutexLock lock(&mu_);
  return TakeLocked(over);
}

void ControlQueue::Done(const ControlJob& job) {
  if (job.kind != ControlJob::Kind::kConnect) return;
  MutexLock lock(&mu_);
  auto it = connects_running_.find(job.ep->peer());
  if (it != connects_running_.end() && --it->second <= 0) {
    connects_running_.erase(it);
  }
  cv_.SignalAll();
}

void ControlQueue::BeginFarewell(absl::Time deadline) {
  MutexLock lock(&mu_);
  farewell_ = true;
  farewell_deadline_ = deadline;
  cv_.SignalAll();
}

std::vector<std::shared_ptr<Endpoint>> ControlQueue::TakeEndpoints() {
  std::vector<std::shared_ptr<Endpoint>> eps;
  MutexLock lock(&mu_);
  for (ControlJob& j : jobs_) {
    if (j.ep != nullptr) eps.push_back(std::move(j.ep));
  }
  jobs_.clear();
  return eps;
}

size_t ControlQueue::size() const {
  MutexLock lock(&mu_);
  return jobs_.size();
}

int ControlQueue::connects_running(const Peer* peer) const {
  MutexLock lock(&mu_);
  auto it = connects_running_.find(peer);
  return it == connects_running_.end() ? 0 : it->second;
}

}  // namespace ferry::rdma
