#include "common/simulated_clock.h"

#include <cstdlib>

namespace ferry {
namespace {

// WaitWithDeadline registers the waiter under the clock's lock and then
// waits on the caller's condition variable under the caller's lock. Advance
// signals that variable without the caller's lock (taking it would order
// the clock's lock before every caller's lock, and callers hold theirs
// when they take the clock's), so Advance's signal can fall between the
// two steps and be lost. The real wait is therefore bounded: the waiter
// returns to its caller's loop, and looks at the simulated time, at least
// this often.
constexpr absl::Duration kRecheck = absl::Milliseconds(2);

}  // namespace

SimulatedClock::SimulatedClock(absl::Time start) : now_(start) {}

SimulatedClock::~SimulatedClock() {
  MutexLock lock(&mu_);
  // A thread still waiting would read a destroyed clock: fail loudly.
  if (!waiters_.empty()) std::abort();
}

absl::Time SimulatedClock::Now() {
  MutexLock lock(&mu_);
  return now_;
}

void SimulatedClock::SleepUntil(absl::Time deadline) {
  MutexLock lock(&mu_);
  if (now_ >= deadline) return;
  Waiter w{deadline, nullptr};
  waiters_.insert(&w);
  sleep_cv_.SignalAll();  // BlockUntilWaiters counts this sleeper.
  while (now_ < deadline) sleep_cv_.Wait(&mu_);
  waiters_.erase(&w);
  sleep_cv_.SignalAll();  // For Settle.
}

bool SimulatedClock::WaitWithDeadline(CondVar* cv, Mutex* mu,
                                      absl::Time deadline) {
  Waiter w{deadline, cv};
  {
    MutexLock lock(&mu_);
    if (now_ >= deadline) return true;
    waiters_.insert(&w);
    sleep_cv_.SignalAll();
  }
  // One real wait bounded by kRecheck (see there), then back to the
  // caller, who re-checks its own condition: a signal that races the
  // bound's expiry is reported as a timeout by the condition variable, so
  // waiting again here could sleep through the caller's event (seen: an
  // engine's idle refresher missing Shutdown's signal). The caller's loop
  // registers the waiter again at once.
  cv->WaitWithDeadline(mu, absl::Now() + kRecheck);
  MutexLock lock(&mu_);
  waiters_.erase(&w);
  sleep_cv_.SignalAll();  // For Settle.
  return now_ >= deadline;
}

void SimulatedClock::Advance(absl::Duration d) {
  MutexLock lock(&mu_);
  if (d > absl::ZeroDuration()) now_ += d;
  WakeDueLocked();
}

void SimulatedClock::AdvanceTo(absl::Time t) {
  MutexLock lock(&mu_);
  if (t > now_) now_ = t;
  WakeDueLocked();
}

void SimulatedClock::WakeDueLocked() {
  bool sleepers = false;
  for (Waiter* w : waiters_) {
    if (w->deadline > now_) break;  // Ordered by deadline.
    if (w->cv != nullptr) {
      w->cv->SignalAll();
    } else {
      sleepers = true;
    }
  }
  if (sleepers) sleep_cv_.SignalAll();
}

int SimulatedClock::waiters() {
  MutexLock lock(&mu_);
  return static_cast<int>(waiters_.size());
}

std::optional<absl::Time> SimulatedClock::NextDeadline() {
  MutexLock lock(&mu_);
  if (waiters_.empty()) return std::nullopt;
  return (*waiters_.begin())->deadline;
}

bool SimulatedClock::BlockUntilWaiters(int n, absl::Duration real_timeout) {
  const absl::Time end = absl::Now() + real_timeout;
  MutexLock lock(&mu_);
  while (static_cast<int>(waiters_.size()) < n) {
    if (absl::Now() >= end) return false;
    sleep_cv_.WaitWithDeadline(&mu_, std::min(end, absl::Now() + kRecheck));
  }
  return true;
}

bool SimulatedClock::Settle(absl::Duration real_timeout) {
  const absl::Time end = absl::Now() + real_timeout;
  MutexLock lock(&mu_);
  while (!waiters_.empty() && (*waiters_.begin())->deadline <= now_) {
    if (absl::Now() >= end) return false;
    sleep_cv_.WaitWithDeadline(&mu_, std::min(end, absl::Now() + kRecheck));
  }
  return true;
}

bool SimulatedClock::AdvanceAndSettle(absl::Duration step,
                                      absl::Duration real_timeout) {
  const absl::Time end = absl::Now() + real_timeout;
  MutexLock lock(&mu_);
  const size_t before = waiters_.size();
  if (step > absl::ZeroDuration()) now_ += step;
  WakeDueLocked();
  // In this order: a thread due and not yet awake keeps the earliest
  // deadline at now; one still busy is not counted.
  while (waiters_.empty() || (*waiters_.begin())->deadline <= now_ ||
         waiters_.size() < before) {
    if (absl::Now() >= end) return false;
    sleep_cv_.WaitWithDeadline(&mu_, std::min(end, absl::Now() + kRecheck));
  }
  return true;
}

void SimulatedClock::RealPause(absl::Duration d) { absl::SleepFor(d); }

}  // namespace ferry
