#include "transport/shm/shm_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::shm {
namespace {

uint64_t Owner(uint32_t tag) {
  return uint64_t{static_cast<uint32_t>(::getpid())} << 32 | tag;
}

std::unique_ptr<ShmTable> MakeTable(uint32_t buffers = 64,
                                    uint32_t lanes = kMinLanes) {
  auto t = ShmTable::Create(buffers, lanes);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(ShmTableTest, AttachChecksTheToken) {
  auto t = MakeTable();
  ASSERT_NE(t, nullptr);
  auto peer = ShmTable::Attach(::getpid(), t->fd(), t->token());
  ASSERT_OK(peer.status());
  EXPECT_EQ((*peer)->buffers(), 64u);
  EXPECT_EQ((*peer)->lanes(), kMinLanes);

  std::string wrong = t->token();
  wrong[0] ^= 1;
  auto other = ShmTable::Attach(::getpid(), t->fd(), wrong);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition)
      << other.status();
  EXPECT_TRUE(absl::StrContains(other.status().message(), "token"))
      << other.status();
}

TEST(ShmTableTest, AttachRefusesWhatIsNotATable) {
  const int f = ::open("/dev/zero", O_RDWR | O_CLOEXEC);
  ASSERT_GE(f, 0);
  auto zero = ShmTable::Attach(::getpid(), f, std::string(kTokenBytes, 'x'));
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kFailedPrecondition)
      << zero.status();
  ::close(f);
  // The right size, but not sealed: it could shrink under the mapping.
  const int m = ::memfd_create("not-sealed", MFD_CLOEXEC);
  ASSERT_GE(m, 0);
  ASSERT_EQ(::ftruncate(m, 1 << 20), 0);
  auto unsealed =
      ShmTable::Attach(::getpid(), m, std::string(kTokenBytes, 'x'));
  EXPECT_EQ(unsealed.status().code(), absl::StatusCode::kFailedPrecondition)
      << unsealed.status();
  EXPECT_TRUE(absl::StrContains(unsealed.status().message(), "sealed"))
      << unsealed.status();
  ::close(m);
  auto gone = ShmTable::Attach(::getpid(), 999999, "");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable)
      << gone.status();
}

TEST(ShmTableTest, CreateChecksItsLimits) {
  EXPECT_EQ(ShmTable::Create(0, kMinLanes).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmTable::Create(1, kMinLanes - 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmTable::Create(kMaxBuffers + 1, kMinLanes).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShmTableTest, KeysAreLiveUntilRemovedAndNeverReused) {
  auto t = MakeTable(2);
  ASSERT_NE(t, nullptr);
  auto peer = ShmTable::Attach(::getpid(), t->fd(), t->token());
  ASSERT_OK(peer.status());
  ASSERT_OK_AND_ASSIGN(uint64_t a, t->AddBuffer());
  ASSERT_OK_AND_ASSIGN(uint64_t b, t->AddBuffer());
  EXPECT_TRUE((*peer)->Live(a));
  EXPECT_TRUE((*peer)->Live(b));
  EXPECT_EQ(t->AddBuffer().status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_OK(t->RemoveBuffer(a, absl::Seconds(1), RealClock()));
  EXPECT_FALSE((*peer)->Live(a));
  EXPECT_TRUE((*peer)->Live(b));
  // The entry comes back with another generation: the old key stays dead.
  ASSERT_OK_AND_ASSIGN(uint64_t c, t->AddBuffer());
  EXPECT_EQ(c >> 32, a >> 32);
  EXPECT_NE(c, a);
  EXPECT_FALSE((*peer)->Live(a));
  EXPECT_TRUE((*peer)->Live(c));
  EXPECT_FALSE((*peer)->Live(0));
  EXPECT_FALSE((*peer)->Live(uint64_t{1000} << 32 | 1));  // Out of range.
  EXPECT_EQ(t->RemoveBuffer(a, absl::Seconds(1), RealClock()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShmTableTest, RemoveWaitsForACopyInProgress) {
  auto t = MakeTable();
  ASSERT_NE(t, nullptr);
  auto peer = ShmTable::Attach(::getpid(), t->fd(), t->token());
  ASSERT_OK(peer.status());
  ASSERT_OK_AND_ASSIGN(uint64_t key, t->AddBuffer());
  ASSERT_OK_AND_ASSIGN(uint32_t lane, (*peer)->ClaimLane(Owner(7)));
  (*peer)->Enter(lane);
  ASSERT_TRUE((*peer)->Live(key));
  // A live owner that does not leave its lane: Remove gives up, naming it.
  absl::Status s = t->RemoveBuffer(key, absl::Milliseconds(20), RealClock());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("pid ", ::getpid())))
      << s;
  // The entry is dead already: no new copy starts on it.
  EXPECT_FALSE((*peer)->Live(key));

  // Once the lane moves on, Remove returns.
  ASSERT_OK_AND_ASSIGN(uint64_t key2, t->AddBuffer());
  (*peer)->Exit(lane);
  (*peer)->Enter(lane);
  std::atomic<bool> left{false};
  std::thread copier([&] {
    absl::SleepFor(absl::Milliseconds(50));
    left.store(true);
    (*peer)->Exit(lane);
  });
  ASSERT_OK(t->RemoveBuffer(key2, absl::Seconds(10), RealClock()));
  EXPECT_TRUE(left.load());
  copier.join();
  (*peer)->ReleaseLane(lane, Owner(7));
}

// A copier that died inside a copy does not hold Remove up, even while it
// is a zombie (not reaped: a pid check would call it alive), and its lanes
// go to the next initiator.
TEST(ShmTableTest, ADeadOwnersLaneIsFreed) {
  auto t = MakeTable();
  ASSERT_NE(t, nullptr);
  ASSERT_OK_AND_ASSIGN(uint64_t key, t->AddBuffer());
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto peer = ShmTable::Attach(::getppid(), t->fd(), t->token());
    if (!peer.ok()) ::_exit(2);
    const uint64_t owner =
        uint64_t{static_cast<uint32_t>(::getpid())} << 32 | 1;
    // Every lane, each left inside a copy.
    for (uint32_t i = 0; i < kMinLanes; ++i) {
      auto lane = (*peer)->ClaimLane(owner);
      if (!lane.ok()) ::_exit(3);
      (*peer)->Enter(*lane);
    }
    ::_exit(0);
  }
  // Until the child is a zombie.
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);
  ASSERT_EQ(info.si_status, 0);
  const absl::Time start = absl::Now();
  ASSERT_OK(t->RemoveBuffer(key, absl::Seconds(10), RealClock()));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  auto peer = ShmTable::Attach(::getpid(), t->fd(), t->token());
  ASSERT_OK(peer.status());
  for (uint32_t i = 0; i < kMinLanes; ++i) {
    ASSERT_OK_AND_ASSIGN(uint32_t lane, (*peer)->ClaimLane(Owner(9)));
    (void)lane;
  }
  EXPECT_EQ((*peer)->ClaimLane(Owner(10)).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// A live owner's lane is never taken over, whatever its pid looks like.
TEST(ShmTableTest, ALiveOwnersLaneIsKept) {
  auto t = MakeTable();
  ASSERT_NE(t, nullptr);
  auto a = ShmTable::Attach(::getpid(), t->fd(), t->token());
  auto b = ShmTable::Attach(::getpid(), t->fd(), t->token());
  ASSERT_OK(a.status());
  ASSERT_OK(b.status());
  // An owner word naming a pid that does not exist, but a held lock.
  const uint64_t ghost = uint64_t{4194303} << 32 | 1;
  for (uint32_t i = 0; i < kMinLanes; ++i) {
    ASSERT_OK((*a)->ClaimLane(ghost).status());
  }
  EXPECT_EQ((*b)->ClaimLane(Owner(2)).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// The ordering argument, exercised: copiers that check then "copy" (bump
// the buffer's touch count) never touch a buffer after its Remove
// returned.
TEST(ShmTableTest, NoCopyAfterRemoveReturns) {
  auto t = MakeTable(4);
  ASSERT_NE(t, nullptr);
  auto peer = ShmTable::Attach(::getpid(), t->fd(), t->token());
  ASSERT_OK(peer.status());
  constexpr int kRounds = 300;
  std::atomic<uint64_t> current{0};
  std::atomic<bool> freed{false};
  std::atomic<bool> stop{false};
  std::atomic<int> violations{0};
  std::atomic<uint64_t> copies{0};
  std::vector<std::thread> copiers;
  for (int c = 0; c < 2; ++c) {
    copiers.emplace_back([&, c] {
      auto lane = (*peer)->ClaimLane(Owner(100 + c));
      if (!lane.ok()) return;
      while (!stop.load()) {
        const uint64_t key = current.load();
        (*peer)->Enter(*lane);
        if (key != 0 && (*peer)->Live(key)) {
          // The copy, which takes a while: it must never see the buffer
          // freed, at its start or its end.
          if (freed.load(std::memory_order_relaxed)) violations.fetch_add(1);
          for (volatile int i = 0; i < 2000; ++i) {
          }
          if (freed.load(std::memory_order_relaxed)) violations.fetch_add(1);
          copies.fetch_add(1);
        }
        (*peer)->Exit(*lane);
        // Three threads on as few as two cores: let the remover run.
        std::this_thread::yield();
      }
      (*peer)->ReleaseLane(*lane, Owner(100 + c));
    });
  }
  for (int r = 0; r < kRounds; ++r) {
    auto key = t->AddBuffer();
    ASSERT_OK(key.status());
    freed.store(false, std::memory_order_relaxed);
    const uint64_t before = copies.load();
    current.store(*key);
    // Remove while copies are going on: after the first copy of this key.
    for (int spin = 0; spin < 100000 && copies.load() == before; ++spin) {
      std::this_thread::yield();
    }
    ASSERT_OK(t->RemoveBuffer(*key, absl::Seconds(10), RealClock()));
    freed.store(true, std::memory_order_relaxed);
    // Give the copiers time to try the dead key.
    for (int spin = 0; spin < 200; ++spin) std::this_thread::yield();
  }
  stop.store(true);
  for (auto& c : copiers) c.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_GT(copies.load(), uint64_t{kRounds} / 2);
}

}  // namespace
}  // namespace ferry::shm
