// The memory hooks see every way a process gives memory back or replaces
// it -- also from inside libc, where free() unmaps a large block.
#include "engine/memory_hooks.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
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
    bool overflow = false;
    w.Acknowledge(w.Drain(&ranges, &overflow));
    if (overflow) return true;  // Everything.
    const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
    for (const auto& r : ranges) {
      if (r.addr <= a && a + length <= r.addr + r.length) return true;
    }
    return false;
  }

  static constexpr size_t kLen = 1 << 20;
};

// A watcher from the pool for one test.
class Watcher {
 public:
  Watcher() : w_(MemoryWatcher::Acquire()) {}
  ~Watcher() { MemoryWatcher::Release(w_); }
  MemoryWatcher& operator*() { return *w_; }
  MemoryWatcher* operator->() { return w_; }

 private:
  MemoryWatcher* w_;
};

TEST_F(MemoryHooksTest, MunmapAndFixedMmapAreSeen) {
  Watcher w;
  void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  w->Watch(reinterpret_cast<uintptr_t>(p), kLen);
  EXPECT_FALSE(w->MaybePending());
  void* q = mmap(p, kLen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  ASSERT_EQ(q, p);
  std::printf("mmap(MAP_FIXED) hooked: %s\n",
              MemoryHookCoversFixedMmap() ? "yes" : "no");
  EXPECT_EQ(w->MaybePending(), MemoryHookCoversFixedMmap());
  if (MemoryHookCoversFixedMmap()) EXPECT_TRUE(Saw(*w, p, kLen));
  ASSERT_EQ(munmap(p, kLen), 0);
  EXPECT_TRUE(Saw(*w, p, kLen));
  EXPECT_FALSE(w->MaybePending());
}

TEST_F(MemoryHooksTest, FreeOfALargeBlockIsSeenFromInsideLibc) {
  if (FERRY_SANITIZER_ALLOCATOR) {
    GTEST_SKIP() << "the sanitizer's allocator replaces glibc's malloc";
  }
  Watcher w;
  // Above glibc's mmap threshold: its own mapping, unmapped by free()
  // through libc's internal munmap (symbol interposition misses that).
  constexpr size_t kBig = 64 << 20;
  void* p = std::malloc(kBig);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, kBig);
  w->Watch(reinterpret_cast<uintptr_t>(p), kBig);
  const MemoryHookCounts before = GetMemoryHookCounts();
  std::free(p);
  EXPECT_GT(GetMemoryHookCounts().munmap, before.munmap);
  EXPECT_TRUE(Saw(*w, p, kBig));
}

TEST_F(MemoryHooksTest, MadviseMremapAndHeapShrinkAreSeen) {
  Watcher w;
  char* p = static_cast<char*>(mmap(nullptr, 2 * kLen, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  w->Watch(reinterpret_cast<uintptr_t>(p), 2 * kLen);
  ASSERT_EQ(madvise(p, kLen, MADV_DONTNEED), 0);
  EXPECT_TRUE(Saw(*w, p, kLen));
  ASSERT_EQ(madvise(p, kLen, MADV_WILLNEED), 0);  // Replaces nothing.
  EXPECT_FALSE(w->MaybePending());
  void* moved = mremap(p, 2 * kLen, 4 * kLen, MREMAP_MAYMOVE);
  ASSERT_NE(moved, MAP_FAILED);
  EXPECT_TRUE(Saw(*w, p, 2 * kLen));
  ASSERT_EQ(munmap(moved, 4 * kLen), 0);

  // The program break: grow it, watch the top, shrink it back.
  char* top = static_cast<char*>(sbrk(0));
  ASSERT_NE(sbrk(kLen), reinterpret_cast<void*>(-1));
  w->Watch(reinterpret_cast<uintptr_t>(top), kLen);
  ASSERT_NE(sbrk(-static_cast<intptr_t>(kLen)), reinterpret_cast<void*>(-1));
  EXPECT_EQ(sbrk(0), top);  // glibc's idea of the break stayed right.
  EXPECT_TRUE(Saw(*w, top, kLen));
}

TEST_F(MemoryHooksTest, RangesOutsideTheWatchedOnesAreNotRecorded) {
  Watcher w;
  char* p = static_cast<char*>(mmap(nullptr, 3 * kLen, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(p, MAP_FAILED);
  w->Watch(reinterpret_cast<uintptr_t>(p + kLen), kLen);
  ASSERT_EQ(munmap(p, kLen), 0);
  EXPECT_FALSE(w->MaybePending());
  ASSERT_EQ(munmap(p + 2 * kLen, kLen), 0);
  EXPECT_FALSE(w->MaybePending());
  ASSERT_EQ(munmap(p + kLen, kLen), 0);
  EXPECT_TRUE(w->MaybePending());
}

// Installing the hooks rewrites libc's code while other threads may be
// inside it: a thread in munmap's system call returns into the patched
// function and must carry on unharmed. (Runs in a child process: the
// hooks are installed once per process.)
TEST(MemoryHooksInstallTest, ThreadsInsideThePatchedFunctionsAreUnharmed) {
  EXPECT_EXIT(
      {
        constexpr size_t kBig = size_t{1} << 30;
        void* p = mmap(nullptr, kBig, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (p == MAP_FAILED) std::_Exit(3);
        std::atomic<bool> started{false};
        std::thread t([&] {
          started = true;
          munmap(p, kBig);  // Tens of milliseconds in the kernel.
        });
        while (!started) {
        }
        usleep(2000);
        const bool ok = InstallMemoryHooks().ok();
        t.join();
        // And the patched functions work.
        void* q = mmap(nullptr, 4096, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        std::_Exit(ok && q != MAP_FAILED && munmap(q, 4096) == 0 ? 0 : 4);
      },
      ::testing::ExitedWithCode(0), "");
}

// libc's results and errno are its own: the hooks only observe.
TEST_F(MemoryHooksTest, ErrorsAreLibcsOwn) {
  errno = 0;
  EXPECT_EQ(munmap(reinterpret_cast<void*>(1), 4096), -1);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 1),
            MAP_FAILED);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(madvise(reinterpret_cast<void*>(1), 4096, MADV_DONTNEED), -1);
  EXPECT_EQ(errno, EINVAL);
}

}  // namespace
}  // namespace ferry
