#include "transport/softrnic/key_table.h"

#include <atomic>
#include <cstdint>

#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

// Whether MR `mr`, held (so its fields are stable), lets `pd` access
// [addr, addr+len) with `access`.
bool Grants(const Mr* mr, Pd* pd, uint64_t addr, uint64_t len, int access) {
  return (pd == nullptr || mr->pd == pd) && (mr->access & access) == access &&
         addr >= mr->iova && addr + len >= addr &&
         addr + len <= mr->iova + mr->length &&
         (!mr->strict ||
          FramesUnchanged(mr, mr->start + (addr - mr->iova), len));
}

}  // namespace

KeyTable& Keys() {
  static auto* t = new KeyTable();
  return *t;
}

Mr* Slot(KeyTable& t, uint32_t slot) {
  if (slot >= kMaxSlots) return nullptr;
  Mr* chunk = t.chunks[slot >> kChunkBits].load(std::memory_order_acquire);
  return chunk == nullptr ? nullptr : &chunk[slot & (kChunkSlots - 1)];
}

bool TakeSlot(KeyTable& t, uint32_t* slot, uint32_t* key) {
  if (!t.free_slots.empty()) {
    *slot = t.free_slots.front();
    t.free_slots.pop_front();
  } else {
    if (t.used >= kMaxSlots) return false;
    *slot = t.used++;
    t.generations.push_back(0);
    std::atomic<Mr*>& chunk = t.chunks[*slot >> kChunkBits];
    if (chunk.load(std::memory_order_relaxed) == nullptr) {
      chunk.store(new Mr[kChunkSlots], std::memory_order_release);
    }
  }
  // Generation 0 is skipped, and so is the one generation (if any) that
  // the cipher maps to key 0: no key is 0.
  *key = 0;
  while (*key == 0) {
    uint8_t gen = ++t.generations[*slot];
    if (gen == 0) gen = t.generations[*slot] = 1;
    *key = t.cipher.Encode(*slot << 8 | gen);
  }
  return true;
}

Mr* AcquireMr(uint32_t key, Pd* pd, uint64_t addr, uint64_t len, int access) {
  KeyTable& t = Keys();
  Mr* mr = Slot(t, SlotOf(t, key));
  if (mr == nullptr || key == 0 ||
      mr->live_key.load(std::memory_order_acquire) != key) {
    return nullptr;
  }
  mr->inflight.fetch_add(1, std::memory_order_seq_cst);
  if (mr->live_key.load(std::memory_order_seq_cst) != key ||
      !Grants(mr, pd, addr, len, access)) {
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
        !Grants(mr, pd, addr, len, access)) {
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
