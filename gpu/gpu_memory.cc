#include "gpu/gpu_memory.h"

#include "absl/strings/str_cat.h"
#include "gpu/cuda_driver.h"

namespace ferry::gpu {

absl::StatusOr<int> GpuOfRange(uintptr_t addr, size_t length) {
  auto a = GpuAllocationOf(addr, length);
  if (!a.ok()) return a.status();
  return a->device;
}

absl::StatusOr<GpuAllocation> GpuAllocationOf(uintptr_t addr, size_t length) {
  const CudaDriver* driver = CudaDriver::IfLoaded();
  if (driver == nullptr) return GpuAllocation{};
  auto info = driver->Classify(reinterpret_cast<const void*>(addr));
  if (!info.ok()) return info.status();
  if (info->kind == PointerInfo::Kind::kHost ||
      info->kind == PointerInfo::Kind::kPinnedHost) {
    return GpuAllocation{};
  }
  const uint64_t end = info->range_start + info->range_size;
  if (length > end - addr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buffer [0x", absl::Hex(addr), ", +", length, ") starts in GPU ",
        info->device, "'s allocation [0x", absl::Hex(info->range_start), ", +",
        info->range_size, ") and runs past its end"));
  }
  GpuAllocation a;
  a.device = info->device;
  a.start = info->range_start;
  a.size = info->range_size;
  a.buffer_id = info->buffer_id;
  return a;
}

absl::Status CheckGpuAllocation(uintptr_t addr, int device,
                                uint64_t buffer_id) {
  const CudaDriver* driver = CudaDriver::IfLoaded();
  // Registered GPU memory means the driver was loaded, and it stays so.
  if (driver == nullptr) {
    return absl::InternalError(
        absl::StrCat("0x", absl::Hex(addr),
                     " is in a buffer registered as GPU memory, but no CUDA "
                     "driver is loaded in this process"));
  }
  // The common case, the allocation still there, costs one attribute;
  // anything else goes through Classify, which also says what is there.
  CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_BUFFER_ID;
  unsigned long long id = 0;  // NOLINT: the ABI's type
  void* data = &id;
  if (driver->api().cuPointerGetAttributes(1, &attr, &data, addr) ==
          CUDA_SUCCESS &&
      id == buffer_id) {
    return absl::OkStatus();
  }
  auto info = driver->Classify(reinterpret_cast<const void*>(addr));
  if (!info.ok()) return info.status();
  if (info->buffer_id == buffer_id) return absl::OkStatus();
  const bool device_memory = info->kind == PointerInfo::Kind::kDevice ||
                             info->kind == PointerInfo::Kind::kManaged;
  return absl::FailedPreconditionError(absl::StrCat(
      "0x", absl::Hex(addr),
      " is in a buffer registered as GPU memory on cuda:", device,
      " (allocation ", buffer_id,
      "), which the application has freed since; the address ",
      device_memory ? absl::StrCat("now holds another allocation (",
                                   info->buffer_id, ") on cuda:", info->device)
                    : std::string("is no longer GPU memory"),
      ". Unregister GPU memory before freeing it, and register the new "
      "allocation"));
}

absl::StatusOr<std::string> ResolveLocation(const std::string& location,
                                            int gpu) {
  if (gpu < 0) return location;
  const std::string mine = absl::StrCat("cuda:", gpu);
  if (location.empty() || location == "*" || location == mine) return mine;
  return absl::InvalidArgumentError(
      absl::StrCat("location '", location,
                   "' does not hold this buffer: it is GPU memory "
                   "on ",
                   mine, " (give \"", mine, "\" or \"*\")"));
}

}  // namespace ferry::gpu
