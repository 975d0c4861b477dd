#include "engine/memory_hooks.h"

#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

// The callbacks run where a sanitizer's runtime cannot follow: glibc calls
// madvise on a thread's stack as the thread exits, after ThreadSanitizer
// dropped the thread's state. So everything on the hook path carries no
// sanitizer instrumentation at all. Never inlined: a function inlined into
// an instrumented caller is instrumented as the caller is (clang 14 puts
// TSan's atomic hooks into WriteSiteBytes that way, which then write
// shadow memory for libc's text and fault).
#if defined(__clang__)
#define FERRY_UNINSTRUMENTED \
  __attribute__((disable_sanitizer_instrumentation, noinline))
#else
#define FERRY_UNINSTRUMENTED                              \
  __attribute__((no_sanitize_address, no_sanitize_thread, \
                 no_sanitize_undefined, noinline))
#endif

namespace ferry {
namespace {

// --- Watchers: a static pool, never freed, so that a hook holding a
// pointer can never write into freed memory.

struct WatcherSlot {
  MemoryWatcher watcher;
  std::atomic<bool> taken{false};
};
WatcherSlot g_pool[MemoryWatcher::kMaxWatchers];
// Watchers in use, for the hooks (null: free).
std::atomic<MemoryWatcher*> g_active_watchers[MemoryWatcher::kMaxWatchers];

void** g_curbrk = nullptr;  // glibc's record of the program break.
// Which hooks are in (in the order of DoInstall's table).
bool g_hooked[6] = {};

struct Counts {
  std::atomic<uint64_t> munmap{0}, mremap{0}, madvise{0}, mmap_fixed{0}, brk{0},
      shmdt{0};
} g_counts;

FERRY_UNINSTRUMENTED void RecordAll(uintptr_t addr, size_t length) {
  if (length == 0) return;
  for (auto& slot : g_active_watchers) {
    MemoryWatcher* w = slot.load(std::memory_order_acquire);
    if (w != nullptr) w->Record(addr, length);
  }
}

// --- The callbacks: called by the trampolines right before libc's own
// `syscall` instruction, with the system call's arguments (rdi, rsi, rdx,
// r10, r8). They only record; libc then makes the call as it always does,
// so its results and errno are untouched.

FERRY_UNINSTRUMENTED void OnMunmap(uintptr_t addr, size_t length) {
  g_counts.munmap.fetch_add(1, std::memory_order_relaxed);
  RecordAll(addr, length);
}

FERRY_UNINSTRUMENTED void OnMremap(uintptr_t old_addr, size_t old_size,
                                   size_t new_size, uint64_t flags,
                                   uintptr_t new_addr) {
  g_counts.mremap.fetch_add(1, std::memory_order_relaxed);
  RecordAll(old_addr, old_size);
  if ((flags & MREMAP_FIXED) != 0) RecordAll(new_addr, new_size);
}

FERRY_UNINSTRUMENTED void OnMadvise(uintptr_t addr, size_t length,
                                    uint64_t advice) {
  // Only advice that replaces the pages behind the range.
  if (advice == MADV_DONTNEED || advice == MADV_FREE || advice == MADV_REMOVE) {
    g_counts.madvise.fetch_add(1, std::memory_order_relaxed);
    RecordAll(addr, length);
  }
}

FERRY_UNINSTRUMENTED void OnMmap(uintptr_t addr, size_t length, uint64_t,
                                 uint64_t flags) {
  // A fixed mapping replaces whatever was mapped there.
  if ((flags & MAP_FIXED) != 0) {
    g_counts.mmap_fixed.fetch_add(1, std::memory_order_relaxed);
    RecordAll(addr, length);
  }
}

FERRY_UNINSTRUMENTED void OnBrk(uintptr_t new_break) {
  const uintptr_t old = reinterpret_cast<uintptr_t>(*g_curbrk);
  // brk(0) only asks where the break is.
  if (new_break != 0 && old != 0 && new_break < old) {
    g_counts.brk.fetch_add(1, std::memory_order_relaxed);
    RecordAll(new_break, old - new_break);
  }
}

FERRY_UNINSTRUMENTED void OnShmdt(uintptr_t) {
  g_counts.shmdt.fetch_add(1, std::memory_order_relaxed);
  // The segment's size is not an argument: treat everything as released.
  RecordAll(0, ~uintptr_t{0});
}

// --- Patching. In each libc function the system call is made by
//   mov $nr, %eax     b8 <nr: 4 bytes>
//   syscall           0f 05
// That 5-byte mov is replaced by a jmp (e9 <rel32>) to a trampoline that
// saves the caller-saved registers, calls the callback, restores them,
// executes the displaced mov and jumps back to the syscall instruction.
// Nothing else in libc changes: a thread inside the system call returns
// to the unchanged bytes after it, and the 5 bytes are written with one
// atomic store (8- or 16-byte, aligned), so a thread about to execute
// them sees either the mov or the jmp, never a mix.

constexpr size_t kSiteBytes = 5;
constexpr size_t kTrampolineBytes = 128;

struct Hook {
  const char* name;
  uint32_t nr;
  void* callback;
  // Where to patch when the system call's own `mov` cannot be written
  // atomically: the bytes of one whole, position-independent instruction
  // shortly before it (null: none known).
  const uint8_t* alternative = nullptr;
  size_t alternative_bytes = 0;
  // Whether libc can work without this hook (the MR cache then misses the
  // releases it would have seen).
  bool optional = false;
};

// glibc 2.36's mmap checks the offset with `test $0xfff,%r9d` before
// `mov $9,%eax; syscall`; that 7-byte instruction is a second place to
// hook it (the arguments are all in place by then).
constexpr uint8_t kMmapOffsetTest[] = {0x41, 0xf7, 0xc1, 0xff,
                                       0x0f, 0x00, 0x00};

FERRY_UNINSTRUMENTED bool Cas16(void* p, const uint64_t expected[2],
                                const uint64_t desired[2]) {
  uint64_t lo = expected[0], hi = expected[1];
  bool ok;
  asm volatile("lock cmpxchg16b %1\n\tsete %0"
               : "=q"(ok), "+m"(*static_cast<volatile __int128*>(p)), "+a"(lo),
                 "+d"(hi)
               : "b"(desired[0]), "c"(desired[1])
               : "cc", "memory");
  return ok;
}

// Where `fn` makes system call `nr`: the offset of `mov $nr, %eax;
// syscall`, which must occur exactly once in its first 256 bytes.
int FindSite(const uint8_t* fn, size_t size, uint32_t nr) {
  uint8_t pattern[7] = {0xb8, 0, 0, 0, 0, 0x0f, 0x05};
  std::memcpy(pattern + 1, &nr, 4);
  int found = -1;
  const size_t limit = size < 256 ? size : 256;
  for (size_t i = 0; i + sizeof(pattern) <= limit; ++i) {
    if (std::memcmp(fn + i, pattern, sizeof(pattern)) == 0) {
      if (found >= 0) return -1;
      found = static_cast<int>(i);
    }
  }
  return found;
}

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

// A trampoline page mapped at exactly `at`, or null (taken, or an old
// kernel that treats MAP_FIXED_NOREPLACE as a hint and mapped elsewhere).
uint8_t* MapPageAt(uintptr_t at, uintptr_t page) {
  void* p = mmap(reinterpret_cast<void*>(at), page,
                 PROT_READ | PROT_WRITE | PROT_EXEC,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  if (p == reinterpret_cast<void*>(at)) return static_cast<uint8_t*>(p);
  munmap(p, page);
  return nullptr;
}

// A page for trampolines within a rel32 jump of `near`, or null.
uint8_t* MapNear(uintptr_t near) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t base = (near + (1 << 20)) & ~(page - 1);
  for (uintptr_t step = 0; step < (uintptr_t{1} << 30); step += 1 << 20) {
    for (const uintptr_t at : {base + step, base - step - (2 << 20)}) {
      if (uint8_t* p = MapPageAt(at, page)) return p;
    }
  }
  return nullptr;
}

// A place to patch: `displaced` bytes of whole, position-independent
// instructions at `at` (the first 5 become the jump), run by the
// trampoline after the callback, which then resumes right after them.
struct Site {
  uint8_t* at = nullptr;
  size_t displaced = 0;
};

// Writes the trampoline for `hook` at `t`.
void WriteTrampoline(uint8_t* t, const Hook& hook, const Site& site) {
  static const uint8_t kSave[] = {
      0x48, 0x8d, 0x64, 0x24, 0x80,  // lea -0x80(%rsp),%rsp: the red zone
      0x50, 0x57, 0x56, 0x52, 0x51,  // push rax rdi rsi rdx rcx
      0x41, 0x50, 0x41, 0x51,        // push r8 r9
      0x41, 0x52, 0x41, 0x53,        // push r10 r11
      0x55,                          // push rbp
      0x48, 0x89, 0xe5,              // mov %rsp,%rbp
      0x48, 0x83, 0xe4, 0xf0,        // and $-16,%rsp
      0x4c, 0x89, 0xd1,              // mov %r10,%rcx: the 4th argument
      0x49, 0xbb,                    // movabs $callback,%r11
  };
  static const uint8_t kRestore[] = {
      0x41, 0xff, 0xd3,              // call *%r11
      0x48, 0x89, 0xec,              // mov %rbp,%rsp
      0x5d,                          // pop rbp
      0x41, 0x5b, 0x41, 0x5a,        // pop r11 r10
      0x41, 0x59, 0x41, 0x58,        // pop r9 r8
      0x59, 0x5a, 0x5e, 0x5f, 0x58,  // pop rcx rdx rsi rdi rax
      0x48, 0x8d, 0xa4, 0x24, 0x80, 0x00, 0x00, 0x00,  // lea 0x80(%rsp),%rsp
  };
  uint8_t* p = t;
  std::memcpy(p, kSave, sizeof(kSave));
  p += sizeof(kSave);
  const uint64_t cb = reinterpret_cast<uint64_t>(hook.callback);
  std::memcpy(p, &cb, 8);
  p += 8;
  std::memcpy(p, kRestore, sizeof(kRestore));
  p += sizeof(kRestore);
  std::memcpy(p, site.at, site.displaced);  // The displaced instructions.
  p += site.displaced;
  *p++ = 0xe9;  // jmp rel32 back into libc, after them.
  const uint8_t* resume = site.at + site.displaced;
  const int32_t back = static_cast<int32_t>(resume - (p + 4));
  std::memcpy(p, &back, 4);
}

// How the jump at `site` can be written with one atomic store: all 5 bytes
// inside one aligned 16-byte block (any target), or only the first
// `in_block` bytes inside it, the rest being the top bytes of the jump's
// displacement, which must then equal the bytes already there (the top
// bytes of the system call number: zeros), so the target must lie within
// 2^(8 * (in_block - 1)) bytes after the site.
struct SitePlan {
  bool atomic_any_target = false;
  uint64_t max_forward = 0;  // When !atomic_any_target; 0: impossible.
};

SitePlan PlanSite(const uint8_t* site) {
  SitePlan plan;
  const uintptr_t a = reinterpret_cast<uintptr_t>(site);
  const size_t in_block = 16 - (a & 15);
  if (in_block >= kSiteBytes) {
    plan.atomic_any_target = true;
  } else if (in_block >= 3) {
    bool zeros = true;
    for (size_t i = in_block; i < kSiteBytes; ++i) zeros &= site[i] == 0;
    if (zeros) plan.max_forward = uint64_t{1} << (8 * (in_block - 1));
  }
  return plan;
}

// Writes the 5 bytes at `site` within its aligned 16-byte block (bytes
// beyond the block must already hold what `code` has there).
// Not instrumented: a sanitizer would check these accesses against shadow
// memory that libc's text does not have.
FERRY_UNINSTRUMENTED bool WriteSiteBytes(uint8_t* site,
                                         const uint8_t code[kSiteBytes]) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(site);
  const size_t offset = a & 15;
  const size_t in_block = offset + kSiteBytes <= 16 ? kSiteBytes : 16 - offset;
  for (size_t i = in_block; i < kSiteBytes; ++i) {
    if (site[i] != code[i]) return false;
  }
  if (offset % 8 + in_block <= 8) {
    auto* word = reinterpret_cast<uint64_t*>(a & ~uintptr_t{7});
    uint64_t v = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    uint8_t* bytes = reinterpret_cast<uint8_t*>(&v) + (a & 7);
    for (size_t i = 0; i < in_block; ++i) bytes[i] = code[i];
    __atomic_store_n(word, v, __ATOMIC_SEQ_CST);
    return true;
  }
  auto* block = reinterpret_cast<uint64_t*>(a & ~uintptr_t{15});
  uint64_t old[2] = {block[0], block[1]};
  uint64_t desired[2] = {old[0], old[1]};
  uint8_t* bytes = reinterpret_cast<uint8_t*>(desired) + offset;
  for (size_t i = 0; i < in_block; ++i) bytes[i] = code[i];
  return Cas16(block, old, desired);
}

absl::Status WriteSite(uint8_t* site, const uint8_t code[kSiteBytes]) {
  if (WriteSiteBytes(site, code)) return absl::OkStatus();
  return absl::InternalError(
      "libc's code changed while it was patched, or a jump cannot be "
      "written atomically there");
}

// A page for trampolines in [lo, hi) (page-aligned bounds), or null.
uint8_t* MapInRange(uintptr_t lo, uintptr_t hi) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (uintptr_t at = (lo + page - 1) & ~(page - 1); at + page <= hi;
       at += page) {
    if (uint8_t* p = MapPageAt(at, page)) return p;
  }
  return nullptr;
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
  const Hook hooks[] = {
      {"munmap", SYS_munmap, reinterpret_cast<void*>(&OnMunmap)},
      {"mremap", SYS_mremap, reinterpret_cast<void*>(&OnMremap)},
      {"madvise", SYS_madvise, reinterpret_cast<void*>(&OnMadvise)},
      {"mmap", SYS_mmap, reinterpret_cast<void*>(&OnMmap), kMmapOffsetTest,
       sizeof(kMmapOffsetTest), /*optional=*/true},
      {"brk", SYS_brk, reinterpret_cast<void*>(&OnBrk)},
      {"shmdt", SYS_shmdt, reinterpret_cast<void*>(&OnShmdt)},
  };
  constexpr int kHooks = sizeof(hooks) / sizeof(hooks[0]);
  // Find every site, and where its trampoline may go, before touching
  // anything, so that a libc that looks unexpected is left alone.
  Site sites[kHooks];
  uint8_t* tramps[kHooks];
  bool skip[kHooks] = {};
  uint8_t* shared = nullptr;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  auto shared_page = [&](const uint8_t* near) -> uint8_t* {
    if (shared == nullptr) shared = MapNear(reinterpret_cast<uintptr_t>(near));
    return shared;
  };
  for (int i = 0; i < kHooks; ++i) {
    void* fn = dlsym(libc, hooks[i].name);
    const size_t size = SymbolSize(fn);
    const int at =
        size > 0 ? FindSite(static_cast<uint8_t*>(fn), size, hooks[i].nr) : -1;
    if (at < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("libc's ", hooks[i].name,
                       " does not make its system call the expected way"));
    }
    Site site{static_cast<uint8_t*>(fn) + at, kSiteBytes};
    const SitePlan plan = PlanSite(site.at);
    tramps[i] = nullptr;
    if (plan.atomic_any_target) {
      tramps[i] = shared_page(site.at);
    } else if (plan.max_forward != 0) {
      // Its jump must land close after it: a page of its own there.
      const uintptr_t from = reinterpret_cast<uintptr_t>(site.at) + kSiteBytes;
      tramps[i] = MapInRange(from, from + plan.max_forward);
    }
    if (tramps[i] == nullptr && hooks[i].alternative != nullptr) {
      // The known instruction right before the system call, if it is
      // there and can be written atomically.
      const uint8_t* a = static_cast<const uint8_t*>(fn);
      for (int j = 0; j + hooks[i].alternative_bytes <= static_cast<size_t>(at);
           ++j) {
        if (std::memcmp(a + j, hooks[i].alternative,
                        hooks[i].alternative_bytes) != 0 ||
            !PlanSite(a + j).atomic_any_target) {
          continue;
        }
        site = Site{static_cast<uint8_t*>(fn) + j, hooks[i].alternative_bytes};
        tramps[i] = shared_page(site.at);
        break;
      }
    }
    if (tramps[i] != nullptr && tramps[i] == shared) {
      tramps[i] = shared + i * kTrampolineBytes;
      const int64_t reach = tramps[i] - (site.at + kSiteBytes);
      if (reach > INT32_MAX || reach < INT32_MIN) tramps[i] = nullptr;
    }
    if (tramps[i] == nullptr) {
      if (hooks[i].optional) {
        skip[i] = true;  // See MemoryHookCoverage.
        continue;
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "libc's ", hooks[i].name,
          " cannot be patched atomically (its system call straddles a "
          "16-byte block and no page is free close after it)"));
    }
    sites[i] = site;
  }
  for (int i = 0; i < kHooks; ++i) {
    if (!skip[i]) WriteTrampoline(tramps[i], hooks[i], sites[i]);
  }
  for (int i = 0; i < kHooks; ++i) {
    if (skip[i]) continue;
    const uintptr_t tpage =
        reinterpret_cast<uintptr_t>(tramps[i]) & ~(page - 1);
    if (mprotect(reinterpret_cast<void*>(tpage), page, PROT_READ | PROT_EXEC) !=
        0) {
      return absl::InternalError(
          absl::StrCat("mprotect trampolines: ", std::strerror(errno)));
    }
  }
  for (int i = 0; i < kHooks; ++i) {
    if (skip[i]) continue;
    uint8_t* at = sites[i].at;
    uint8_t jmp[kSiteBytes] = {0xe9};
    const int32_t rel = static_cast<int32_t>(tramps[i] - (at + kSiteBytes));
    std::memcpy(jmp + 1, &rel, 4);
    const uintptr_t begin = reinterpret_cast<uintptr_t>(at) & ~(page - 1);
    const uintptr_t end =
        (reinterpret_cast<uintptr_t>(at) + 16 + page - 1) & ~(page - 1);
    void* pages = reinterpret_cast<void*>(begin);
    if (mprotect(pages, end - begin, PROT_READ | PROT_WRITE | PROT_EXEC) != 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot make libc's ", hooks[i].name,
                       " writable: ", std::strerror(errno)));
    }
    absl::Status s = WriteSite(at, jmp);
    __builtin___clear_cache(reinterpret_cast<char*>(at),
                            reinterpret_cast<char*>(at) + kSiteBytes);
    if (mprotect(pages, end - begin, PROT_READ | PROT_EXEC) != 0 && s.ok()) {
      s = absl::InternalError(absl::StrCat(
          "cannot restore libc's code protection: ", std::strerror(errno)));
    }
    if (!s.ok()) return s;
    g_hooked[i] = true;
  }
  return absl::OkStatus();
#endif
}

}  // namespace

absl::Status InstallMemoryHooks() {
  static const absl::Status* const result = new absl::Status(DoInstall());
  return *result;
}

MemoryWatcher* MemoryWatcher::Acquire() {
  for (int i = 0; i < kMaxWatchers; ++i) {
    bool expected = false;
    if (!g_pool[i].taken.compare_exchange_strong(expected, true)) continue;
    MemoryWatcher* w = &g_pool[i].watcher;
    w->Reset();
    w->slot_ = i;
    g_active_watchers[i].store(w, std::memory_order_release);
    return w;
  }
  return nullptr;
}

void MemoryWatcher::Release(MemoryWatcher* w) {
  if (w == nullptr) return;
  const int slot = w->slot_;
  g_active_watchers[slot].store(nullptr, std::memory_order_release);
  // A hook that loaded it before may still record into it: harmless, the
  // object lives on (the pool is never freed) and is reset when reused.
  g_pool[slot].taken.store(false, std::memory_order_release);
}

void MemoryWatcher::Reset() {
  lo_.store(~uintptr_t{0});
  hi_.store(0);
  while (lock_.test_and_set(std::memory_order_acquire)) sched_yield();
  count_ = 0;
  lock_.clear(std::memory_order_release);
  overflow_flag_.store(false);
  drained_events_.store(events_.load());
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
  // Held only to copy a few bytes; bounded, in case a signal handler
  // interrupted a holder on this very thread.
  for (int spins = 0; lock_.test_and_set(std::memory_order_acquire);) {
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

uint64_t MemoryWatcher::Drain(std::vector<Range>* out, bool* overflow) {
  const uint64_t seen = events_.load(std::memory_order_acquire);
  while (lock_.test_and_set(std::memory_order_acquire)) sched_yield();
  out->insert(out->end(), ranges_, ranges_ + count_);
  count_ = 0;
  lock_.clear(std::memory_order_release);
  *overflow = overflow_flag_.exchange(false);
  return seen;
}

void MemoryWatcher::Acknowledge(uint64_t seen) {
  drained_events_.store(seen, std::memory_order_release);
}

bool MemoryHookCoversFixedMmap() {
  InstallMemoryHooks().IgnoreError();
  return g_hooked[3];
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
