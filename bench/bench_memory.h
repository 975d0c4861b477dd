// BenchMemory: where transfer_bench's buffers live. Host memory, or with
// --use_vram (Mooncake's flag) device memory of one GPU, which the CPU
// cannot touch: its pattern is written and checked through the CUDA
// driver's copies (gpu/cuda_driver.h, loaded at run time), so a bench run
// verifies GPU memory end to end as it does host memory.
//
// Thread-safe: Fill, Clear and Check on disjoint ranges from any thread.
#ifndef FERRY_BENCH_BENCH_MEMORY_H_
#define FERRY_BENCH_BENCH_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/cuda_driver.h"

namespace ferry {

class BenchMemory {
 public:
  // `bytes` of page-aligned host memory (gpu < 0), or of device memory on
  // GPU `gpu` (an error names what is missing: a driver, the device).
  static absl::StatusOr<std::unique_ptr<BenchMemory>> Allocate(int gpu,
                                                               size_t bytes);
  ~BenchMemory();
  BenchMemory(const BenchMemory&) = delete;
  BenchMemory& operator=(const BenchMemory&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool on_gpu() const { return gpu_ >= 0; }
  // The location to register the memory with: "cpu:0" or "cuda:N".
  std::string location() const;

  // Writes common/pattern.h's pattern for buffer offsets [off, off + len)
  // at p (inside this memory); zeroes [p, p + len).
  absl::Status Fill(uint8_t* p, size_t len, size_t off, uint64_t seed) const;
  absl::Status Clear(uint8_t* p, size_t len) const;
  // Where [p, p + len) first differs from the pattern (len if nowhere),
  // and the byte found there.
  struct Mismatch {
    size_t index = 0;
    uint8_t found = 0;
  };
  absl::StatusOr<Mismatch> Check(const uint8_t* p, size_t len, size_t off,
                                 uint64_t seed) const;

 private:
  BenchMemory(const gpu::CudaDriver* driver, int gpu, uint8_t* data,
              size_t size)
      : driver_(driver), gpu_(gpu), data_(data), size_(size) {}

  const gpu::CudaDriver* const driver_;  // Null for host memory.
  const int gpu_;
  uint8_t* const data_;
  const size_t size_;
};

}  // namespace ferry

#endif  // FERRY_BENCH_BENCH_MEMORY_H_
