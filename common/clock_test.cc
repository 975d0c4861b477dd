#include "common/clock.h"

#include <atomic>
#include <thread>

#include "absl/time/clock.h"
#include "common/mutex.h"
#include "common/simulated_clock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(RealClockTest, NowFollowsTheSystemClock) {
  const absl::Time before = absl::Now();
  const absl::Time now = RealClock()->Now();
  EXPECT_GE(now, before);
  EXPECT_LE(now, absl::Now());
  EXPECT_EQ(RealClock(), ClockOrReal(nullptr));
}

TEST(RealClockTest, SleepAndTimedWaitLastTheirDuration) {
  Clock* clock = RealClock();
  const absl::Time start = absl::Now();
  clock->SleepFor(absl::Milliseconds(20));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(20));

  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  const absl::Time deadline = clock->Now() + absl::Milliseconds(20);
  while (!clock->WaitWithDeadline(&cv, &mu, deadline)) {
  }
  EXPECT_GE(absl::Now(), deadline);
}

TEST(SimulatedClockTest, TimeMovesOnlyWhenAdvanced) {
  SimulatedClock clock;
  const absl::Time t0 = clock.Now();
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(clock.Now(), t0);
  clock.Advance(absl::Hours(2));
  EXPECT_EQ(clock.Now(), t0 + absl::Hours(2));
  clock.Advance(-absl::Seconds(1));  // Never backwards.
  clock.AdvanceTo(t0);
  EXPECT_EQ(clock.Now(), t0 + absl::Hours(2));
  EXPECT_EQ(clock.NowNanos(), absl::ToUnixNanos(t0 + absl::Hours(2)));
}

TEST(SimulatedClockTest, SleeperWakesExactlyAtItsDeadline) {
  SimulatedClock clock;
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(absl::Seconds(10));
    woke = true;
  });
  ASSERT_TRUE(clock.BlockUntilWaiters(1));
  EXPECT_EQ(clock.NextDeadline(), clock.Now() + absl::Seconds(10));
  clock.Advance(absl::Seconds(9));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(woke.load()) << "woke a second early";
  clock.Advance(absl::Seconds(1));
  sleeper.join();
  EXPECT_TRUE(woke.load());
  EXPECT_EQ(clock.waiters(), 0);
  EXPECT_FALSE(clock.NextDeadline().has_value());
}

TEST(SimulatedClockTest, TimedWaitEndsOnSignalOrOnDeadline) {
  SimulatedClock clock;
  Mutex mu;
  CondVar cv;
  bool flag = false;             // Guarded by mu.
  std::atomic<int> outcome{-1};  // 1: timed out, 0: signalled.

  // Waits up to a minute of the clock for `flag`.
  auto wait_a_minute = [&] {
    MutexLock lock(&mu);
    const absl::Time deadline = clock.Now() + absl::Minutes(1);
    bool timed_out = false;
    while (!flag && !timed_out) {
      timed_out = clock.WaitWithDeadline(&cv, &mu, deadline);
    }
    outcome = timed_out ? 1 : 0;
  };

  // Signalled before its deadline: returns false, no time has passed.
  std::thread waiter(wait_a_minute);
  ASSERT_TRUE(clock.BlockUntilWaiters(1));
  {
    MutexLock lock(&mu);
    flag = true;
  }
  cv.SignalAll();
  waiter.join();
  EXPECT_EQ(outcome.load(), 0);

  // Not signalled: times out when the clock reaches the deadline, however
  // long that takes in real time.
  flag = false;
  outcome = -1;
  std::thread waiter2(wait_a_minute);
  ASSERT_TRUE(clock.BlockUntilWaiters(1));
  absl::SleepFor(absl::Milliseconds(30));  // Many real rechecks.
  EXPECT_EQ(outcome.load(), -1) << "timed out with no simulated time passed";
  clock.Advance(absl::Minutes(1));
  waiter2.join();
  EXPECT_EQ(outcome.load(), 1);
}

// A signal that races a real recheck's expiry must still reach the
// caller's loop (an earlier version waited again inside the clock and slept
// through it: about 1 in 15 rounds hung).
TEST(SimulatedClockTest, NoSignalIsLostToARecheck) {
  SimulatedClock clock;
  for (int round = 0; round < 300; ++round) {
    Mutex mu;
    CondVar cv;
    bool flag = false;  // Guarded by mu.
    std::atomic<bool> done{false};
    std::thread waiter([&] {
      MutexLock lock(&mu);
      while (!flag) clock.WaitWithDeadline(&cv, &mu, absl::InfiniteFuture());
      done = true;
    });
    // Land the signal anywhere in the 2 ms recheck window.
    absl::SleepFor(absl::Microseconds(round % 23 * 100));
    {
      MutexLock lock(&mu);
      flag = true;
    }
    cv.SignalAll();
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (!done.load() && absl::Now() < give_up) {
      absl::SleepFor(absl::Microseconds(200));
    }
    EXPECT_TRUE(done.load()) << "round " << round << ": the signal was lost";
    if (!done.load()) clock.AdvanceTo(absl::InfiniteFuture());  // Release it.
    waiter.join();
    if (!done.load()) break;
  }
}

TEST(SimulatedClockTest, PastDeadlineReturnsAtOnce) {
  SimulatedClock clock;
  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  EXPECT_TRUE(clock.WaitWithDeadline(&cv, &mu, clock.Now()));
  clock.SleepUntil(clock.Now() - absl::Seconds(1));
  EXPECT_EQ(clock.waiters(), 0);
}

TEST(SimulatedClockTest, BlockUntilWaitersTimesOutInRealTime) {
  SimulatedClock clock;
  EXPECT_FALSE(clock.BlockUntilWaiters(1, absl::Milliseconds(10)));
}

TEST(SimulatedClockTest, AdvanceUntilStopsAtTheNextDeadline) {
  SimulatedClock clock;
  const absl::Time t0 = clock.Now();
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(absl::Milliseconds(100));
    woke = true;
  });
  ASSERT_TRUE(clock.BlockUntilWaiters(1));
  // Steps of a second, but the sleeper's deadline comes first.
  EXPECT_TRUE(clock.AdvanceUntil([&] { return woke.load(); }, absl::Seconds(10),
                                 absl::Seconds(1)));
  sleeper.join();
  EXPECT_EQ(clock.Now() - t0, absl::Milliseconds(100));

  // Never done: stops after the limit.
  EXPECT_FALSE(clock.AdvanceUntil([] { return false; }, absl::Seconds(3),
                                  absl::Seconds(1)));
  EXPECT_EQ(clock.Now() - t0, absl::Milliseconds(3100));
}

TEST(SimulatedClockTest, AdvanceAndSettleReturnsOnceTheDueWorkIsDone) {
  // A loop that always waits again, as a housekeeper does: each settled
  // step has run exactly one more tick by the time it returns.
  SimulatedClock clock;
  std::atomic<int> ticks{0};
  std::atomic<bool> stop{false};
  std::thread ticker([&] {
    while (!stop.load()) {
      clock.SleepFor(absl::Milliseconds(100));
      absl::SleepFor(absl::Milliseconds(2));  // The tick's work takes time.
      ++ticks;
    }
  });
  ASSERT_TRUE(clock.BlockUntilWaiters(1));
  for (int i = 1; i <= 5; ++i) {
    ASSERT_TRUE(clock.AdvanceAndSettle(absl::Milliseconds(100)));
    EXPECT_EQ(ticks.load(), i) << "returned before tick " << i << " was done";
  }
  stop = true;
  clock.Advance(absl::Milliseconds(100));
  ticker.join();
}

}  // namespace
}  // namespace ferry
