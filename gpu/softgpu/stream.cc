// Streams: a queue of operations and the worker thread that runs them.
#include <pthread.h>

#include <chrono>
#include <utility>

#include "gpu/softgpu/softgpu.h"

namespace softgpu {
namespace {

// SetStreamsHeld's state. Never destroyed: workers may still wait on it while
// the process exits.
struct Hold {
  Mutex mu;
  CondVar released;
  bool held ABSL_GUARDED_BY(mu) = false;
};

Hold& TheHold() {
  static Hold* hold = new Hold;
  return *hold;
}

// Returns once streams are not held.
void WaitWhileHeld() {
  Hold& h = TheHold();
  MutexLock lock(&h.mu);
  while (h.held) h.released.Wait(&h.mu);
}

}  // namespace

void SetStreamsHeld(bool hold) {
  Hold& h = TheHold();
  MutexLock lock(&h.mu);
  h.held = hold;
  if (!hold) h.released.SignalAll();
}

std::shared_ptr<Stream> Stream::Start(int device, uint64_t delay_us) {
  std::shared_ptr<Stream> s(new Stream(device, delay_us));
  // Detached: the worker's reference keeps the stream until Run returns;
  // the last reference, the worker's or the driver's, deletes it.
  std::thread([s] { s->Run(); }).detach();
  return s;
}

void Stream::Stop() {
  MutexLock lock(&mu_);
  stopping_ = true;
  changed_.SignalAll();
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
      // Stopping drains the queue first: work queued before
      // cuStreamDestroy still runs, as on a GPU, though destroy returned.
      while (queue_.empty() && !stopping_) changed_.Wait(&mu_);
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    // Outside the lock, so that cuStreamQuery sees the copy pending while
    // it waits (held, or FERRY_SOFTGPU_COPY_DELAY_US). Checked after the
    // operation is taken: one enqueued after SetStreamsHeld(true) returned
    // is held.
    WaitWhileHeld();
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
