// Deterministic byte patterns for verified transfers: the byte at offset o
// of a stream with seed s is a function of (o, s) only, so any process can
// check any range without having seen the writer.
#ifndef FERRY_COMMON_PATTERN_H_
#define FERRY_COMMON_PATTERN_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ferry {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "FillPattern assumes a little-endian host");

inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint8_t PatternByte(uint64_t offset, uint64_t seed) {
  return static_cast<uint8_t>(Mix64((offset >> 3) ^ seed) >>
                              ((offset & 7) * 8));
}

// The byte at offset o is byte (o % 8) of the little-endian word
// Mix64(o / 8 ^ seed), so whole aligned words are filled and checked at once.
inline void FillPattern(uint8_t* dst, size_t len, uint64_t offset,
                        uint64_t seed) {
  size_t i = 0;
  for (; i < len && ((offset + i) & 7) != 0; ++i) {
    dst[i] = PatternByte(offset + i, seed);
  }
  for (; i + 8 <= len; i += 8) {
    uint64_t w = Mix64(((offset + i) >> 3) ^ seed);
    std::memcpy(dst + i, &w, 8);
  }
  for (; i < len; ++i) dst[i] = PatternByte(offset + i, seed);
}

// Returns the index of the first mismatching byte, or `len` if none.
inline size_t CheckPattern(const uint8_t* src, size_t len, uint64_t offset,
                           uint64_t seed) {
  size_t i = 0;
  for (; i < len && ((offset + i) & 7) != 0; ++i) {
    if (src[i] != PatternByte(offset + i, seed)) return i;
  }
  for (; i + 8 <= len; i += 8) {
    uint64_t w = Mix64(((offset + i) >> 3) ^ seed);
    if (std::memcmp(src + i, &w, 8) != 0) break;
  }
  for (; i < len; ++i) {
    if (src[i] != PatternByte(offset + i, seed)) return i;
  }
  return len;
}

}  // namespace ferry

#endif  // FERRY_COMMON_PATTERN_H_
