// Protection domains and memory regions: allocating PDs, registering and
// deregistering MRs (host memory and dma-bufs), and the locked-memory
// account registrations are charged to. The slots and keys MRs live in
// are key_table.h's; the checks of the pages behind them, mr_pages.h's.
#include <errno.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>

#include "common/capabilities.h"
#include "gpu/softgpu/dmabuf.h"
#include "transport/softrnic/connection.h"
#include "transport/softrnic/key_table.h"
#include "transport/softrnic/mr_pages.h"
#include "transport/softrnic/softrnic.h"

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
    if (err == 0 && StrictPagesOn()) {
      err = RecordFrames(start, length, &frames);
    } else if (err == 0 && PinPagesOn()) {
      err = PopulatePages(start, length, writable);
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
    uint32_t slot, key;
    if (!TakeSlot(t, &slot, &key)) {
      delete[] frames;
      PinnedBytes().fetch_sub(pinned);
      return fail(ENOMEM);
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
    if (Slot(t, SlotOf(t, key)) != mr ||
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
  t.free_slots.push_back(SlotOf(t, key));
  return 0;
}
