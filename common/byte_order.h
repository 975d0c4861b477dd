// Loads and stores of fixed-width integers at any alignment, as they are
// (for fields already in wire order) or big-endian (network order), for
// the wire formats: the TCP transport's frames and softrnic's. memcpy is
// the one well-defined way to read an unaligned field; compilers turn each
// into a single move (and a bswap).
#ifndef FERRY_COMMON_BYTE_ORDER_H_
#define FERRY_COMMON_BYTE_ORDER_H_

#include <endian.h>

#include <cstdint>
#include <cstring>

namespace ferry {

template <typename T>
inline void StoreUnaligned(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename T>
inline T LoadUnaligned(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void StoreBe16(uint8_t* p, uint16_t v) { StoreUnaligned(p, htobe16(v)); }
inline void StoreBe32(uint8_t* p, uint32_t v) { StoreUnaligned(p, htobe32(v)); }
inline void StoreBe64(uint8_t* p, uint64_t v) { StoreUnaligned(p, htobe64(v)); }
inline uint16_t LoadBe16(const uint8_t* p) {
  return be16toh(LoadUnaligned<uint16_t>(p));
}
inline uint32_t LoadBe32(const uint8_t* p) {
  return be32toh(LoadUnaligned<uint32_t>(p));
}
inline uint64_t LoadBe64(const uint8_t* p) {
  return be64toh(LoadUnaligned<uint64_t>(p));
}

}  // namespace ferry

#endif  // FERRY_COMMON_BYTE_ORDER_H_
