#include "transport/memory_registry.h"

#include <thread>

#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

MemoryRegion R(uintptr_t addr, size_t len, bool remote = true) {
  MemoryRegion r;
  r.addr = addr;
  r.length = len;
  r.remote_accessible = remote;
  return r;
}

TEST(MemoryRegistryTest, AddRejectsBadAndOverlapping) {
  MemoryRegistry reg;
  EXPECT_EQ(reg.Add(R(0, 10)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Add(R(0x1000, 0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Add(R(~uintptr_t{0} - 4, 10)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK(reg.Add(R(0x1000, 0x1000)));
  EXPECT_EQ(reg.Add(R(0x1800, 0x1000)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(reg.Add(R(0x800, 0x1000)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(reg.Add(R(0x1000, 1)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_OK(reg.Add(R(0x2000, 0x10)));  // Adjacent is fine.
  EXPECT_OK(reg.Add(R(0xff0, 0x10)));
  EXPECT_EQ(reg.size(), 3u);
}

TEST(MemoryRegistryTest, LookupNeedsWholeRangeInOneBuffer) {
  MemoryRegistry reg;
  ASSERT_OK(reg.Add(R(0x1000, 0x1000)));
  ASSERT_OK(reg.Add(R(0x2000, 0x1000, /*remote=*/false)));
  EXPECT_TRUE(reg.Contains(0x1000, 0x1000, true));
  EXPECT_TRUE(reg.Contains(0x1fff, 1, true));
  EXPECT_FALSE(reg.Contains(0x1fff, 2, true));  // Spans two buffers.
  EXPECT_FALSE(reg.Contains(0xfff, 2, true));
  EXPECT_FALSE(reg.Contains(0x2000, 1, true));  // Not remote-accessible.
  EXPECT_TRUE(reg.Contains(0x2000, 1, false));
  EXPECT_FALSE(reg.Contains(0x3000, 1, false));
  EXPECT_FALSE(reg.Contains(0x1000, ~size_t{0}, false));  // Wraps.
  EXPECT_EQ(reg.Acquire(0x2000, 1, true).status().code(),
            absl::StatusCode::kPermissionDenied);
}

// On a SimulatedClock: Remove gives up once its wait has passed
// on the registry's clock, and ends at once when the last lease goes.
TEST(MemoryRegistryTest, RemoveWaitsForLeases) {
  SimulatedClock clock;
  MemoryRegistry reg(&clock);
  ASSERT_OK(reg.Add(R(0x1000, 0x1000)));
  auto lease = reg.Acquire(0x1100, 0x10, true);
  ASSERT_OK(lease);
  // Refused once 20 ms passed with the lease held; the buffer stays usable.
  absl::Status refused;
  std::thread remover(
      [&] { refused = reg.Remove(0x1000, absl::Milliseconds(20)); });
  EXPECT_TRUE(clock.BlockUntilWaiters(1));  // Not ASSERT: join below.
  clock.Advance(absl::Milliseconds(20));
  remover.join();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(reg.Contains(0x1000, 1, true));
  // Released while Remove waits: removed with no time passing.
  absl::Status removed;
  remover =
      std::thread([&] { removed = reg.Remove(0x1000, absl::Seconds(5)); });
  EXPECT_TRUE(clock.BlockUntilWaiters(1));  // Not ASSERT: join below.
  lease->Release();
  remover.join();
  EXPECT_OK(removed);
  EXPECT_FALSE(reg.Contains(0x1000, 1, true));
  EXPECT_EQ(reg.Remove(0x1000, absl::ZeroDuration()).code(),
            absl::StatusCode::kNotFound);
}

// AwaitReservations ends when the reservation goes, or at its deadline on
// the registry's clock (false then).
TEST(MemoryRegistryTest, AwaitReservationsEndsWithTheReservationOrDeadline) {
  SimulatedClock clock;
  MemoryRegistry reg(&clock);
  ASSERT_OK(reg.Reserve(R(0x1000, 0x1000)));
  bool settled = true;
  std::thread waiter([&] {
    settled = reg.AwaitReservations(0x1800, 0x10,
                                    clock.Now() + absl::Milliseconds(10));
  });
  EXPECT_TRUE(clock.BlockUntilWaiters(1));  // Not ASSERT: join below.
  clock.Advance(absl::Milliseconds(10));
  waiter.join();
  EXPECT_FALSE(settled);
  waiter = std::thread([&] {
    settled =
        reg.AwaitReservations(0x1800, 0x10, clock.Now() + absl::Seconds(5));
  });
  EXPECT_TRUE(clock.BlockUntilWaiters(1));  // Not ASSERT: join below.
  reg.CancelReservation(0x1000);
  waiter.join();
  EXPECT_TRUE(settled);
}

TEST(MemoryRegistryTest, RemoveNeedsStartAddress) {
  MemoryRegistry reg;
  ASSERT_OK(reg.Add(R(0x1000, 0x1000)));
  EXPECT_EQ(reg.Remove(0x1001, absl::ZeroDuration()).code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace ferry
