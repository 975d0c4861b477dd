#include "metadata/call_pool.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::metadata {
namespace {

TEST(CallPoolTest, RunsTasksAndWaitsForThemOnDestruction) {
  std::atomic<int> ran{0};
  {
    CallPool pool;
    for (int i = 0; i < 100; ++i) {
      ASSERT_OK(pool.Run([&ran] { ++ran; }));
    }
  }
  EXPECT_EQ(ran.load(), 100);
}

// A burst of blocking tasks gets threads up to the cap, not one thread
// that runs them one after another.
TEST(CallPoolTest, ABurstStartsThreadsUpToTheCap) {
  CallPoolOptions o;
  o.max_threads = 4;
  CallPool pool(o);
  absl::Notification release;
  std::atomic<int> running{0};
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK(pool.Run([&] {
      ++running;
      release.WaitForNotification();
    }));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (running.load() < 4 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(running.load(), 4);
  EXPECT_EQ(pool.threads(), 4);
  release.Notify();
  pool.WaitIdle();
  EXPECT_EQ(running.load(), 8);
}

// Calls are counted from admission to release, per caller and in total:
// one caller's calls take its own share, not everyone's.
TEST(CallPoolTest, CapsCallsPerCallerAndInTotal) {
  CallPoolOptions o;
  o.max_calls = 5;
  o.max_calls_per_caller = 3;
  CallPool pool(o);
  for (int i = 0; i < 3; ++i) ASSERT_OK(pool.Admit("hog"));
  absl::Status s = pool.Admit("hog");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("hog"), std::string::npos) << s;
  ASSERT_OK(pool.Admit("other"));
  ASSERT_OK(pool.Admit("third"));
  s = pool.Admit("fourth");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(pool.calls(), 5);
  pool.Release("hog", 0);
  EXPECT_OK(pool.Admit("hog"));
  for (const char* c : {"hog", "hog", "hog", "other", "third"}) {
    pool.Release(c, 0);
  }
  EXPECT_EQ(pool.calls(), 0);
}

// Undelivered responses are capped in bytes, per caller and in total, and
// the bytes come back with the call.
TEST(CallPoolTest, CapsResponseBytes) {
  CallPoolOptions o;
  o.max_response_bytes = 1000;
  o.max_response_bytes_per_caller = 600;
  CallPool pool(o);
  ASSERT_OK(pool.Admit("a"));
  ASSERT_OK(pool.Charge("a", 500));
  ASSERT_OK(pool.Admit("a"));
  absl::Status s = pool.Charge("a", 200);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("per caller"), std::string::npos) << s;
  ASSERT_OK(pool.Admit("b"));
  ASSERT_OK(pool.Charge("b", 450));
  ASSERT_OK(pool.Admit("c"));
  s = pool.Charge("c", 100);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  pool.Release("a", 500);
  EXPECT_OK(pool.Charge("c", 100));
}

}  // namespace
}  // namespace ferry::metadata
