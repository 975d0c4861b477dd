// The MR cache never hands a NIC stale memory: when the application frees
// or unmaps a source the cache registered, and new memory appears at the
// same address, the next transfer registers the new pages.
//
// softrnic's strict page identity mode (softrnic_control.h SetStrictPages)
// makes the hazard visible: it records which physical page backs each
// page of an MR and fails an access through an MR whose page changed --
// where a real NIC would silently move the old page's bytes.
#include <malloc.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "common/sanitizers.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"
#include "transport/softrnic/softrnic_control.h"

namespace ferry {
namespace {

constexpr size_t kLen = 1 << 20;

class MrCacheTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    strict_ = softrnic::SetStrictPages(true) == 0;
    EngineOptions t;
    t.local_segment_name = "target";
    t.transports = {GetParam()};
    ASSERT_OK(target_.Init(t));
    remote_.assign(kLen, 0);
    ASSERT_OK(target_.RegisterLocalMemory(remote_.data(), remote_.size()));
    EngineOptions i;
    i.local_segment_name = "initiator";
    i.metadata_endpoint = target_.metadata_address();
    i.transports = {GetParam()};
    i.mr_cache_bytes = 64 << 20;
    i.transfer_timeout = absl::Seconds(10);
    ASSERT_OK(initiator_.Init(i));
    ASSERT_OK_AND_ASSIGN(seg_, initiator_.OpenSegment("target"));
  }
  void TearDown() override {
    initiator_.Shutdown();
    target_.Shutdown();
    if (strict_) softrnic::SetStrictPages(false);
  }

  // WRITEs `len` bytes from `src` to the start of the target's buffer.
  BatchStatus Write(const void* src, size_t len) {
    TransferRequest r{OpCode::kWrite, const_cast<void*>(src), seg_,
                      reinterpret_cast<uint64_t>(remote_.data()), len};
    auto batch = initiator_.AllocateBatch(1);
    EXPECT_OK(batch);
    EXPECT_OK(initiator_.SubmitTransfer(*batch, {r}));
    auto st = initiator_.WaitBatch(*batch, absl::Seconds(30));
    EXPECT_OK(st);
    EXPECT_OK(initiator_.FreeBatch(*batch));
    return st.ok() ? *st : BatchStatus{};
  }

  size_t CountTarget(uint8_t v, size_t len) const {
    return static_cast<size_t>(
        std::count(remote_.begin(), remote_.begin() + len, v));
  }

  bool strict_ = false;
  TransferEngine target_, initiator_;
  std::vector<uint8_t> remote_;
  SegmentHandle seg_ = 0;
};

TEST_P(MrCacheTest, UnmappedAndRemappedSourceIsRegisteredAgain) {
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 0x11, kLen);
  BatchStatus st = Write(p, kLen);
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  ASSERT_EQ(CountTarget(0x11, kLen), kLen);
  const EngineStats before = initiator_.GetEngineStats();
  EXPECT_EQ(before.mr_cache_registrations, 1u);

  // New memory at the same address: new pages, new contents.
  ASSERT_EQ(munmap(p, kLen), 0);
  void* q = mmap(p, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  ASSERT_EQ(q, p);
  std::memset(q, 0x22, kLen);
  st = Write(q, kLen);
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(CountTarget(0x22, kLen), kLen);
  const EngineStats after = initiator_.GetEngineStats();
  EXPECT_EQ(after.mr_cache_invalidations, before.mr_cache_invalidations + 1);
  EXPECT_EQ(after.mr_cache_registrations, 1u);
  ASSERT_EQ(munmap(q, kLen), 0);
}

TEST_P(MrCacheTest, FreedAndReusedHeapBlockIsRegisteredAgain) {
  if (FERRY_SANITIZER_ALLOCATOR) {
    GTEST_SKIP() << "the sanitizer's allocator replaces glibc's malloc";
  }
  // Above glibc's mmap threshold (pinned, so that glibc does not raise it
  // after the first free): free() unmaps it, and a malloc of the same size
  // usually gets the same address back, with new pages.
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 128 << 10), 1);
  constexpr size_t kBig = 8 << 20;
  const EngineStats before = initiator_.GetEngineStats();
  uint8_t* reused = nullptr;
  for (int round = 0; round < 4; ++round) {
    auto* p = static_cast<uint8_t*>(std::malloc(kBig));
    ASSERT_NE(p, nullptr);
    std::memset(p, 0x30 + round, kBig);
    BatchStatus st = Write(p, kLen);
    EXPECT_EQ(st.state, TransferState::kCompleted)
        << "round " << round << ": " << st.first_error;
    EXPECT_EQ(CountTarget(0x30 + round, kLen), kLen) << "round " << round;
    if (round > 0 && p == reused) {
      // Same address, new pages: the cache noticed the free.
      EXPECT_GE(initiator_.GetEngineStats().mr_cache_invalidations,
                before.mr_cache_invalidations + 1);
    }
    reused = p;
    std::free(p);
  }
  EXPECT_GE(initiator_.GetEngineStats().mr_cache_invalidations,
            before.mr_cache_invalidations + 3);
}

TEST_P(MrCacheTest, DroppedPagesAreRegisteredAgain) {
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 0x44, kLen);
  ASSERT_EQ(Write(p, kLen).state, TransferState::kCompleted);
  // MADV_DONTNEED: the next touch maps fresh zero pages.
  ASSERT_EQ(madvise(p, kLen, MADV_DONTNEED), 0);
  std::memset(p, 0x55, kLen);
  BatchStatus st = Write(p, kLen);
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(CountTarget(0x55, kLen), kLen);
  EXPECT_GE(initiator_.GetEngineStats().mr_cache_invalidations, 1u);
  ASSERT_EQ(munmap(p, kLen), 0);
}

// Strict mode itself catches a stale registration: a buffer the
// application registered (no cache involved) and then remapped fails its
// next access instead of moving the old page's bytes.
TEST_P(MrCacheTest, StrictModeCatchesAStaleRegistration) {
  if (!strict_ || GetParam() != "rdma") {
    GTEST_SKIP() << "needs softrnic's strict page identity (root)";
  }
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, 0x66, kLen);
  ASSERT_OK(initiator_.RegisterLocalMemory(p, kLen, "*", false));
  ASSERT_EQ(Write(p, kLen).state, TransferState::kCompleted);
  ASSERT_EQ(munmap(p, kLen), 0);
  ASSERT_EQ(mmap(p, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0),
            p);
  std::memset(p, 0x77, kLen);
  BatchStatus st = Write(p, kLen);
  EXPECT_EQ(st.state, TransferState::kFailed)
      << "a stale registration moved bytes";
  EXPECT_OK(initiator_.UnregisterLocalMemory(p));
  ASSERT_EQ(munmap(p, kLen), 0);
}

// The hooks serve at most kMaxMrCacheEngines MR caches per
// process. One engine past them gets a clear error from Init (it used to
// get a watcher that reported "everything released" on every call, so each
// request from unregistered memory failed); an Init that fails later gives
// its watcher back (it used to keep it for good).
// EngineOptions::mr_cache_bytes documents it.
constexpr int kMaxMrCacheEngines = 64;

TEST(MrCacheLimitTest, EnginesPastTheWatcherPoolFailInitClearly) {
  EngineOptions o;
  o.transports = {"tcp"};
  o.mr_cache_bytes = 1 << 20;
  o.listen_host = "203.0.113.1";  // Not ours: the RPC server cannot start.
  for (int i = 0; i < kMaxMrCacheEngines + 4; ++i) {
    TransferEngine e;
    o.local_segment_name = absl::StrCat("e", i);
    ASSERT_FALSE(e.Init(o).ok());
  }
  o.listen_host = "127.0.0.1";
  std::vector<std::unique_ptr<TransferEngine>> engines;
  for (int i = 0; i < kMaxMrCacheEngines; ++i) {
    engines.push_back(std::make_unique<TransferEngine>());
    o.local_segment_name = absl::StrCat("e", i);
    ASSERT_OK(engines.back()->Init(o)) << i;
  }
  TransferEngine one_more;
  o.local_segment_name = "one_more";
  EXPECT_STATUS(one_more.Init(o), absl::StatusCode::kResourceExhausted);
  engines.pop_back();  // Its watcher goes back to the pool.
  EXPECT_OK(one_more.Init(o));
}

INSTANTIATE_TEST_SUITE_P(Transports, MrCacheTest,
                         ::testing::Values("tcp", "rdma"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry
