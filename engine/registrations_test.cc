// Registrations with no transport and an in-memory metadata store, all on
// the test's thread: what the application registers (all or nothing),
// how it is leased, unregistered and published, and the MR cache's
// registrations of memory on first use.
#include "engine/registrations.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/segment_store.h"
#include "metadata/store_testing.h"

namespace ferry {
namespace {

constexpr char kSegment[] = "engine";

class RegistrationsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registrations_.Configure(/*mr_cache_bytes=*/0, RealClock());
    ASSERT_OK(publisher_.Publish(metadata::TestSegment(kSegment, 7, 0)));
  }

  // The buffers the store holds for this engine's segment.
  std::vector<uint64_t> Published() {
    std::vector<uint64_t> out;
    auto segment = store_.Get(kSegment);
    EXPECT_OK(segment);
    if (!segment.ok()) return out;
    for (const auto& b : segment->buffers()) out.push_back(b.addr());
    return out;
  }

  uintptr_t Addr(size_t offset = 0) const {
    return reinterpret_cast<uintptr_t>(memory_.data()) + offset;
  }
  void* At(size_t offset) { return memory_.data() + offset; }

  std::vector<char> memory_ = std::vector<char>(1 << 16);
  metadata::SegmentStore store_;
  // No lease, so no renewals: nothing runs beside the test.
  SegmentPublisher publisher_{&store_, metadata::TestOwnerKey(7),
                              absl::ZeroDuration()};
  std::vector<std::unique_ptr<Transport>> transports_;  // None.
  Registrations registrations_{&transports_};
};

TEST_F(RegistrationsTest, RegisteredMemoryIsLeasedUntilUnregistered) {
  ASSERT_OK(registrations_.Register({{At(0), 4096}}, "", false, &publisher_));
  {
    ASSERT_OK_AND_ASSIGN(MemoryRegistry::Lease lease,
                         registrations_.AcquireLocal(Addr(100), 200));
    EXPECT_EQ(lease.region().addr, Addr());
    EXPECT_EQ(lease.region().location, "*");
  }
  EXPECT_STATUS(registrations_.AcquireLocal(Addr(4000), 200),
                absl::StatusCode::kInvalidArgument);
  // Not remote-accessible: never published.
  EXPECT_TRUE(Published().empty());
  ASSERT_OK(
      registrations_.Unregister({At(0)}, absl::ZeroDuration(), &publisher_));
  EXPECT_STATUS(registrations_.AcquireLocal(Addr(100), 200),
                absl::StatusCode::kInvalidArgument);
}

TEST_F(RegistrationsTest, RemoteAccessibleBuffersArePublished) {
  ASSERT_OK(registrations_.Register({{At(0), 4096}, {At(8192), 4096}}, "cpu:0",
                                    true, &publisher_));
  EXPECT_EQ(Published(), (std::vector<uint64_t>{Addr(0), Addr(8192)}));
  ASSERT_OK(
      registrations_.Unregister({At(0)}, absl::ZeroDuration(), &publisher_));
  EXPECT_EQ(Published(), (std::vector<uint64_t>{Addr(8192)}));
}

TEST_F(RegistrationsTest, ABatchIsAllOrNothing) {
  // The second overlaps the first.
  const absl::Status s = registrations_.Register(
      {{At(0), 4096}, {At(1024), 4096}}, "", true, &publisher_);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_NE(s.message().find("buffer 1 of 2"), std::string::npos) << s;
  EXPECT_STATUS(registrations_.AcquireLocal(Addr(0), 64),
                absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Published().empty());
  // Nothing was left behind to overlap.
  EXPECT_OK(registrations_.Register({{At(0), 4096}}, "", true, &publisher_));
}

TEST_F(RegistrationsTest, BadRequestsAreRefused) {
  EXPECT_STATUS(registrations_.Register({{At(0), 4096}}, std::string(65, 'x'),
                                        false, &publisher_),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(
      registrations_.Unregister({At(0)}, absl::ZeroDuration(), &publisher_),
      absl::StatusCode::kNotFound);
  // Among several, the error names its buffer.
  const absl::Status s = registrations_.Unregister(
      {At(0), At(64)}, absl::ZeroDuration(), &publisher_);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(s.message().rfind("0x", 0), 0u) << s;
}

TEST_F(RegistrationsTest, ABufferInUseStaysRegistered) {
  ASSERT_OK(registrations_.Register({{At(0), 4096}}, "", false, &publisher_));
  {
    ASSERT_OK_AND_ASSIGN(MemoryRegistry::Lease lease,
                         registrations_.AcquireLocal(Addr(0), 64));
    EXPECT_STATUS(
        registrations_.Unregister({At(0)}, absl::ZeroDuration(), &publisher_),
        absl::StatusCode::kFailedPrecondition);
    // Still registered, and leasable.
    EXPECT_OK(registrations_.AcquireLocal(Addr(0), 64));
  }
  EXPECT_OK(
      registrations_.Unregister({At(0)}, absl::ZeroDuration(), &publisher_));
}

// The MR cache registers what a request names unregistered, serves it
// again from the cache, gives way to the application's own registration,
// and drops what the process unmapped.
TEST_F(RegistrationsTest, TheCacheRegistersOnFirstUse) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  registrations_.Configure(/*mr_cache_bytes=*/1 << 20, RealClock());
  ASSERT_OK(registrations_.StartCache());
  char* arena =
      static_cast<char*>(mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(arena, MAP_FAILED);
  const uintptr_t a = reinterpret_cast<uintptr_t>(arena);
  {
    ASSERT_OK_AND_ASSIGN(MemoryRegistry::Lease lease,
                         registrations_.AcquireLocal(a + 100, 200));
    // A page-aligned cover of the range.
    EXPECT_EQ(lease.region().addr, a);
    EXPECT_EQ(lease.region().length, page);
    EXPECT_OK(registrations_.AcquireLocal(a + 300, 200));  // A hit.
  }
  EXPECT_EQ(registrations_.cache_stats().registrations, 1u);
  EXPECT_EQ(registrations_.cache_stats().bytes, page);

  // The application's registration takes the cached one's place.
  ASSERT_OK(registrations_.Register({{arena, page}}, "", false, &publisher_));
  EXPECT_EQ(registrations_.cache_stats().registrations, 0u);
  ASSERT_OK(
      registrations_.Unregister({arena}, absl::ZeroDuration(), &publisher_));

  // Memory given back to the kernel is dropped from the cache, and is no
  // longer registered on use.
  EXPECT_OK(registrations_.AcquireLocal(a + 2 * page, 64));
  EXPECT_EQ(registrations_.cache_stats().registrations, 1u);
  ASSERT_EQ(munmap(arena + 2 * page, 2 * page), 0);
  const absl::Status unmapped =
      registrations_.AcquireLocal(a + 2 * page, 64).status();
  EXPECT_EQ(unmapped.code(), absl::StatusCode::kInvalidArgument) << unmapped;
  EXPECT_NE(unmapped.message().find("not mapped"), std::string::npos)
      << unmapped;
  EXPECT_EQ(registrations_.cache_stats().registrations, 0u);
  EXPECT_EQ(registrations_.cache_stats().invalidations, 1u);
  registrations_.StopCache();
  munmap(arena, 2 * page);
}

}  // namespace
}  // namespace ferry
