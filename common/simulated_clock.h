// SimulatedClock: a Clock for tests whose time moves only when the test
// advances it. A thread that sleeps or waits on it until a deadline wakes
// when Advance/AdvanceTo reaches that deadline (or, for a wait, when its
// condition variable is signalled), never because real time passed.
//
//   SimulatedClock clock;
//   options.clock = &clock;
//   ... start the component ...
//   ASSERT_TRUE(clock.BlockUntilWaiters(1));  // its reaper is waiting
//   clock.Advance(lease + absl::Milliseconds(1));
//   ... the lease has expired, in no real time ...
//
// Thread-safe.
#ifndef FERRY_COMMON_SIMULATED_CLOCK_H_
#define FERRY_COMMON_SIMULATED_CLOCK_H_

#include <algorithm>
#include <optional>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"

namespace ferry {

class SimulatedClock final : public Clock {
 public:
  // Time starts at `start` (default: a fixed date, 2026-01-01 UTC, so that
  // runs are reproducible and durations from the epoch look realistic).
  explicit SimulatedClock(absl::Time start = absl::FromUnixSeconds(1767225600));
  SimulatedClock(const SimulatedClock&) = delete;
  SimulatedClock& operator=(const SimulatedClock&) = delete;
  // No thread may be waiting on the clock when it is destroyed.
  ~SimulatedClock() override;

  absl::Time Now() override;
  void SleepUntil(absl::Time deadline) override;
  bool WaitWithDeadline(CondVar* cv, Mutex* mu, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Moves time forward by `d` (a negative `d` is treated as zero: time
  // never goes back) and wakes every thread whose deadline is now due.
  void Advance(absl::Duration d);
  // Moves time to `t` if it is later than now, as Advance.
  void AdvanceTo(absl::Time t);
  // Advances by `step`, then waits (real time, at most `real_timeout`)
  // until every thread that waited on the clock before the step waits
  // again on a later deadline: what fell due has been done before time
  // moves on. For threads that always wait again (a housekeeper, a
  // reaper); one that stops waiting for good holds it for the whole
  // bound, which is why AdvanceUntil settles by a weaker rule. Returns
  // whether it settled within the bound.
  bool AdvanceAndSettle(absl::Duration step,
                        absl::Duration real_timeout = absl::Seconds(10));

  // Threads sleeping or waiting with a deadline on this clock now. A
  // thread in a timed wait leaves the count for a moment every few
  // milliseconds of real time (each real wait is bounded; see
  // WaitWithDeadline in the .cc), so a test waits for a count with
  // BlockUntilWaiters rather than reading it once.
  int waiters();
  // The earliest deadline a thread waits for, if any.
  std::optional<absl::Time> NextDeadline();
  // Blocks until at least `n` threads wait on this clock, or until
  // `real_timeout` of real time passed (false then): how a test knows a
  // background thread has reached its timed wait before it advances time.
  // A thread that an advance woke counts until it has run: after an
  // advance, Settle first.
  bool BlockUntilWaiters(int n,
                         absl::Duration real_timeout = absl::Seconds(30));
  // Lets the threads an advance woke run: returns true once no thread
  // waits on a deadline that has come (each woken one has left its wait),
  // false after `real_timeout` of real time.
  bool Settle(absl::Duration real_timeout = absl::Seconds(10));
  // Advances in steps of at most `step` (shorter where a waiter's deadline
  // comes first) until `done()` is true or `limit` of simulated time has
  // passed; after each step it Settles and then pauses `settle` of real
  // time (for loops that wait in poll(2), which the clock cannot see), so
  // a loaded machine slows the test down instead of letting simulated
  // time run ahead of the threads. Returns whether `done()` held. For
  // tests of loops that re-arm their own timers (back-off, keepalives,
  // reapers). Deadlines are best effort: a loop that waits in poll(2)
  // rather than on the clock, or a timed waiter between two of its
  // bounded real waits, is not seen, and the step bounds the overshoot.
  template <typename Done>
  bool AdvanceUntil(Done done, absl::Duration limit, absl::Duration step,
                    absl::Duration settle = absl::Milliseconds(1));

 private:
  struct Waiter {
    absl::Time deadline;
    CondVar* cv;  // null for a sleeper (woken through sleep_cv_).
  };
  struct ByDeadline {
    bool operator()(const Waiter* a, const Waiter* b) const {
      return a->deadline < b->deadline || (a->deadline == b->deadline && a < b);
    }
  };
  void WakeDueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A pause in real time, for AdvanceUntil.
  static void RealPause(absl::Duration d);

  Mutex mu_;
  // Sleepers, BlockUntilWaiters and Settle wait here; signalled whenever
  // a waiter comes or goes.
  CondVar sleep_cv_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  std::set<Waiter*, ByDeadline> waiters_ ABSL_GUARDED_BY(mu_);
};

template <typename Done>
bool SimulatedClock::AdvanceUntil(Done done, absl::Duration limit,
                                  absl::Duration step, absl::Duration settle) {
  const absl::Time end = Now() + limit;
  while (!done()) {
    const absl::Time now = Now();
    if (now >= end) return false;
    absl::Time target = std::min(now + step, end);
    const std::optional<absl::Time> next = NextDeadline();
    if (next.has_value() && *next > now && *next < target) target = *next;
    AdvanceTo(target);
    Settle();
    RealPause(settle);
  }
  return true;
}

}  // namespace ferry

#endif  // FERRY_COMMON_SIMULATED_CLOCK_H_
