#include "gpu/gpu_memory.h"

#include "absl/strings/str_cat.h"
#include "gpu/cuda_driver.h"

namespace ferry::gpu {

absl::StatusOr<int> GpuOfRange(uintptr_t addr, size_t length) {
  const CudaDriver* driver = CudaDriver::IfLoaded();
  if (driver == nullptr) return -1;
  auto info = driver->Classify(reinterpret_cast<const void*>(addr));
  if (!info.ok()) return info.status();
  if (info->kind == PointerInfo::Kind::kHost ||
      info->kind == PointerInfo::Kind::kPinnedHost) {
    return -1;
  }
  const uint64_t end = info->range_start + info->range_size;
  if (length > end - addr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buffer [0x", absl::Hex(addr), ", +", length, ") starts in GPU ",
        info->device, "'s allocation [0x", absl::Hex(info->range_start), ", +",
        info->range_size, ") and runs past its end"));
  }
  return info->device;
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
