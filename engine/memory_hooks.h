// Memory hooks: tell the MR cache when the process gives memory back to the
// kernel or replaces it, so that a cached registration is never used for
// pages it no longer pins.
//
// Why: a NIC registration pins the physical pages behind a virtual range.
// If the application frees that memory (free() of a large block unmaps it;
// the heap shrinks; madvise(DONTNEED) drops pages) and the address is
// later reused for new memory, the old registration still points the NIC
// at the old pages: transfers would silently move the wrong bytes.
//
// How (as UCX's registration cache does, by patching code): in libc's
// munmap, mremap, madvise, mmap, brk and shmdt, the instruction that loads
// the system call number is replaced by a jump to a trampoline that
// records the affected range for every watcher whose registrations it
// overlaps, then runs the displaced instruction and jumps back to libc's
// own `syscall`: libc's behaviour, results and errno are unchanged.
// Patching the code, not the symbol, also catches calls from inside libc
// (free() unmapping a large block, malloc trimming its heaps), which
// symbol interposition cannot see. The patch is one atomic store, so a
// thread inside these functions meanwhile is unaffected. x86-64 only.
//
// The hooks run inside free() and other allocator paths: they take no
// lock, allocate nothing and never block; a watcher drains its ranges
// later, from its own thread (MemoryWatcher::Drain).
#ifndef FERRY_ENGINE_MEMORY_HOOKS_H_
#define FERRY_ENGINE_MEMORY_HOOKS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace ferry {

// Installs the hooks, once per process (later calls return the first
// result). FailedPrecondition or Unimplemented, with the reason, where
// they cannot be installed (not x86-64, unexpected libc code, no
// permission to patch).
absl::Status InstallMemoryHooks();

// Ranges released or replaced since the last Drain, for one MR cache.
// Watchers live in a static pool and are never freed (a hook on another
// thread may still hold one); thread-safe.
class MemoryWatcher {
 public:
  struct Range {
    uintptr_t addr;
    size_t length;
  };
  static constexpr int kMaxWatchers = 64;

  // A watcher from the pool, registered with the hooks; null when all
  // kMaxWatchers are in use (EngineOptions::mr_cache_bytes documents the
  // limit). Call after InstallMemoryHooks succeeded.
  static MemoryWatcher* Acquire();
  // Gives it back to the pool.
  static void Release(MemoryWatcher* watcher);

  // Widens the address range this watcher cares about (what it has cached
  // or is registering lies inside); ranges outside it are not recorded.
  void Watch(uintptr_t addr, size_t length);

  // Whether ranges may have arrived that were not acknowledged yet: one
  // load, for the fast path.
  bool MaybePending() const {
    return events_.load(std::memory_order_acquire) !=
               drained_events_.load(std::memory_order_acquire) ||
           overflow_flag_.load(std::memory_order_relaxed);
  }

  // Moves the recorded ranges into *out; *overflow says ranges were lost
  // (then everything watched must be treated as released). Returns a
  // token for Acknowledge, which the caller calls once it has acted on
  // the ranges: until then MaybePending stays true, so no other thread
  // trusts a registration the ranges invalidate. One drainer at a time.
  uint64_t Drain(std::vector<Range>* out, bool* overflow);
  void Acknowledge(uint64_t token);

  // Called by the hooks (any thread, inside allocator paths).
  void Record(uintptr_t addr, size_t length);

  MemoryWatcher() = default;
  MemoryWatcher(const MemoryWatcher&) = delete;
  MemoryWatcher& operator=(const MemoryWatcher&) = delete;

 private:
  static constexpr int kCapacity = 256;
  static constexpr int kMaxSpins = 1 << 14;

  void Reset();

  std::atomic<uintptr_t> lo_{~uintptr_t{0}};
  std::atomic<uintptr_t> hi_{0};
  std::atomic_flag lock_ = ATOMIC_FLAG_INIT;  // Guards ranges_ and count_.
  Range ranges_[kCapacity];
  int count_ = 0;
  // Ranges were lost (full, contended, or no slot): assume the worst.
  std::atomic<bool> overflow_flag_{false};
  std::atomic<uint64_t> events_{0};
  std::atomic<uint64_t> drained_events_{0};
  int slot_ = -1;
};

// Whether mmap(MAP_FIXED) over live memory is seen. It is hooked where its
// code can be patched atomically (always on glibc 2.36 as Debian builds
// it); allocators release memory with munmap, madvise and brk, which are
// always hooked, so the MR cache stays correct for them without it.
bool MemoryHookCoversFixedMmap();

// For tests: how many times the hooks ran (all watchers), per call kind.
struct MemoryHookCounts {
  uint64_t munmap = 0, mremap = 0, madvise = 0, mmap_fixed = 0, brk = 0,
           shmdt = 0;
};
MemoryHookCounts GetMemoryHookCounts();

}  // namespace ferry

#endif  // FERRY_ENGINE_MEMORY_HOOKS_H_
