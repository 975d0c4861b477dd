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
      ASSERT_OK(
          pool.Submit(absl::StrCat("caller-", i % 10), [&ran] { ++ran; }));
    }
  }
  EXPECT_EQ(ran.load(), 100);
}

// One caller's burst takes its own slots, not everyone's; the total cap
// holds over all callers; slots come back when tasks end.
TEST(CallPoolTest, CapsPerCallerAndInTotal) {
  CallPoolOptions o;
  o.max_threads = 2;
  o.max_tasks = 5;
  o.max_tasks_per_caller = 3;
  absl::Notification release;
  std::atomic<int> ran{0};
  auto blocked = [&] {
    release.WaitForNotification();
    ++ran;
  };
  CallPool pool(o);
  for (int i = 0; i < 3; ++i) ASSERT_OK(pool.Submit("hog", blocked));
  absl::Status s = pool.Submit("hog", blocked);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("hog"), std::string::npos) << s;
  ASSERT_OK(pool.Submit("other", blocked));
  ASSERT_OK(pool.Submit("third", blocked));
  s = pool.Submit("fourth", blocked);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_LE(pool.threads(), 2);
  release.Notify();
  // Once they drain, the hog may submit again.
  absl::Status again;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    again = pool.Submit("hog", [&ran] { ++ran; });
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(1));
  } while (!again.ok() && absl::Now() < deadline);
  EXPECT_OK(again);
}

}  // namespace
}  // namespace ferry::metadata
