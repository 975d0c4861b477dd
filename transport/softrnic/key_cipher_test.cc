#include "transport/softrnic/key_cipher.h"

#include <cstdint>
#include <unordered_set>

#include "gtest/gtest.h"

namespace softrnic {
namespace {

TEST(SoftrnicKeyCipherTest, DecodeUndoesEncode) {
  const KeyCipher cipher;
  for (uint32_t x : {0u, 1u, 0xffu, 0x100u, 0xffffu, 0x10000u, 0x7fffffffu,
                     0x80000000u, 0xfffffffeu, 0xffffffffu}) {
    EXPECT_EQ(cipher.Decode(cipher.Encode(x)), x) << x;
    EXPECT_EQ(cipher.Encode(cipher.Decode(x)), x) << x;
  }
  // Spread over the whole space.
  for (uint64_t x = 0; x <= 0xffffffffu; x += 0x10001u * 97) {
    const auto v = static_cast<uint32_t>(x);
    ASSERT_EQ(cipher.Decode(cipher.Encode(v)), v) << v;
  }
}

// Keys as registration makes them, (slot << 8) | generation: neighbours
// never share a key, whatever the round keys.
TEST(SoftrnicKeyCipherTest, NeighbouringSlotsGetDistinctKeys) {
  const KeyCipher cipher;
  std::unordered_set<uint32_t> keys;
  for (uint32_t slot = 0; slot < 256; ++slot) {
    for (uint32_t gen = 0; gen < 256; ++gen) {
      ASSERT_TRUE(keys.insert(cipher.Encode(slot << 8 | gen)).second)
          << slot << " " << gen;
    }
  }
}

// Each cipher draws its own round keys: two tables do not share keys.
TEST(SoftrnicKeyCipherTest, RoundKeysAreRandom) {
  const KeyCipher a, b;
  int same = 0;
  for (uint32_t x = 1; x <= 64; ++x) same += a.Encode(x) == b.Encode(x);
  EXPECT_LT(same, 64);
}

}  // namespace
}  // namespace softrnic
