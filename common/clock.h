// Clock: the one way Ferry reads and waits on time. Every production path
// that reads the time (lease expiry, transfer deadlines, backoff,
// keepalives, housekeeping, idle timeouts, rate-limited logs) or waits
// until a moment (a sleep, a condition variable's timed wait, a periodic
// thread) takes a Clock* instead of calling absl::Now, absl::SleepFor or
// std::chrono clocks directly.
//
// Why: the engine's lease, deadline and backoff behaviour is a function of
// time. On the real clock a test of it has to wait in real time and fails
// when a loaded machine preempts a thread past a bound. On a
// SimulatedClock (common/simulated_clock.h) time moves only when the test
// advances it, so such a test runs in milliseconds and is exact.
//
// Components take the clock in their options (EngineOptions::clock and
// the options each component embeds), defaulting to RealClock(); a test
// passes a SimulatedClock. Timeouts handed to other libraries (gRPC
// deadlines, poll(2) timeouts, the kernel's socket timers) stay on real
// time: the clock cannot move them, and each such site says so.
//
// Thread-safe: every method may be called from any thread.
#ifndef FERRY_COMMON_CLOCK_H_
#define FERRY_COMMON_CLOCK_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace ferry {

class Clock {
 public:
  virtual ~Clock() = default;

  // The current time.
  virtual absl::Time Now() = 0;
  // Blocks the calling thread until Now() >= deadline (at once if it has
  // passed).
  virtual void SleepUntil(absl::Time deadline) = 0;
  // Waits on `cv` with `mu` held until the cv is signalled or Now() >=
  // deadline; `mu` is held again on return. Returns true if the deadline
  // passed. Like CondVar::Wait it may wake spuriously: callers loop on
  // their condition and on this result.
  virtual bool WaitWithDeadline(CondVar* cv, Mutex* mu, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;

  // Conveniences over the three above.
  int64_t NowNanos() { return absl::ToUnixNanos(Now()); }
  void SleepFor(absl::Duration d) { SleepUntil(Now() + d); }
  bool WaitWithTimeout(CondVar* cv, Mutex* mu, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitWithDeadline(cv, mu, Now() + timeout);
  }
};

// The system's clock (absl::Now, real sleeps and timed waits). A process
// singleton, never destroyed; the default of every clock option.
Clock* RealClock();

// `clock` if set, else RealClock(): for options whose clock may be null.
inline Clock* ClockOrReal(Clock* clock) {
  return clock != nullptr ? clock : RealClock();
}

}  // namespace ferry

#endif  // FERRY_COMMON_CLOCK_H_
