// Protection domains, memory regions, the key table, and strict page
// identity.
#include <errno.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>

#include "common/capabilities.h"
#include "common/secure_random.h"
#include "gpu/softgpu/dmabuf.h"
#include "transport/softrnic/connection.h"
#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

// Keys are (slot << 8) | generation, shuffled by a keyed permutation of
// the 32-bit space (KeyCipher): slots and generations are small counters,
// and a stranger who learns one key must not read its neighbours off it.
// The slots live in chunks that are
// allocated on demand and never freed, so readers index them without a
// lock: a reader bumps the slot's `inflight`, then re-checks `live_key`;
// dereg clears `live_key`, then waits for `inflight` to drain before the
// slot may be reused.
constexpr uint32_t kChunkBits = 12;
constexpr uint32_t kChunkSlots = 1u << kChunkBits;
constexpr uint32_t kMaxSlots = 1u << 24;
constexpr uint32_t kMaxChunks = kMaxSlots / kChunkSlots;

// A four-round Feistel network on 16-bit halves with random round keys: a
// bijection of the 32-bit key space, cheap enough for every key lookup.
// Not a cipher one could publish; with 32-bit keys the bar is that keys
// are not guessable from one another, and a wrong guess costs the guesser
// its QP (a remote access error is fatal to an RC QP).
class KeyCipher {
 public:
  KeyCipher() { ferry::SecureRandomBytes(round_keys_, sizeof(round_keys_)); }

  uint32_t Encode(uint32_t x) const {
    uint32_t l = x >> 16, r = x & 0xffff;
    for (uint32_t k : round_keys_) {
      const uint32_t next = l ^ F(r, k);
      l = r;
      r = next;
    }
    return l << 16 | r;
  }

  uint32_t Decode(uint32_t y) const {
    uint32_t l = y >> 16, r = y & 0xffff;
    for (int i = kRounds - 1; i >= 0; --i) {
      const uint32_t prev = r ^ F(l, round_keys_[i]);
      r = l;
      l = prev;
    }
    return l << 16 | r;
  }

 private:
  static constexpr int kRounds = 4;
  static uint32_t F(uint32_t half, uint32_t k) {
    return (((half | half << 16) ^ k) * 0x9e3779b1u) >> 16;
  }
  uint32_t round_keys_[kRounds];
};

struct KeyTable {
  const KeyCipher cipher;
  std::atomic<Mr*> chunks[kMaxChunks] = {};
  ferry::Mutex mu;  // Serializes registration and dereg.
  uint32_t used ABSL_GUARDED_BY(mu) = 0;
  std::vector<uint8_t> generations ABSL_GUARDED_BY(mu);
  // Oldest first, so a slot (and its 8-bit generation) is reused as late
  // as possible.
  std::deque<uint32_t> free_slots ABSL_GUARDED_BY(mu);
};

KeyTable& Keys() {
  static auto* t = new KeyTable();
  return *t;
}

Mr* Slot(KeyTable& t, uint32_t slot) {
  if (slot >= kMaxSlots) return nullptr;
  Mr* chunk = t.chunks[slot >> kChunkBits].load(std::memory_order_acquire);
  return chunk == nullptr ? nullptr : &chunk[slot & (kChunkSlots - 1)];
}

// ---- Strict page identity ------------------------------------------------
//
// A NIC's ibv_reg_mr pins the pages behind the MR, and the NIC moves bytes
// to and from those physical pages until dereg, whatever the process maps
// at those addresses meanwhile. softrnic copies through virtual addresses,
// so a stale registration (memory unmapped and mapped again, as after free
// and reuse) silently touches the new memory where a NIC would touch the
// old. In strict mode a registration records the frame of every page
// (/proc/self/pagemap, which shows frame numbers to root only) and every
// access compares the frames of the pages it touches.

constexpr uint64_t kPageSize = 4096;
constexpr uint64_t kPresent = 1ull << 63;
constexpr uint64_t kFrameMask = (1ull << 55) - 1;

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

std::atomic<uint64_t> strict_violations{0};

// Reads the pagemap entries of `n` pages from virtual page `first`.
// pagemap is opened per call: a descriptor kept open would go on reading
// the parent's pages in a forked child.
bool ReadPagemap(uint64_t first, size_t n, uint64_t* out) {
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = true;
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(
        fd, reinterpret_cast<char*>(out + done), (n - done) * sizeof(*out),
        static_cast<off_t>((first + done) * sizeof(*out)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0 || r % sizeof(*out) != 0) {
      ok = false;
      break;
    }
    done += static_cast<size_t>(r) / sizeof(*out);
  }
  ::close(fd);
  return ok;
}

// Whether pagemap shows frame numbers to this process (it shows zeros
// without CAP_SYS_ADMIN).
bool FramesVisible() {
  static volatile uint64_t probe = 1;  // A page of this library's data.
  probe = probe + 1;
  uint64_t e = 0;
  if (!ReadPagemap(reinterpret_cast<uintptr_t>(&probe) / kPageSize, 1, &e)) {
    return false;
  }
  return (e & kPresent) != 0 && (e & kFrameMask) != 0;
}

std::atomic<bool>& StrictMode() {
  static std::atomic<bool>* on = [] {
    auto* flag = new std::atomic<bool>(false);
    const char* env = std::getenv("FERRY_SOFTRNIC_STRICT_PAGES");
    if (env != nullptr && std::strcmp(env, "1") == 0) {
      if (FramesVisible()) {
        flag->store(true);
      } else {
        std::fprintf(stderr,
                     "softrnic: FERRY_SOFTRNIC_STRICT_PAGES=1 ignored: "
                     "/proc/self/pagemap shows no frame numbers (needs "
                     "root)\n");
      }
    }
    return flag;
  }();
  return *on;
}

// struct procmap_query of <linux/fs.h> (Linux 6.11), which Debian 12's
// headers predate; the layout is the kernel's stable ABI.
struct ProcmapQuery {
  uint64_t size;
  uint64_t query_flags;
  uint64_t query_addr;
  uint64_t vma_start;
  uint64_t vma_end;
  uint64_t vma_flags;
  uint64_t vma_page_size;
  uint64_t vma_offset;
  uint64_t inode;
  uint32_t dev_major;
  uint32_t dev_minor;
  uint32_t vma_name_size;
  uint32_t build_id_size;
  uint64_t vma_name_addr;
  uint64_t build_id_addr;
};
static_assert(sizeof(ProcmapQuery) == 104, "the kernel's procmap_query");
constexpr unsigned long kProcmapQuery = 0xC0686611;  // _IOWR('f', 17, 104)
constexpr uint64_t kVmaReadable = 0x01;
constexpr uint64_t kVmaWritable = 0x02;

// CheckMapped through PROCMAP_QUERY: 0, EFAULT, or -1 where the kernel
// has no such ioctl.
int CheckMappedByQuery(int fd, uintptr_t start, uintptr_t end, bool writable) {
  uintptr_t covered = start;
  while (covered < end) {
    ProcmapQuery q{};
    q.size = sizeof(q);
    q.query_addr = covered;  // No flags: the mapping covering it, or none.
    if (::ioctl(fd, kProcmapQuery, &q) != 0) {
      if (errno == ENOENT) return EFAULT;  // A hole.
      return -1;  // No such ioctl (or it failed): the file tells.
    }
    if (q.vma_start > covered || q.vma_end <= covered) return EFAULT;
    if ((q.vma_flags & kVmaReadable) == 0 ||
        (writable && (q.vma_flags & kVmaWritable) == 0)) {
      return EFAULT;
    }
    covered = q.vma_end;
  }
  return 0;
}

// Whether every page of [start, start + length) is mapped readable (and
// writable if `writable`), from /proc/self/maps. The kernel's ibv_reg_mr
// pins the pages and fails with EFAULT where it cannot: an unmapped hole,
// PROT_NONE memory (a GPU address without nvidia-peermem), or read-only
// memory registered for writing. softrnic pins nothing, so without this a
// bad registration would succeed and the first access would fault inside
// the NIC's thread. Returns 0 or EFAULT. A process out of file descriptors
// cannot open maps, but the kernel's ibv_reg_mr needs none: the check is
// skipped then rather than failing a registration hardware would accept.
//
// Linux 6.11 and later answer "which mapping covers this address" with
// one ioctl on the maps file (PROCMAP_QUERY), in time that does not depend
// on how many mappings come before it; older kernels refuse the ioctl
// (ENOTTY), and the file is read line by line up to the range, which costs
// about a microsecond per line (a 4 KiB mapping placed high among a
// process's libraries: 131 us against 16 us for one placed low, measured
// in docs/optimisation.md's MR cache chapter).
int CheckMapped(uintptr_t start, size_t length, bool writable) {
  const uintptr_t end = start + length;
  // FERRY_SOFTRNIC_MAPS_QUERY=0: the older kernels' way, to test it here.
  static const bool query = [] {
    const char* v = std::getenv("FERRY_SOFTRNIC_MAPS_QUERY");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  if (const int fd =
          query ? ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC) : -1;
      fd >= 0) {
    const int r = CheckMappedByQuery(fd, start, end, writable);
    ::close(fd);
    if (r >= 0) return r;
  }
  FILE* maps = std::fopen("/proc/self/maps", "re");
  if (maps == nullptr) return 0;
  uintptr_t covered = start;  // Checked up to here.
  char line[512];
  while (covered < end && std::fgets(line, sizeof(line), maps) != nullptr) {
    // A line longer than the buffer (a long path): drop its rest, so that
    // it is never read as a line of its own.
    if (std::strchr(line, '\n') == nullptr) {
      char rest[512];
      while (std::fgets(rest, sizeof(rest), maps) != nullptr &&
             std::strchr(rest, '\n') == nullptr) {
      }
    }
    unsigned long lo = 0, hi = 0;  // NOLINT: sscanf's types
    char perms[5] = {};
    if (std::sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3) continue;
    if (hi <= covered) continue;
    if (lo > covered) break;  // A hole: maps are sorted by address.
    if (perms[0] != 'r' || (writable && perms[1] != 'w')) break;
    covered = hi;
  }
  std::fclose(maps);
  return covered >= end ? 0 : EFAULT;
}

// Faults the pages of [start, start+length) in, as ibv_reg_mr pins them
// (writable pages for write, so that a later write does not move a page
// off the shared zero page), and returns their frames in *out (new[]).
// Returns 0 or an errno: EFAULT if a page is not mapped, EPERM if frames
// are hidden.
int RecordFrames(uintptr_t start, size_t length, uint64_t** out) {
  const uintptr_t first = start / kPageSize;
  const uintptr_t last = (start + length - 1) / kPageSize;
  const size_t n = last - first + 1;
  void* base = reinterpret_cast<void*>(first * kPageSize);
  const size_t span = n * kPageSize;
  if (::madvise(base, span, MADV_POPULATE_WRITE) != 0) {
    if (errno == ENOMEM) return EFAULT;  // Not mapped.
    // Read-only memory (EFAULT or EINVAL, by kernel) or a kernel without
    // MADV_POPULATE_* (EINVAL). CheckMapped has ruled out holes and pages
    // the access may not touch, so touching them below is safe.
    if (::madvise(base, span, MADV_POPULATE_READ) != 0) {
      if (errno != EINVAL) return EFAULT;
      // No MADV_POPULATE_*: touch each page, once mincore has shown that
      // every one is mapped.
      std::vector<unsigned char> resident(n);
      if (::mincore(base, span, resident.data()) != 0) return EFAULT;
      for (size_t i = 0; i < n; ++i) {
        const uintptr_t p = std::max<uintptr_t>((first + i) * kPageSize, start);
        (void)*reinterpret_cast<const volatile uint8_t*>(p);
      }
    }
  }
  auto* frames = new uint64_t[n];
  if (!ReadPagemap(first, n, frames)) {
    delete[] frames;
    return EFAULT;
  }
  for (size_t i = 0; i < n; ++i) {
    if ((frames[i] & kPresent) == 0) {
      delete[] frames;
      return EFAULT;
    }
    frames[i] &= kFrameMask;
    if (frames[i] == 0) {
      delete[] frames;
      return EPERM;
    }
  }
  *out = frames;
  return 0;
}

}  // namespace

bool FramesUnchanged(const Mr* mr, uintptr_t host, uint64_t len) {
  if (len == 0) return true;
  const uintptr_t base = mr->start / kPageSize;
  const uintptr_t first = host / kPageSize;
  const uintptr_t last = (host + len - 1) / kPageSize;
  uint64_t buf[512];
  for (uintptr_t page = first; page <= last;) {
    const size_t n = std::min<uintptr_t>(last - page + 1, 512);
    bool same = ReadPagemap(page, n, buf);
    for (size_t i = 0; same && i < n; ++i) {
      same = (buf[i] & kPresent) != 0 &&
             (buf[i] & kFrameMask) == mr->frames[page - base + i];
    }
    if (!same) {
      const uint64_t count = strict_violations.fetch_add(1) + 1;
      if (count <= 10) {
        std::fprintf(stderr,
                     "softrnic: strict pages: MR lkey 0x%x: the page at %p "
                     "is not the one registered (memory unmapped and "
                     "mapped again?); access refused\n",
                     mr->mr.lkey, reinterpret_cast<void*>(page * kPageSize));
      }
      return false;
    }
    page += n;
  }
  return true;
}

Mr* AcquireMr(uint32_t key, Pd* pd, uint64_t addr, uint64_t len, int access) {
  KeyTable& t = Keys();
  Mr* mr = Slot(t, t.cipher.Decode(key) >> 8);
  if (mr == nullptr || key == 0 ||
      mr->live_key.load(std::memory_order_acquire) != key) {
    return nullptr;
  }
  mr->inflight.fetch_add(1, std::memory_order_seq_cst);
  if (mr->live_key.load(std::memory_order_seq_cst) != key ||
      (pd != nullptr && mr->pd != pd) || (mr->access & access) != access ||
      addr < mr->iova || addr + len < addr ||
      addr + len > mr->iova + mr->length ||
      (mr->strict &&
       !FramesUnchanged(mr, mr->start + (addr - mr->iova), len))) {
    mr->inflight.fetch_sub(1, std::memory_order_release);
    return nullptr;
  }
  return mr;
}

void ReleaseMr(Mr* mr) { mr->inflight.fetch_sub(1, std::memory_order_release); }

Mr* HeldMrs::Get(uint32_t key, Pd* pd, uint64_t addr, uint64_t len,
                 int access) {
  for (int i = 0; i < n_; ++i) {
    Mr* mr = mrs_[i];
    if (mr->mr.lkey != key) continue;
    // Held, so its fields are stable; a dereg that began meanwhile has
    // cleared live_key, and then the key no longer works.
    if (mr->live_key.load(std::memory_order_acquire) != key ||
        (pd != nullptr && mr->pd != pd) || (mr->access & access) != access ||
        addr < mr->iova || addr + len < addr ||
        addr + len > mr->iova + mr->length ||
        (mr->strict &&
         !FramesUnchanged(mr, mr->start + (addr - mr->iova), len))) {
      return nullptr;
    }
    return mr;
  }
  Mr* mr = AcquireMr(key, pd, addr, len, access);
  if (mr == nullptr) return nullptr;
  if (n_ == kSlots) {
    ReleaseMr(mr);  // MakeRoom was not called: never hold more than kSlots.
    return nullptr;
  }
  mrs_[n_++] = mr;
  return mr;
}

void HeldMrs::ReleaseAll() {
  for (int i = 0; i < n_; ++i) ReleaseMr(mrs_[i]);
  n_ = 0;
}

}  // namespace softrnic

using namespace softrnic;

SOFTRNIC_EXPORT ibv_pd* ibv_alloc_pd(ibv_context* context) {
  if (Dead(context)) {
    errno = EIO;
    return nullptr;
  }
  auto* pd = new Pd();
  pd->pd.context = context;
  static std::atomic<uint32_t> next_handle{1};
  pd->pd.handle = next_handle++;
  return &pd->pd;
}

SOFTRNIC_EXPORT int ibv_dealloc_pd(ibv_pd* ibpd) {
  auto* pd = reinterpret_cast<Pd*>(ibpd);
  if (pd->users.load() != 0) return EBUSY;
  delete pd;
  return 0;
}

// ---- Locked memory --------------------------------------------------------
// A NIC pins registered pages, and the kernel charges them to the process's
// RLIMIT_MEMLOCK unless it has CAP_IPC_LOCK: ibv_reg_mr fails with ENOMEM
// past the limit. softrnic pins nothing but keeps the same account, so the
// error (and Ferry's handling of it) shows up where it would on hardware.
namespace {

std::atomic<uint64_t>& PinnedBytes() {
  static std::atomic<uint64_t> pinned{0};
  return pinned;
}

// Charges the pages of [addr, addr + length); false (nothing charged) if
// that would pass the limit.
bool ChargePinned(uintptr_t addr, size_t length, uint64_t* charged) {
  const uintptr_t page = 4096;
  const uint64_t bytes =
      ((addr + length + page - 1) & ~(page - 1)) - (addr & ~(page - 1));
  rlimit rl{};
  const bool limited = getrlimit(RLIMIT_MEMLOCK, &rl) == 0 &&
                       rl.rlim_cur != RLIM_INFINITY &&
                       !ferry::HasCapability(CAP_IPC_LOCK);
  uint64_t now = PinnedBytes().load(std::memory_order_relaxed);
  do {
    if (limited && now + bytes > rl.rlim_cur) return false;
  } while (!PinnedBytes().compare_exchange_weak(now, now + bytes));
  *charged = bytes;
  return true;
}

}  // namespace

namespace {

// Registers [start, start + length) as seen by peers at `iova`. A dma-buf
// MR (`dmabuf_map` not null, owned by the MR from here on, also on
// failure) is device memory: the kernel charges it to no locked-memory
// budget and its pages are not the process's, so neither applies.
ibv_mr* RegisterMr(ibv_pd* ibpd, uintptr_t start, size_t length, uint64_t iova,
                   unsigned int access, void* dmabuf_map,
                   size_t dmabuf_map_length) {
  auto fail = [&](int err) -> ibv_mr* {
    if (dmabuf_map != nullptr) ::munmap(dmabuf_map, dmabuf_map_length);
    errno = err;
    return nullptr;
  };
  const unsigned int kKnown = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                              IBV_ACCESS_REMOTE_READ |
                              IBV_ACCESS_REMOTE_ATOMIC |
                              IBV_ACCESS_RELAXED_ORDERING;
  if (Dead(ibpd->context)) return fail(EIO);
  if ((access & ~kKnown) != 0 || length == 0 || start + length < start ||
      iova + length < iova) {
    return fail(EINVAL);
  }
  // As on real NICs: remote write or atomic access needs local write.
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE)) {
    return fail(EINVAL);
  }
  auto* pd = reinterpret_cast<Pd*>(ibpd);
  uint64_t pinned = 0;
  if (dmabuf_map == nullptr && !ChargePinned(start, length, &pinned)) {
    return fail(ENOMEM);  // As the kernel: over RLIMIT_MEMLOCK.
  }
  uint64_t* frames = nullptr;
  if (dmabuf_map == nullptr) {
    // Checked in strict mode too, before RecordFrames touches any page.
    const bool writable =
        (access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                   IBV_ACCESS_REMOTE_ATOMIC)) != 0;
    int err = CheckMapped(start, length, writable);
    if (err == 0 && StrictMode().load(std::memory_order_relaxed)) {
      err = RecordFrames(start, length, &frames);
    }
    if (err != 0) {
      PinnedBytes().fetch_sub(pinned);
      return fail(err);
    }
  }
  KeyTable& t = Keys();
  Mr* mr;
  {
    ferry::MutexLock lock(&t.mu);
    uint32_t slot;
    if (!t.free_slots.empty()) {
      slot = t.free_slots.front();
      t.free_slots.pop_front();
    } else {
      if (t.used >= kMaxSlots) {
        delete[] frames;
        PinnedBytes().fetch_sub(pinned);
        return fail(ENOMEM);
      }
      slot = t.used++;
      t.generations.push_back(0);
      std::atomic<Mr*>& chunk = t.chunks[slot >> kChunkBits];
      if (chunk.load(std::memory_order_relaxed) == nullptr) {
        chunk.store(new Mr[kChunkSlots], std::memory_order_release);
      }
    }
    // Generation 0 is skipped, and so is the one generation (if any) that
    // the cipher maps to key 0: no key is 0.
    uint32_t key = 0;
    while (key == 0) {
      uint8_t gen = ++t.generations[slot];
      if (gen == 0) gen = t.generations[slot] = 1;
      key = t.cipher.Encode(slot << 8 | gen);
    }
    mr = Slot(t, slot);
    mr->pd = pd;
    mr->access = static_cast<int>(access & ~IBV_ACCESS_RELAXED_ORDERING);
    mr->start = start;
    mr->iova = iova;
    mr->length = length;
    mr->strict = frames != nullptr;
    mr->frames = frames;
    mr->pinned = pinned;
    mr->dmabuf_map = dmabuf_map;
    mr->dmabuf_map_length = dmabuf_map_length;
    mr->mr.lkey = mr->mr.rkey = key;
    mr->live_key.store(mr->mr.lkey, std::memory_order_release);
  }
  mr->mr.context = ibpd->context;
  mr->mr.pd = ibpd;
  // As rdma-core, a dma-buf MR reports its offset into the dma-buf as its
  // addr (ibv_reg_dmabuf_mr sets it after this).
  mr->mr.addr = reinterpret_cast<void*>(start);
  mr->mr.length = length;
  mr->mr.handle = mr->mr.lkey;
  pd->users.fetch_add(1);
  return &mr->mr;
}

}  // namespace

SOFTRNIC_EXPORT ibv_mr* ibv_reg_mr_iova2(ibv_pd* ibpd, void* addr,
                                         size_t length, uint64_t iova,
                                         unsigned int access) {
  return RegisterMr(ibpd, reinterpret_cast<uintptr_t>(addr), length, iova,
                    access, /*dmabuf_map=*/nullptr, /*dmabuf_map_length=*/0);
}

SOFTRNIC_EXPORT ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length,
                                   int access) {
  return ibv_reg_mr_iova2(pd, addr, length, reinterpret_cast<uintptr_t>(addr),
                          static_cast<unsigned int>(access));
}

SOFTRNIC_EXPORT ibv_mr* ibv_reg_mr_iova(ibv_pd* pd, void* addr, size_t length,
                                        uint64_t iova, int access) {
  return ibv_reg_mr_iova2(pd, addr, length, iova,
                          static_cast<unsigned int>(access));
}

// A NIC reads and writes a dma-buf's memory (a GPU's, for GPUDirect RDMA)
// without the CPU. softrnic is the CPU, so it maps the dma-buf itself: the
// exporters it knows are softgpu's (gpu/softgpu/dmabuf.h), whose dma-bufs
// are memory files positioned at their first byte. Any other file
// descriptor is refused with EINVAL, as the kernel refuses one that is not
// a dma-buf.
SOFTRNIC_EXPORT ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset,
                                          size_t length, uint64_t iova, int fd,
                                          int access) {
  uint64_t base = 0;
  uint64_t size = 0;
  if (!softgpu::DmabufRange(fd, &base, &size)) {
    errno = EINVAL;
    return nullptr;
  }
  if (length == 0 || offset + length < offset || offset + length > size) {
    errno = EINVAL;  // Past the dma-buf's end.
    return nullptr;
  }
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t first = base + offset;
  const uint64_t map_start = first & ~(page - 1);
  const size_t map_length = static_cast<size_t>(
      ((first + length + page - 1) & ~(page - 1)) - map_start);
  void* map = ::mmap(nullptr, map_length, PROT_READ | PROT_WRITE, MAP_SHARED,
                     fd, static_cast<off_t>(map_start));
  if (map == MAP_FAILED) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_mr* mr = RegisterMr(
      pd, reinterpret_cast<uintptr_t>(map) + (first - map_start), length, iova,
      static_cast<unsigned int>(access), map, map_length);
  if (mr != nullptr) mr->addr = reinterpret_cast<void*>(offset);
  return mr;
}

SOFTRNIC_EXPORT int ibv_rereg_mr(ibv_mr*, int, ibv_pd*, void*, size_t, int) {
  errno = EOPNOTSUPP;
  return IBV_REREG_MR_ERR_INPUT;
}

SOFTRNIC_EXPORT int ibv_dereg_mr(ibv_mr* ibmr) {
  auto* mr = reinterpret_cast<Mr*>(ibmr);
  KeyTable& t = Keys();
  const uint32_t key = mr->mr.lkey;
  {
    ferry::MutexLock lock(&t.mu);
    if (Slot(t, t.cipher.Decode(key) >> 8) != mr ||
        mr->live_key.load(std::memory_order_relaxed) != key) {
      return EINVAL;
    }
    mr->live_key.store(0, std::memory_order_seq_cst);
  }
  // After dereg returns the "NIC" must not touch the memory. An access in
  // progress over a connection (a peer's WRITE arriving, a READ response
  // leaving) may wait on the peer for ever, so it is aborted: its
  // connection is closed, which the requester sees as a lost packet. A copy
  // between QPs of this process is not interrupted: it ends after at most
  // one message. No key lookup can start a new access (live_key is 0).
  // Most accesses end within microseconds: they get a millisecond before
  // their connections are cut (and a retransmission), and the scan of
  // every connection, under the process-wide registry lock, is repeated
  // only every 100 ms after that.
  auto pause = std::chrono::microseconds(20);
  const Clock::time_point start = Clock::now();
  Clock::time_point next_abort = start + std::chrono::milliseconds(1);
  bool reported = false;
  while (mr->inflight.load(std::memory_order_acquire) != 0) {
    if (Clock::now() >= next_abort) {
      AbortConnectionsHolding(mr);
      next_abort = Clock::now() + std::chrono::milliseconds(100);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
    if (!reported && Clock::now() - start > std::chrono::seconds(5)) {
      reported = true;
      std::fprintf(stderr,
                   "softrnic: ibv_dereg_mr(lkey 0x%x) still waits for an "
                   "access in progress after 5 s\n",
                   key);
    }
  }
  mr->pd->users.fetch_sub(1);
  PinnedBytes().fetch_sub(mr->pinned);
  mr->pinned = 0;
  if (mr->dmabuf_map != nullptr) {
    ::munmap(mr->dmabuf_map, mr->dmabuf_map_length);
    mr->dmabuf_map = nullptr;
    mr->dmabuf_map_length = 0;
  }
  delete[] mr->frames;
  mr->frames = nullptr;
  mr->strict = false;
  ferry::MutexLock lock(&t.mu);
  t.free_slots.push_back(t.cipher.Decode(key) >> 8);
  return 0;
}

// ---- Strict page identity (softrnic_control.h) ---------------------------

SOFTRNIC_EXPORT int softrnic_set_strict_pages(int on) {
  if (on != 0 && !FramesVisible()) {
    errno = EPERM;
    return -1;
  }
  StrictMode().store(on != 0);
  return 0;
}

SOFTRNIC_EXPORT uint64_t softrnic_strict_page_violations(void) {
  return strict_violations.load();
}
