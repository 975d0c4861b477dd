#include "metadata/call_pool.h"

#include <algorithm>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace ferry::metadata {

CallPool::CallPool(CallPoolOptions options)
    : options_{std::max(options.max_threads, 1), std::max(options.max_tasks, 1),
               std::max(options.max_tasks_per_caller, 1)} {}

CallPool::~CallPool() {
  std::vector<std::thread> threads;
  {
    MutexLock lock(&mu_);
    // Queued tasks still run: each ends a call, and gRPC waits for that.
    while (tasks_ > 0) drained_.Wait(&mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  wake_.SignalAll();
  for (std::thread& t : threads) t.join();
}

void CallPool::WaitIdle() {
  MutexLock lock(&mu_);
  while (tasks_ > 0) drained_.Wait(&mu_);
}

int CallPool::threads() const {
  MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

absl::Status CallPool::Submit(const std::string& caller,
                              std::function<void()> task) {
  MutexLock lock(&mu_);
  if (tasks_ >= options_.max_tasks) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this service has ", tasks_,
                     " calls waiting or running, its limit; retry later"));
  }
  int& mine = per_caller_[caller];
  if (mine >= options_.max_tasks_per_caller) {
    return absl::ResourceExhaustedError(absl::StrCat(
        caller, " has ", mine,
        " calls waiting or running at this service, the limit per caller; "
        "retry later"));
  }
  if (idle_ == 0 && static_cast<int>(threads_.size()) < options_.max_threads) {
    try {
      threads_.emplace_back([this] { Worker(); });
    } catch (const std::system_error& e) {
      // Out of threads (RLIMIT_NPROC, memory): the running ones serve
      // the queue; with none, the call fails instead of waiting forever.
      if (threads_.empty()) {
        if (mine == 0) per_caller_.erase(caller);
        return absl::UnavailableError(absl::StrCat(
            "cannot start a thread to serve the call: ", e.what()));
      }
    }
  }
  ++mine;
  ++tasks_;
  queue_.push_back(Task{caller, std::move(task)});
  wake_.Signal();
  return absl::OkStatus();
}

void CallPool::Worker() {
  MutexLock lock(&mu_);
  while (true) {
    if (queue_.empty()) {
      if (stopping_) return;
      ++idle_;
      wake_.Wait(&mu_);
      --idle_;
      continue;
    }
    Task task = std::move(queue_.front());
    queue_.pop_front();
    mu_.Unlock();
    task.fn();
    task.fn = nullptr;  // What it captured goes before the count drops.
    mu_.Lock();
    auto it = per_caller_.find(task.caller);
    if (it != per_caller_.end() && --it->second <= 0) per_caller_.erase(it);
    if (--tasks_ == 0) drained_.SignalAll();
  }
}

}  // namespace ferry::metadata
