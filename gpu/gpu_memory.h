// Which registered buffers are GPU memory: the check every registration
// makes, so that a transport never touches device memory with the CPU and
// a buffer's location names the GPU holding it (Mooncake's "cuda:N").
#ifndef FERRY_GPU_GPU_MEMORY_H_
#define FERRY_GPU_GPU_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry::gpu {

// The device ordinal of the GPU whose memory [addr, addr + length) is, or
// -1 for host memory (pageable or pinned), which is every buffer of a
// process that has loaded no CUDA driver (CudaDriver::IfLoaded): nothing
// is loaded or initialised here. InvalidArgument if the range starts in a
// GPU allocation and runs past its end. Thread-safe.
absl::StatusOr<int> GpuOfRange(uintptr_t addr, size_t length);

// The GPU allocation holding a range, as GpuAllocationOf reports it.
struct GpuAllocation {
  int device = -1;      // -1: host memory; the other fields are then zero.
  uintptr_t start = 0;  // The driver's allocation: [start, start + size).
  size_t size = 0;
  // The driver's id of that allocation, never reused in the process: a
  // registration remembers it, so that an allocation freed (and perhaps
  // another made at its address) under a registration is noticed.
  uint64_t buffer_id = 0;
};

// As GpuOfRange, with the allocation's bounds and id.
absl::StatusOr<GpuAllocation> GpuAllocationOf(uintptr_t addr, size_t length);

// OK if `addr` still lies in the GPU allocation `buffer_id` that a buffer
// registered on cuda:`device` was in. FailedPrecondition otherwise: the
// application freed that allocation while it was registered (the address
// may now be unmapped or hold another allocation), which no transfer may
// touch; the message says so from "0x<addr> is in" on, for the caller to
// prefix. One driver query, no context needed. Thread-safe.
absl::Status CheckGpuAllocation(uintptr_t addr, int device, uint64_t buffer_id);

// A registration's location for a buffer on GPU `gpu` (-1: host memory):
// "*" and "" become "cuda:<gpu>" for GPU memory (Mooncake's automatic
// location); a location naming another GPU, or the CPU, for GPU memory is
// InvalidArgument. Host memory keeps the location given.
absl::StatusOr<std::string> ResolveLocation(const std::string& location,
                                            int gpu);

}  // namespace ferry::gpu

#endif  // FERRY_GPU_GPU_MEMORY_H_
