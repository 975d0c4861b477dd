// Protection domains, memory regions and the key table.
#include <errno.h>

#include <shared_mutex>

#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

// Keys are (slot << 8) | generation: a slot reused after dereg gets a new
// generation, so a peer holding the old rkey is refused, not aliased.
struct KeyTable {
  std::shared_mutex mu;
  std::vector<Mr*> slots;
  std::vector<uint8_t> generations;
  std::vector<uint32_t> free_slots;
};

KeyTable& Keys() {
  static auto* t = new KeyTable();
  return *t;
}

}  // namespace

Mr* AcquireMr(uint32_t key, Pd* pd, uint64_t addr, uint64_t len, int access) {
  KeyTable& t = Keys();
  std::shared_lock<std::shared_mutex> lock(t.mu);
  uint32_t slot = key >> 8;
  if (slot >= t.slots.size()) return nullptr;
  Mr* mr = t.slots[slot];
  if (mr == nullptr || mr->generation != (key & 0xff) || !mr->valid.load()) {
    return nullptr;
  }
  if (pd != nullptr && mr->pd != pd) return nullptr;
  if ((mr->access & access) != access) return nullptr;
  if (addr < mr->iova || addr + len < addr ||
      addr + len > mr->iova + mr->length) {
    return nullptr;
  }
  mr->inflight.fetch_add(1, std::memory_order_acquire);
  return mr;
}

void ReleaseMr(Mr* mr) { mr->inflight.fetch_sub(1, std::memory_order_release); }

}  // namespace softrnic

using namespace softrnic;

SOFTRNIC_EXPORT ibv_pd* ibv_alloc_pd(ibv_context* context) {
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

SOFTRNIC_EXPORT ibv_mr* ibv_reg_mr_iova2(ibv_pd* ibpd, void* addr,
                                         size_t length, uint64_t iova,
                                         unsigned int access) {
  const unsigned int kKnown = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                              IBV_ACCESS_REMOTE_READ |
                              IBV_ACCESS_REMOTE_ATOMIC |
                              IBV_ACCESS_RELAXED_ORDERING;
  if ((access & ~kKnown) != 0 || length == 0 ||
      reinterpret_cast<uintptr_t>(addr) + length <
          reinterpret_cast<uintptr_t>(addr) ||
      iova + length < iova) {
    errno = EINVAL;
    return nullptr;
  }
  // As on real NICs: remote write or atomic access needs local write.
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* pd = reinterpret_cast<Pd*>(ibpd);
  auto* mr = new Mr();
  mr->pd = pd;
  mr->access = static_cast<int>(access & ~IBV_ACCESS_RELAXED_ORDERING);
  mr->start = reinterpret_cast<uintptr_t>(addr);
  mr->iova = iova;
  mr->length = length;
  KeyTable& t = Keys();
  {
    std::unique_lock<std::shared_mutex> lock(t.mu);
    uint32_t slot;
    if (!t.free_slots.empty()) {
      slot = t.free_slots.back();
      t.free_slots.pop_back();
    } else {
      if (t.slots.size() >= (1u << 24)) {
        delete mr;
        errno = ENOMEM;
        return nullptr;
      }
      slot = static_cast<uint32_t>(t.slots.size());
      t.slots.push_back(nullptr);
      t.generations.push_back(0);
    }
    mr->generation = ++t.generations[slot];
    t.slots[slot] = mr;
    mr->mr.lkey = mr->mr.rkey = (slot << 8) | mr->generation;
  }
  mr->mr.context = ibpd->context;
  mr->mr.pd = ibpd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  mr->mr.handle = mr->mr.lkey;
  pd->users.fetch_add(1);
  return &mr->mr;
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

SOFTRNIC_EXPORT ibv_mr* ibv_reg_dmabuf_mr(ibv_pd*, uint64_t, size_t, uint64_t,
                                          int, int) {
  errno = EOPNOTSUPP;  // No device memory to export.
  return nullptr;
}

SOFTRNIC_EXPORT int ibv_rereg_mr(ibv_mr*, int, ibv_pd*, void*, size_t, int) {
  errno = EOPNOTSUPP;
  return IBV_REREG_MR_ERR_INPUT;
}

SOFTRNIC_EXPORT int ibv_dereg_mr(ibv_mr* ibmr) {
  auto* mr = reinterpret_cast<Mr*>(ibmr);
  KeyTable& t = Keys();
  {
    std::unique_lock<std::shared_mutex> lock(t.mu);
    uint32_t slot = mr->mr.lkey >> 8;
    if (slot >= t.slots.size() || t.slots[slot] != mr) return EINVAL;
    t.slots[slot] = nullptr;
    t.free_slots.push_back(slot);
    mr->valid.store(false);
  }
  // After dereg returns the "NIC" must not touch the memory: wait for
  // responder accesses in progress, which are bounded by socket timeouts.
  while (mr->inflight.load(std::memory_order_acquire) != 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  mr->pd->users.fetch_sub(1);
  delete mr;
  return 0;
}
