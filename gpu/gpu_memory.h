// Which registered buffers are GPU memory: the check every registration
// makes, so that a transport never touches device memory with the CPU and
// a buffer's location names the GPU holding it (Mooncake's "cuda:N").
#ifndef FERRY_GPU_GPU_MEMORY_H_
#define FERRY_GPU_GPU_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace ferry::gpu {

// The device ordinal of the GPU whose memory [addr, addr + length) is, or
// -1 for host memory (pageable or pinned), which is every buffer of a
// process that has loaded no CUDA driver (CudaDriver::IfLoaded): nothing
// is loaded or initialised here. InvalidArgument if the range starts in a
// GPU allocation and runs past its end. Thread-safe.
absl::StatusOr<int> GpuOfRange(uintptr_t addr, size_t length);

// A registration's location for a buffer on GPU `gpu` (-1: host memory):
// "*" and "" become "cuda:<gpu>" for GPU memory (Mooncake's automatic
// location); a location naming another GPU, or the CPU, for GPU memory is
// InvalidArgument. Host memory keeps the location given.
absl::StatusOr<std::string> ResolveLocation(const std::string& location,
                                            int gpu);

}  // namespace ferry::gpu

#endif  // FERRY_GPU_GPU_MEMORY_H_
