// The keyed permutation that turns an MR's slot and generation into the
// lkey/rkey peers see (key_table.h). Immutable after construction:
// thread-safe.
#ifndef FERRY_TRANSPORT_SOFTRNIC_KEY_CIPHER_H_
#define FERRY_TRANSPORT_SOFTRNIC_KEY_CIPHER_H_

#include <cstdint>

#include "common/secure_random.h"

namespace softrnic {

// A four-round Feistel network on 16-bit halves with random round keys: a
// bijection of the 32-bit key space, cheap enough for every key lookup.
// Not a cipher one could publish; with 32-bit keys the bar is that keys
// are not guessable from one another, and a wrong guess costs the guesser
// its QP (a remote access error is fatal to an RC QP).
class KeyCipher {
 public:
  KeyCipher() { ferry::SecureRandomBytes(round_keys_, sizeof(round_keys_)); }

  // Decode(Encode(x)) == x for every x.
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

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_KEY_CIPHER_H_
