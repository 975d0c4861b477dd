#include "engine/memory_hooks.h"

#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

// The hooks run in places where a sanitizer's runtime cannot follow: glibc
// calls madvise on a thread's stack as the thread exits, after
// ThreadSanitizer dropped the thread's state. So everything on the hook
// path carries no sanitizer instrumentation at all.
#if defined(__clang__)
#define FERRY_UNINSTRUMENTED __attribute__((disable_sanitizer_instrumentation))
#else
#define FERRY_UNINSTRUMENTED                              \
  __attribute__((no_sanitize_address, no_sanitize_thread, \
                 no_sanitize_undefined))
#endif

namespace ferry {
namespace {

std::atomic<MemoryWatcher*> g_watchers[MemoryWatcher::kMaxWatchers];
// Hooks running now, so that a watcher being destroyed can wait for the
// ones that may still use it.
std::atomic<int> g_active{0};
// glibc's record of the program break, kept right by the brk hook.
void** g_curbrk = nullptr;

struct Counts {
  std::atomic<uint64_t> munmap{0}, mremap{0}, madvise{0}, mmap_fixed{0}, brk{0},
      shmdt{0};
} g_counts;

// Spins on a flag held only for a copy of a few bytes; gives up after a
// bound (a signal handler interrupting a holder on the same thread).
constexpr int kMaxSpins = 1 << 14;

FERRY_UNINSTRUMENTED void RecordAll(uintptr_t addr, size_t length) {
  if (length == 0) return;
  g_active.fetch_add(1, std::memory_order_acquire);
  for (auto& slot : g_watchers) {
    MemoryWatcher* w = slot.load(std::memory_order_acquire);
    if (w != nullptr) w->Record(addr, length);
  }
  g_active.fetch_sub(1, std::memory_order_release);
}

// The replacements. Each records the range, then makes the system call
// itself (the patched libc function cannot be called any more), with
// libc's conventions: -1 and errno on failure.
FERRY_UNINSTRUMENTED int HookMunmap(void* addr, size_t length) {
  g_counts.munmap.fetch_add(1, std::memory_order_relaxed);
  RecordAll(reinterpret_cast<uintptr_t>(addr), length);
  return static_cast<int>(syscall(SYS_munmap, addr, length));
}

FERRY_UNINSTRUMENTED void* HookMremap(void* old_addr, size_t old_size,
                                      size_t new_size, int flags,
                                      void* new_addr) {
  g_counts.mremap.fetch_add(1, std::memory_order_relaxed);
  RecordAll(reinterpret_cast<uintptr_t>(old_addr), old_size);
  // The fifth argument exists only with MREMAP_FIXED (a variadic argument
  // in libc's prototype; on x86-64 it arrives in the same register).
  if ((flags & MREMAP_FIXED) != 0) {
    RecordAll(reinterpret_cast<uintptr_t>(new_addr), new_size);
  }
  return reinterpret_cast<void*>(
      syscall(SYS_mremap, old_addr, old_size, new_size, flags, new_addr));
}

FERRY_UNINSTRUMENTED int HookMadvise(void* addr, size_t length, int advice) {
  // Only advice that replaces the pages behind the range.
  if (advice == MADV_DONTNEED || advice == MADV_FREE || advice == MADV_REMOVE) {
    g_counts.madvise.fetch_add(1, std::memory_order_relaxed);
    RecordAll(reinterpret_cast<uintptr_t>(addr), length);
  }
  return static_cast<int>(syscall(SYS_madvise, addr, length, advice));
}

FERRY_UNINSTRUMENTED void* HookMmap(void* addr, size_t length, int prot,
                                    int flags, int fd, off_t offset) {
  // A fixed mapping replaces whatever was mapped there.
  if ((flags & MAP_FIXED) != 0) {
    g_counts.mmap_fixed.fetch_add(1, std::memory_order_relaxed);
    RecordAll(reinterpret_cast<uintptr_t>(addr), length);
  }
  return reinterpret_cast<void*>(
      syscall(SYS_mmap, addr, length, prot, flags, fd, offset));
}

FERRY_UNINSTRUMENTED int HookBrk(void* addr) {
  void* old = *g_curbrk;
  if (old == nullptr) old = reinterpret_cast<void*>(syscall(SYS_brk, 0));
  void* now = reinterpret_cast<void*>(syscall(SYS_brk, addr));
  *g_curbrk = now;
  if (now < addr) {
    errno = ENOMEM;
    return -1;
  }
  if (now < old) {
    g_counts.brk.fetch_add(1, std::memory_order_relaxed);
    RecordAll(
        reinterpret_cast<uintptr_t>(now),
        reinterpret_cast<uintptr_t>(old) - reinterpret_cast<uintptr_t>(now));
  }
  return 0;
}

FERRY_UNINSTRUMENTED int HookShmdt(const void* addr) {
  g_counts.shmdt.fetch_add(1, std::memory_order_relaxed);
  // The segment's size is not an argument: treat everything as released.
  RecordAll(0, ~uintptr_t{0});
  return static_cast<int>(syscall(SYS_shmdt, addr));
}

// movabs r11, imm64; jmp r11 -- 13 bytes; r11 is a scratch register the
// callee may clobber (and the syscall instruction clobbers it anyway).
constexpr size_t kJumpBytes = 13;

// The size of the function at `fn` from its ELF symbol, or 0.
size_t SymbolSize(void* fn) {
  Dl_info info;
  void* extra = nullptr;
  if (fn == nullptr || dladdr1(fn, &info, &extra, RTLD_DL_SYMENT) == 0 ||
      extra == nullptr) {
    return 0;
  }
  return static_cast<const ElfW(Sym)*>(extra)->st_size;
}

// Writes libc's code. Not instrumented: a sanitizer would check the write
// against shadow memory that libc's text does not have.
__attribute__((no_sanitize("address", "thread", "memory"))) void WriteCode(
    void* fn, const uint8_t* code, size_t n) {
  volatile uint8_t* dst = static_cast<volatile uint8_t*>(fn);
  for (size_t i = 0; i < n; ++i) dst[i] = code[i];
}

absl::Status Patch(void* libc, const char* name, void* hook) {
  void* fn = dlsym(libc, name);
  if (SymbolSize(fn) < kJumpBytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("libc's ", name, " is missing or too short to patch"));
  }
  uint8_t code[kJumpBytes] = {0x49, 0xbb};
  const uint64_t target = reinterpret_cast<uint64_t>(hook);
  std::memcpy(code + 2, &target, sizeof(target));
  code[10] = 0x41;
  code[11] = 0xff;
  code[12] = 0xe3;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(fn) & ~(page - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(fn) + kJumpBytes + page - 1) & ~(page - 1);
  void* pages = reinterpret_cast<void*>(begin);
  if (mprotect(pages, end - begin, PROT_READ | PROT_WRITE | PROT_EXEC) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot make libc's ", name, " writable: ", std::strerror(errno)));
  }
  WriteCode(fn, code, kJumpBytes);
  __builtin___clear_cache(static_cast<char*>(fn),
                          static_cast<char*>(fn) + kJumpBytes);
  if (mprotect(pages, end - begin, PROT_READ | PROT_EXEC) != 0) {
    return absl::InternalError(absl::StrCat(
        "cannot restore libc's code protection: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status DoInstall() {
#if !defined(__x86_64__)
  return absl::UnimplementedError(
      "memory hooks are implemented for x86-64 only");
#else
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  if (libc == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("libc.so.6 is not loaded: ", dlerror()));
  }
  g_curbrk = static_cast<void**>(dlsym(libc, "__curbrk"));
  if (g_curbrk == nullptr) {
    return absl::FailedPreconditionError("libc has no __curbrk");
  }
  const struct {
    const char* name;
    void* hook;
  } hooks[] = {
      {"munmap", reinterpret_cast<void*>(&HookMunmap)},
      {"mremap", reinterpret_cast<void*>(&HookMremap)},
      {"madvise", reinterpret_cast<void*>(&HookMadvise)},
      {"mmap", reinterpret_cast<void*>(&HookMmap)},
      {"brk", reinterpret_cast<void*>(&HookBrk)},
      {"shmdt", reinterpret_cast<void*>(&HookShmdt)},
  };
  // Check every symbol before patching any, so that a failure leaves libc
  // untouched.
  for (const auto& h : hooks) {
    if (SymbolSize(dlsym(libc, h.name)) < kJumpBytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("libc's ", h.name, " cannot be patched"));
    }
  }
  for (const auto& h : hooks) {
    if (absl::Status s = Patch(libc, h.name, h.hook); !s.ok()) return s;
  }
  return absl::OkStatus();
#endif
}

}  // namespace

absl::Status InstallMemoryHooks() {
  static const absl::Status* const result = new absl::Status(DoInstall());
  return *result;
}

MemoryWatcher::MemoryWatcher() {
  for (int i = 0; i < kMaxWatchers; ++i) {
    MemoryWatcher* expected = nullptr;
    if (g_watchers[i].compare_exchange_strong(expected, this)) {
      slot_ = i;
      return;
    }
  }
  // No slot: nothing would be recorded for this watcher, so it must
  // assume everything it watches may be gone, always.
  overflow_flag_.store(true);
}

MemoryWatcher::~MemoryWatcher() {
  if (slot_ < 0) return;
  g_watchers[slot_].store(nullptr, std::memory_order_release);
  // A hook that loaded this watcher before the store may still be in
  // Record: wait until no hook runs (they are short).
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (g_active.load(std::memory_order_acquire) != 0 &&
         absl::Now() < deadline) {
    sched_yield();
  }
}

void MemoryWatcher::Watch(uintptr_t addr, size_t length) {
  uintptr_t lo = lo_.load(std::memory_order_relaxed);
  while (addr < lo && !lo_.compare_exchange_weak(lo, addr)) {
  }
  const uintptr_t end = addr + length;
  uintptr_t hi = hi_.load(std::memory_order_relaxed);
  while (end > hi && !hi_.compare_exchange_weak(hi, end)) {
  }
}

FERRY_UNINSTRUMENTED void MemoryWatcher::Record(uintptr_t addr, size_t length) {
  const uintptr_t end = addr + length < addr ? ~uintptr_t{0} : addr + length;
  if (end <= lo_.load(std::memory_order_relaxed) ||
      addr >= hi_.load(std::memory_order_relaxed)) {
    return;
  }
  int spins = 0;
  while (lock_.test_and_set(std::memory_order_acquire)) {
    if (++spins == kMaxSpins) {
      overflow_flag_.store(true, std::memory_order_release);
      events_.fetch_add(1, std::memory_order_release);
      return;
    }
  }
  if (count_ < kCapacity) {
    ranges_[count_++] = {addr, end - addr};
  } else {
    overflow_flag_.store(true, std::memory_order_relaxed);
  }
  lock_.clear(std::memory_order_release);
  events_.fetch_add(1, std::memory_order_release);
}

bool MemoryWatcher::Drain(std::vector<Range>* out) {
  const uint64_t seen = events_.load(std::memory_order_acquire);
  if (seen == drained_events_.load(std::memory_order_relaxed) &&
      !overflow_flag_.load()) {
    return false;
  }
  while (lock_.test_and_set(std::memory_order_acquire)) sched_yield();
  out->insert(out->end(), ranges_, ranges_ + count_);
  count_ = 0;
  lock_.clear(std::memory_order_release);
  drained_events_.store(seen, std::memory_order_relaxed);
  bool overflow = overflow_flag_.exchange(false);
  if (slot_ < 0) {
    overflow_flag_.store(true);  // Unwatched: always assume the worst.
    overflow = true;
  }
  return overflow;
}

MemoryHookCounts GetMemoryHookCounts() {
  MemoryHookCounts c;
  c.munmap = g_counts.munmap.load();
  c.mremap = g_counts.mremap.load();
  c.madvise = g_counts.madvise.load();
  c.mmap_fixed = g_counts.mmap_fixed.load();
  c.brk = g_counts.brk.load();
  c.shmdt = g_counts.shmdt.load();
  return c;
}

}  // namespace ferry
