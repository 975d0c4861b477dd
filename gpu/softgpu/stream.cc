// Streams: a queue of operations and the worker thread that runs them.
#include <pthread.h>

#include <chrono>
#include <utility>

#include "gpu/softgpu/softgpu.h"

namespace softgpu {

Stream::Stream(int device, uint64_t delay_us)
    : device_(device), delay_us_(delay_us), worker_([this] { Run(); }) {}

Stream::~Stream() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  worker_.join();
}

void Stream::Enqueue(std::function<void()> op) {
  MutexLock lock(&mu_);
  queue_.push_back(std::move(op));
  ++enqueued_;
  changed_.SignalAll();
}

void Stream::Synchronize() {
  MutexLock lock(&mu_);
  const uint64_t target = enqueued_;
  while (done_ < target) changed_.Wait(&mu_);
}

bool Stream::Idle() {
  MutexLock lock(&mu_);
  return done_ == enqueued_;
}

void Stream::Run() {
  pthread_setname_np(pthread_self(), "softgpu-stream");
  while (true) {
    std::function<void()> op;
    {
      MutexLock lock(&mu_);
      // Stopping drains the queue first: the destructor waits for pending
      // work, as cuStreamDestroy does.
      while (queue_.empty() && !stopping_) changed_.Wait(&mu_);
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    // Outside the lock, so that cuStreamQuery sees the copy pending while
    // it waits (FERRY_SOFTGPU_COPY_DELAY_US).
    if (delay_us_ > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    }
    op();
    op = nullptr;  // Drops the allocations it kept before it counts as done.
    MutexLock lock(&mu_);
    ++done_;
    changed_.SignalAll();
  }
}

}  // namespace softgpu
