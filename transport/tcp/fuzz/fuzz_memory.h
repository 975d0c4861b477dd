// Target memory for the TCP fuzz targets: a buffer at a fixed address, so
// that a corpus can name it in its frames, between two PROT_NONE guard
// pages, so that an access outside it crashes at once.
#ifndef FERRY_TRANSPORT_TCP_FUZZ_FUZZ_MEMORY_H_
#define FERRY_TRANSPORT_TCP_FUZZ_FUZZ_MEMORY_H_

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>

namespace ferry::tcp::fuzz {

// Where the buffer is (if the address space allows; else anywhere). Inside
// the low application memory of ASan and TSan on x86-64.
constexpr uintptr_t kFuzzBase = 0x40000000;
constexpr size_t kFuzzBytes = 64 << 10;
constexpr size_t kGuardBytes = 4096;
// The remote-accessible buffer's key, and the target's incarnation, which
// frames must carry to reach it (server_frame.dict has both).
constexpr uint64_t kFuzzKey = 0x6b65796b65796b65;  // "keykeyke"
constexpr uint64_t kFuzzIncarnation = 0x696e63;    // "inc"

// Returns the buffer's address (kFuzzBase if that worked), or 0.
inline uintptr_t MapFuzzMemory() {
  const size_t total = kFuzzBytes + 2 * kGuardBytes;
  void* want = reinterpret_cast<void*>(kFuzzBase - kGuardBytes);
  void* p = mmap(want, total, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED) {
    p = mmap(nullptr, total, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 0;
  }
  auto* base = static_cast<uint8_t*>(p);
  mprotect(base, kGuardBytes, PROT_NONE);
  mprotect(base + kGuardBytes + kFuzzBytes, kGuardBytes, PROT_NONE);
  return reinterpret_cast<uintptr_t>(base + kGuardBytes);
}

}  // namespace ferry::tcp::fuzz

#endif  // FERRY_TRANSPORT_TCP_FUZZ_FUZZ_MEMORY_H_
