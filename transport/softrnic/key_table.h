// The key table: the slots that hold every MR, and the keys that name them.
// Registration takes a slot and a key under the table's lock; the data
// path finds an MR by key without one (AcquireMr, HeldMrs in softrnic.h).
//
// Keys are (slot << 8) | generation, shuffled by a keyed permutation of
// the 32-bit space (KeyCipher): slots and generations are small counters,
// and a stranger who learns one key must not read its neighbours off it.
// The slots live in chunks that are
// allocated on demand and never freed, so readers index them without a
// lock: a reader bumps the slot's `inflight`, then re-checks `live_key`;
// dereg clears `live_key`, then waits for `inflight` to drain before the
// slot may be reused.
#ifndef FERRY_TRANSPORT_SOFTRNIC_KEY_TABLE_H_
#define FERRY_TRANSPORT_SOFTRNIC_KEY_TABLE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <vector>

#include "common/mutex.h"
#include "transport/softrnic/key_cipher.h"
#include "transport/softrnic/softrnic.h"

namespace softrnic {

constexpr uint32_t kChunkBits = 12;
constexpr uint32_t kChunkSlots = 1u << kChunkBits;
constexpr uint32_t kMaxSlots = 1u << 24;
constexpr uint32_t kMaxChunks = kMaxSlots / kChunkSlots;

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

// The process's one table.
KeyTable& Keys();

// The MR in `slot`, or null where no chunk holds it (yet). Lock-free.
Mr* Slot(KeyTable& t, uint32_t slot);

// The slot `key` names (it may hold another key's MR, or none).
inline uint32_t SlotOf(const KeyTable& t, uint32_t key) {
  return t.cipher.Decode(key) >> 8;
}

// Takes a slot for a new MR, the oldest freed one or else a new one, and
// gives it its next key: *slot and *key. False, with nothing taken, if all
// kMaxSlots slots are in use.
bool TakeSlot(KeyTable& t, uint32_t* slot, uint32_t* key)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(t.mu);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_KEY_TABLE_H_
