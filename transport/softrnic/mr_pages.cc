#include "transport/softrnic/mr_pages.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

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

// ---- Mapped pages ---------------------------------------------------------

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

}  // namespace

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

bool StrictPagesOn() { return StrictMode().load(std::memory_order_relaxed); }

bool PinPagesOn() {
  static const bool on = [] {
    const char* env = std::getenv("FERRY_SOFTRNIC_PIN_PAGES");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  return on;
}

int PopulatePages(uintptr_t start, size_t length, bool writable) {
  const uintptr_t first = start / kPageSize;
  const uintptr_t last = (start + length - 1) / kPageSize;
  const size_t n = last - first + 1;
  void* base = reinterpret_cast<void*>(first * kPageSize);
  const size_t span = n * kPageSize;
  if (writable) {
    if (::madvise(base, span, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno == ENOMEM) return EFAULT;  // Not mapped.
  }
  // For read; or read-only memory (EFAULT or EINVAL, by kernel), or a
  // kernel without MADV_POPULATE_* (EINVAL). CheckMapped has ruled out
  // holes and pages the access may not touch, so touching them below is
  // safe.
  if (::madvise(base, span, MADV_POPULATE_READ) == 0) return 0;
  if (errno != EINVAL) return EFAULT;
  // No MADV_POPULATE_*: touch each page, once mincore has shown that every
  // one is mapped.
  std::vector<unsigned char> resident(n);
  if (::mincore(base, span, resident.data()) != 0) return EFAULT;
  for (size_t i = 0; i < n; ++i) {
    const uintptr_t p = std::max<uintptr_t>((first + i) * kPageSize, start);
    (void)*reinterpret_cast<const volatile uint8_t*>(p);
  }
  return 0;
}

int RecordFrames(uintptr_t start, size_t length, uint64_t** out) {
  const uintptr_t first = start / kPageSize;
  const uintptr_t last = (start + length - 1) / kPageSize;
  const size_t n = last - first + 1;
  if (const int err = PopulatePages(start, length, /*writable=*/true);
      err != 0) {
    return err;
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

}  // namespace softrnic

using namespace softrnic;

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
