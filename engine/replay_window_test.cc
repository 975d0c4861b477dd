#include "engine/replay_window.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(ReplayWindowsTest, EachNumberOnce) {
  ReplayWindows w;
  EXPECT_OK(w.Accept("a", "k", 5));
  EXPECT_EQ(w.Accept("a", "k", 5).code(), absl::StatusCode::kPermissionDenied);
  // Gaps and reordering within the window are fine; each number once.
  EXPECT_OK(w.Accept("a", "k", 9));
  EXPECT_OK(w.Accept("a", "k", 7));
  EXPECT_OK(w.Accept("a", "k", 6));
  EXPECT_FALSE(w.Accept("a", "k", 7).ok());
  EXPECT_FALSE(w.Accept("a", "k", 9).ok());
  // Another sender has its own numbers.
  EXPECT_OK(w.Accept("b", "k", 5));
}

TEST(ReplayWindowsTest, ZeroIsNoNumber) {
  ReplayWindows w;
  EXPECT_EQ(w.Accept("a", "k", 0).code(), absl::StatusCode::kPermissionDenied);
}

TEST(ReplayWindowsTest, TooOldIsRefused) {
  ReplayWindows w;
  EXPECT_OK(w.Accept("a", "k", 1));
  EXPECT_OK(w.Accept("a", "k", 1 + ReplayWindows::kWindow));
  // 1 is kWindow behind: refused, as a replay of it would be.
  const absl::Status old = w.Accept("a", "k", 1);
  EXPECT_EQ(old.code(), absl::StatusCode::kFailedPrecondition) << old;
  EXPECT_NE(old.message().find("too old"), std::string::npos) << old;
  // The newest kWindow numbers are still told apart.
  EXPECT_OK(w.Accept("a", "k", 2));
  EXPECT_FALSE(w.Accept("a", "k", 2).ok());
}

TEST(ReplayWindowsTest, SlidingClearsTheBitsItPasses) {
  constexpr uint64_t kW = ReplayWindows::kWindow;
  ReplayWindows w;
  EXPECT_OK(w.Accept("a", "k", 10));
  // Moving the top from 10 to 10 + kW - 4 passes 10 + kW - 4 .. 11's bits
  // (the slots of 10 + kW - 4's predecessors): 10's slot is the next to
  // be reused, by 10 + kW, and must have been cleared by then.
  EXPECT_OK(w.Accept("a", "k", 10 + kW - 4));
  EXPECT_OK(w.Accept("a", "k", 10 + kW + 3));  // Passes 10 + kW, 10's slot.
  // 10 + kW was never received: its slot (10's) must read empty.
  EXPECT_OK(w.Accept("a", "k", 10 + kW));
  EXPECT_FALSE(w.Accept("a", "k", 10 + kW).ok());
  // A jump of more than a window forgets everything below.
  EXPECT_OK(w.Accept("a", "k", 100 * kW));
  EXPECT_OK(w.Accept("a", "k", 100 * kW - 1));
  EXPECT_EQ(w.Accept("a", "k", 12).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ReplayWindowsTest, BoundedLeastRecentlyUsedFirst) {
  ReplayWindows w;
  EXPECT_OK(w.Accept("keep", "k", 1));
  for (size_t i = 0; i + 1 < ReplayWindows::kMaxSenders; ++i) {
    ASSERT_OK(w.Accept(absl::StrCat("s", i), "k", 1));
  }
  EXPECT_EQ(w.senders(), ReplayWindows::kMaxSenders);
  EXPECT_OK(w.Accept("keep", "k", 2));  // Now the most recently used.
  EXPECT_OK(w.Accept("new", "k", 1));   // Evicts s0, the least recently used.
  EXPECT_EQ(w.senders(), ReplayWindows::kMaxSenders);
  EXPECT_FALSE(w.Accept("keep", "k", 2).ok());  // Still remembered.
  // s0's window is gone, its tombstone is not: the replay of its message 1
  // is refused, and its next message goes through.
  EXPECT_EQ(w.tombstones(), 1u);
  EXPECT_EQ(w.Accept("s0", "k", 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(w.Accept("s0", "k", 2));
  // s1 (evicted by s0) restarted meanwhile: a new key starts over.
  EXPECT_OK(w.Accept("s1", "k2", 1));
}

// A sender that restarts signs with a new key: its numbers start over, in
// the same window (one per name, however often its owner changes keys).
TEST(ReplayWindowsTest, NewKeyStartsOver) {
  ReplayWindows w;
  EXPECT_OK(w.Accept("a", "k1", 7));
  EXPECT_OK(w.Accept("a", "k2", 1));
  EXPECT_EQ(w.Accept("a", "k2", 1).code(), absl::StatusCode::kPermissionDenied);
  for (int i = 0; i < 100; ++i) {
    ASSERT_OK(w.Accept("a", absl::StrCat("rotated", i), 1));
  }
  EXPECT_EQ(w.senders(), 1u);
}

}  // namespace
}  // namespace ferry
