// The memory hooks see every way a process gives memory back or replaces
// it -- also from inside libc, where free() unmaps a large block.
#include "engine/memory_hooks.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/sanitizers.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

class MemoryHooksTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_OK(InstallMemoryHooks()); }

  // Whether the watcher recorded a range covering [addr, addr + length).
  static bool Saw(MemoryWatcher& w, const void* addr, size_t length) {
    std::vector<MemoryWatcher::Range> ranges;
    if (w.Drain(&ranges)) return true;  // Overflow: everything.
    const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
    for (const auto& r : ranges) {
      if (r.addr <= a && a + length <= r.addr + r.length) return true;
    }
    return false;
  }

  static constexpr size_t kLen = 1 << 20;
};

TEST_F(MemoryHooksTest, MunmapAndFixedMmapAreSeen) {
  MemoryWatcher w;
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  w.Watch(reinterpret_cast<uintptr_t>(p), kLen);
  EXPECT_FALSE(w.MaybePending());
  void* q = mmap(p, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  ASSERT_EQ(q, p);
  EXPECT_TRUE(w.MaybePending());
  EXPECT_TRUE(Saw(w, p, kLen));
  ASSERT_EQ(munmap(p, kLen), 0);
  EXPECT_TRUE(Saw(w, p, kLen));
  EXPECT_FALSE(w.MaybePending());
}

TEST_F(MemoryHooksTest, FreeOfALargeBlockIsSeenFromInsideLibc) {
  if (FERRY_SANITIZER_ALLOCATOR) {
    GTEST_SKIP() << "the sanitizer's allocator replaces glibc's malloc";
  }
  MemoryWatcher w;
  // Above glibc's mmap threshold: its own mapping, unmapped by free()
  // through libc's internal munmap (symbol interposition misses that).
  constexpr size_t kBig = 64 << 20;
  void* p = std::malloc(kBig);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, kBig);
  w.Watch(reinterpret_cast<uintptr_t>(p), kBig);
  const MemoryHookCounts before = GetMemoryHookCounts();
  std::free(p);
  EXPECT_GT(GetMemoryHookCounts().munmap, before.munmap);
  EXPECT_TRUE(Saw(w, p, kBig));
}

TEST_F(MemoryHooksTest, MadviseMremapAndHeapShrinkAreSeen) {
  MemoryWatcher w;
  char* p = static_cast<char*>(mmap(nullptr, 2 * kLen, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  w.Watch(reinterpret_cast<uintptr_t>(p), 2 * kLen);
  ASSERT_EQ(madvise(p, kLen, MADV_DONTNEED), 0);
  EXPECT_TRUE(Saw(w, p, kLen));
  ASSERT_EQ(madvise(p, kLen, MADV_WILLNEED), 0);  // Replaces nothing.
  EXPECT_FALSE(w.MaybePending());
  void* moved = mremap(p, 2 * kLen, 4 * kLen, MREMAP_MAYMOVE);
  ASSERT_NE(moved, MAP_FAILED);
  EXPECT_TRUE(Saw(w, p, 2 * kLen));
  ASSERT_EQ(munmap(moved, 4 * kLen), 0);

  // The program break: grow it, watch the top, shrink it back.
  char* top = static_cast<char*>(sbrk(0));
  ASSERT_NE(sbrk(kLen), reinterpret_cast<void*>(-1));
  w.Watch(reinterpret_cast<uintptr_t>(top), kLen);
  ASSERT_NE(sbrk(-static_cast<intptr_t>(kLen)), reinterpret_cast<void*>(-1));
  EXPECT_EQ(sbrk(0), top);  // glibc's idea of the break stayed right.
  EXPECT_TRUE(Saw(w, top, kLen));
}

TEST_F(MemoryHooksTest, RangesOutsideTheWatchedOnesAreNotRecorded) {
  MemoryWatcher w;
  char* p = static_cast<char*>(mmap(nullptr, 3 * kLen, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  w.Watch(reinterpret_cast<uintptr_t>(p + kLen), kLen);
  ASSERT_EQ(munmap(p, kLen), 0);
  EXPECT_FALSE(w.MaybePending());
  ASSERT_EQ(munmap(p + 2 * kLen, kLen), 0);
  EXPECT_FALSE(w.MaybePending());
  ASSERT_EQ(munmap(p + kLen, kLen), 0);
  EXPECT_TRUE(w.MaybePending());
}

}  // namespace
}  // namespace ferry
