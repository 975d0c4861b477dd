#include "metadata/watch_budget.h"

#include <string>
#include <thread>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::metadata {
namespace {

constexpr char kHost[] = "ipv4:10.0.0.1";
constexpr char kOther[] = "ipv4:10.0.0.2";

TEST(WatchBudgetTest, TheRealLimitsKeepTheShareRuleOfStreamCounts) {
  EXPECT_EQ(WatchBudget::kMaxBytesPerCaller, WatchBudget::kMaxBytes / 16);
  WatchBudget budget;
  EXPECT_OK(budget.Charge(kHost, WatchBudget::kMaxBytesPerCaller));
  EXPECT_STATUS(budget.Charge(kHost, 1), absl::StatusCode::kResourceExhausted);
}

// A caller holds at most its share, whatever it asks; a refused charge
// takes nothing, so what the caller and the service hold is unchanged,
// and another caller is still served.
TEST(WatchBudgetTest, ACallerHoldsAtMostItsShareAllOrNothing) {
  WatchBudget budget(/*max_bytes=*/1000, /*max_bytes_per_caller=*/100);
  ASSERT_OK(budget.Charge(kHost, 60));
  absl::Status refused = budget.Charge(kHost, 41);
  EXPECT_STATUS(refused, absl::StatusCode::kResourceExhausted);
  // The message says who, what it holds and the limit, and what the
  // watcher does.
  for (const char* part : {kHost, "hold 60 bytes", "(41 bytes)",
                           "limit per caller (100)", "refreshes"}) {
    EXPECT_NE(refused.message().find(part), std::string::npos)
        << part << " not in: " << refused.message();
  }
  EXPECT_EQ(budget.held(kHost), 60u);
  EXPECT_EQ(budget.total(), 60u);
  EXPECT_OK(budget.Charge(kHost, 40)) << "exactly the share fits";
  EXPECT_STATUS(budget.Charge(kHost, 1), absl::StatusCode::kResourceExhausted);
  EXPECT_OK(budget.Charge(kOther, 100));
  EXPECT_EQ(budget.total(), 200u);
  // Near the top of size_t: refused, not wrapped around into a fit.
  EXPECT_STATUS(budget.Charge(kOther, ~size_t{0}),
                absl::StatusCode::kResourceExhausted);
}

// Callers within their shares are still refused past the service's limit,
// which names the caller too; nothing is taken.
TEST(WatchBudgetTest, TheServiceHoldsAtMostItsLimit) {
  WatchBudget budget(/*max_bytes=*/250, /*max_bytes_per_caller=*/100);
  ASSERT_OK(budget.Charge("ipv4:10.0.0.3", 100));
  ASSERT_OK(budget.Charge(kOther, 100));
  ASSERT_OK(budget.Charge(kHost, 40));
  absl::Status refused = budget.Charge(kHost, 20);
  EXPECT_STATUS(refused, absl::StatusCode::kResourceExhausted);
  for (const char* part :
       {"hold 240 bytes", kHost, "which holds 40", "service's limit (250)"}) {
    EXPECT_NE(refused.message().find(part), std::string::npos)
        << part << " not in: " << refused.message();
  }
  EXPECT_EQ(budget.held(kHost), 40u);
  EXPECT_EQ(budget.total(), 240u);
  EXPECT_OK(budget.Charge(kHost, 10));
}

// Released bytes come back to the caller and to the service; releasing
// what was never charged (or more than is held) takes no one else's.
TEST(WatchBudgetTest, ReleasedBytesComeBack) {
  WatchBudget budget(/*max_bytes=*/150, /*max_bytes_per_caller=*/100);
  ASSERT_OK(budget.Charge(kHost, 100));
  ASSERT_OK(budget.Charge(kOther, 50));
  budget.Release(kHost, 70);
  EXPECT_EQ(budget.held(kHost), 30u);
  EXPECT_EQ(budget.total(), 80u);
  EXPECT_OK(budget.Charge(kHost, 70));
  budget.Release(kHost, 1000);
  EXPECT_EQ(budget.held(kHost), 0u);
  EXPECT_EQ(budget.held(kOther), 50u);
  EXPECT_EQ(budget.total(), 50u);
  budget.Release("ipv4:10.0.0.9", 50);
  EXPECT_EQ(budget.total(), 50u);
  EXPECT_OK(budget.Charge(kHost, 100));
}

// Lowered limits apply to new charges; what is held stays held.
TEST(WatchBudgetTest, LoweredLimitsRefuseNewChargesOnly) {
  WatchBudget budget(/*max_bytes=*/1000, /*max_bytes_per_caller=*/100);
  ASSERT_OK(budget.Charge(kHost, 80));
  budget.SetLimits(/*max_bytes=*/1000, /*max_bytes_per_caller=*/50);
  EXPECT_EQ(budget.held(kHost), 80u);
  EXPECT_STATUS(budget.Charge(kHost, 1), absl::StatusCode::kResourceExhausted);
  budget.Release(kHost, 40);
  EXPECT_OK(budget.Charge(kHost, 10));
}

// Streams charge and release from gRPC's threads and the notifier: the
// counts stay exact, and the service never holds more than its limit.
TEST(WatchBudgetTest, ChargesFromManyThreadsStayWithinTheLimits) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 2000;
  constexpr size_t kEvent = 10;
  WatchBudget budget(/*max_bytes=*/kThreads * kEvent,
                     /*max_bytes_per_caller=*/2 * kEvent);
  std::vector<std::thread> threads;
  std::vector<int> charged(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Two threads per caller: each caller's share is two events.
      const std::string caller = "ipv4:10.0.1." + std::to_string(t / 2);
      for (int i = 0; i < kRounds; ++i) {
        if (!budget.Charge(caller, kEvent).ok()) continue;
        ++charged[t];
        EXPECT_LE(budget.total(), kThreads * kEvent);
        EXPECT_LE(budget.held(caller), 2 * kEvent);
        budget.Release(caller, kEvent);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(charged[t], kRounds) << "thread " << t << " was refused room "
                                   << "that was its share";
  }
  EXPECT_EQ(budget.total(), 0u);
}

}  // namespace
}  // namespace ferry::metadata
