#include "metadata/call_pool.h"

#include <algorithm>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"

namespace ferry::metadata {

namespace {

CallPoolOptions AtLeastOne(CallPoolOptions o) {
  o.max_threads = std::max(o.max_threads, 1);
  o.max_calls = std::max(o.max_calls, 1);
  o.max_calls_per_caller = std::max(o.max_calls_per_caller, 1);
  o.max_response_bytes = std::max<size_t>(o.max_response_bytes, 1);
  o.max_response_bytes_per_caller =
      std::max<size_t>(o.max_response_bytes_per_caller, 1);
  return o;
}

}  // namespace

CallPool::CallPool(CallPoolOptions options)
    : options_(AtLeastOne(options)), clock_(ClockOrReal(options.clock)) {}

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

int CallPool::calls() const {
  MutexLock lock(&mu_);
  return calls_;
}

absl::Status CallPool::Admit(const std::string& caller) {
  MutexLock lock(&mu_);
  const auto found = shares_.find(caller);
  const int mine = found == shares_.end() ? 0 : found->second.calls;
  if (mine >= options_.max_calls_per_caller) {
    return absl::ResourceExhaustedError(absl::StrCat(
        caller, " has ", mine,
        " calls in progress at this service (some may wait for it to read "
        "their responses), the limit per caller; retry later"));
  }
  std::optional<Waiting> victim;
  if (calls_ >= options_.max_calls) {
    victim = PickVictimLocked(caller, mine, clock_->Now());
    if (!victim.has_value()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this service has ", calls_,
          " calls in progress (some may wait for their clients to read), its "
          "limit, and no caller holds two more than ",
          caller, " would; retry later"));
    }
  }
  ++shares_[caller].calls;
  ++calls_;
  if (victim.has_value()) {
    // Outside the lock: were gRPC to run the call's OnDone (and so
    // Release) inside TryCancel, on this thread, Release lets it through;
    // on another thread, Release waits until TryCancel is over.
    cancelling_[victim->call] = {std::this_thread::get_id(), true};
    mu_.Unlock();
    victim->ctx->TryCancel();
    mu_.Lock();
    // Still there unless its Release ran inside TryCancel.
    auto it = cancelling_.find(victim->call);
    if (it != cancelling_.end() &&
        it->second.by == std::this_thread::get_id()) {
      it->second.in_try = false;
    }
    cancelled_.SignalAll();
  }
  return absl::OkStatus();
}

std::optional<CallPool::Waiting> CallPool::PickVictimLocked(
    const std::string& caller, int have, absl::Time now) {
  Share* most = nullptr;
  for (auto& [name, share] : shares_) {
    // Oldest first: if the first has not waited long enough, none has.
    if (name == caller || share.waiting.empty() ||
        now - share.waiting.front().since < options_.cancel_after) {
      continue;
    }
    if (most == nullptr || share.calls > most->calls) most = &share;
  }
  if (most == nullptr || most->calls < have + 2) return std::nullopt;
  const Waiting w = most->waiting.front();
  most->waiting.erase(most->waiting.begin());
  --most->calls;
  --calls_;
  return w;
}

void CallPool::Delivering(const std::string& caller, const void* call,
                          grpc::ServerContextBase* ctx) {
  MutexLock lock(&mu_);
  auto it = shares_.find(caller);
  if (it != shares_.end()) {
    it->second.waiting.push_back({call, ctx, clock_->Now()});
  }
}

absl::Status CallPool::Charge(const std::string& caller, size_t bytes) {
  MutexLock lock(&mu_);
  Share& mine = shares_[caller];
  if (mine.bytes + bytes > options_.max_response_bytes_per_caller) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "responses to ", caller, " not yet read hold ", mine.bytes,
        " bytes; this one (", bytes, ") would pass the limit per caller (",
        options_.max_response_bytes_per_caller, "); retry later"));
  }
  if (bytes_ + bytes > options_.max_response_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "responses not yet read hold ", bytes_, " bytes; this one (", bytes,
        ") would pass this service's limit (", options_.max_response_bytes,
        "); retry later"));
  }
  mine.bytes += bytes;
  bytes_ += bytes;
  return absl::OkStatus();
}

void CallPool::Release(const std::string& caller, size_t bytes,
                       const void* call) {
  MutexLock lock(&mu_);
  // A cancelled call was counted out when it was picked.
  bool counted = true;
  if (call != nullptr) {
    // Another thread may be about to cancel it through its context, which
    // lives until this returns.
    while (true) {
      auto c = cancelling_.find(call);
      if (c == cancelling_.end()) break;
      if (!c->second.in_try || c->second.by == std::this_thread::get_id()) {
        cancelling_.erase(c);
        counted = false;
        break;
      }
      cancelled_.Wait(&mu_);
    }
  }
  auto it = shares_.find(caller);
  if (it == shares_.end()) return;
  if (call != nullptr) {
    auto& w = it->second.waiting;
    w.erase(std::remove_if(w.begin(), w.end(),
                           [call](const Waiting& x) { return x.call == call; }),
            w.end());
  }
  if (counted) {
    it->second.calls = std::max(it->second.calls - 1, 0);
    --calls_;
  }
  it->second.bytes -= std::min(it->second.bytes, bytes);
  bytes_ -= std::min(bytes_, bytes);
  if (it->second.calls == 0 && it->second.bytes == 0 &&
      it->second.waiting.empty()) {
    shares_.erase(it);
  }
}

absl::Status CallPool::Run(std::function<void()> task) {
  MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError("the service is shutting down");
  }
  queue_.push_back(std::move(task));
  ++tasks_;
  // Threads signalled but not yet awake still count as idle: a burst
  // needs as many threads as it has tasks beyond them.
  if (static_cast<int>(queue_.size()) > idle_ &&
      static_cast<int>(threads_.size()) < options_.max_threads) {
    try {
      threads_.emplace_back([this] { Worker(); });
    } catch (const std::system_error& e) {
      // Out of threads (RLIMIT_NPROC, memory): the running ones serve
      // the queue; with none, the call fails instead of waiting forever.
      if (threads_.empty()) {
        queue_.pop_back();
        if (--tasks_ == 0) drained_.SignalAll();
        return absl::UnavailableError(absl::StrCat(
            "cannot start a thread to serve the call: ", e.what()));
      }
    }
  }
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
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    mu_.Unlock();
    task();
    task = nullptr;  // What it captured goes before the count drops.
    mu_.Lock();
    if (--tasks_ == 0) drained_.SignalAll();
  }
}

}  // namespace ferry::metadata
