// ControlPlane's threads: jobs reach the runner, the housekeeper sweeps on
// the engine's clock, and Stop ends them all (what runs next is
// control_queue_test's; what a job does, rail_lifecycle_test's).
#include "transport/rdma/control_plane.h"

#include <atomic>
#include <memory>

#include "absl/synchronization/notification.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::rdma {
namespace {

TEST(ControlPlaneTest, RunsJobsAndSweepsOnItsClock) {
  SimulatedClock clock;
  ControlQueue queue;
  ControlPlane plane(&queue);
  std::atomic<int> notices{0};
  std::atomic<int> sweeps{0};
  std::atomic<int64_t> last_sweep_ns{0};
  std::atomic<bool> idle{false};
  absl::Notification ran;
  ASSERT_OK(plane.Start(
      &clock,
      [&](const ControlJob& job) {
        if (job.kind == ControlJob::Kind::kNotice) ++notices;
        ran.Notify();
      },
      [&](int64_t now_ns) {
        last_sweep_ns = now_ns;
        ++sweeps;
        return idle.load() ? absl::InfiniteDuration() : absl::ZeroDuration();
      }));
  EXPECT_EQ(plane.threads(), ControlPlane::kControlThreads + 1);
  ControlJob job;
  job.kind = ControlJob::Kind::kNotice;
  queue.Push(job);
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(notices.load(), 1);
  // The housekeeper waits on the simulated clock: no sweep until it moves.
  EXPECT_EQ(sweeps.load(), 0);
  // Once the housekeeper waits on the clock, a step of its interval sweeps.
  ASSERT_TRUE(clock.BlockUntilWaiters(1));
  ASSERT_TRUE(clock.AdvanceAndSettle(ControlPlane::kHousekeepingInterval));
  EXPECT_EQ(sweeps.load(), 1);
  EXPECT_EQ(last_sweep_ns.load(), clock.NowNanos());
  // A sweep that finds nothing timed makes the next one come later: a
  // busy interval's step no longer sweeps, the idle interval's does.
  idle = true;
  ASSERT_TRUE(clock.AdvanceAndSettle(ControlPlane::kHousekeepingInterval));
  EXPECT_EQ(sweeps.load(), 2);
  ASSERT_TRUE(clock.AdvanceAndSettle(ControlPlane::kHousekeepingInterval));
  EXPECT_EQ(sweeps.load(), 2);
  ASSERT_TRUE(clock.AdvanceAndSettle(ControlPlane::kIdleHousekeepingInterval -
                                     ControlPlane::kHousekeepingInterval));
  EXPECT_EQ(sweeps.load(), 3);
  // A submission wakes an idle housekeeper at once, with no time passing.
  const int64_t before = last_sweep_ns.load();
  plane.WakeIfIdle();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (sweeps.load() < 4 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(sweeps.load(), 4);
  EXPECT_EQ(last_sweep_ns.load(), before);
  plane.BeginFarewell(clock.Now());
  plane.Stop();
  EXPECT_EQ(plane.threads(), 0);
}

TEST(ControlPlaneTest, StopWithoutStartIsHarmless) {
  ControlQueue queue;
  ControlPlane plane(&queue);
  plane.BeginFarewell(absl::InfinitePast());
  plane.Stop();
  plane.Stop();
  EXPECT_EQ(plane.threads(), 0);
}

}  // namespace
}  // namespace ferry::rdma
