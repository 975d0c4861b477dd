#include "transport/rdma/gpu_mr.h"

#include <errno.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu/cuda_driver.h"
#include "transport/rdma/verbs_compat.h"

namespace ferry::rdma {

absl::StatusOr<GpuDmabufRange> GpuDmabuf(const MemoryRegion& region) {
  auto driver = gpu::CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  FERRY_RETURN_IF_ERROR((*driver)->SetSyncMemops(region.addr));
  // A dma-buf covers whole pages; the MR starts at the buffer's offset in
  // them.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = region.addr & ~(page - 1);
  const uint64_t end = (region.addr + region.length + page - 1) & ~(page - 1);
  GpuDmabufRange range;
  auto fd = (*driver)->DmaBufFd(start, end - start);
  if (fd.ok()) {
    range.fd = *fd;
    range.offset = region.addr - start;
    return range;
  }
  if (fd.status().code() != absl::StatusCode::kUnimplemented) {
    return fd.status();
  }
  range.why_not = std::string(fd.status().message());
  return range;
}

ibv_mr* RegisterRegion(ibv_pd* pd, const MemoryRegion& region,
                       const GpuDmabufRange& dmabuf, int access) {
  if (region.cuda_device >= 0 && dmabuf.fd >= 0) {
    return RegDmabufMr(pd, dmabuf.offset, region.length, region.addr, dmabuf.fd,
                       access);
  }
  return ibv_reg_mr(pd, reinterpret_cast<void*>(region.addr), region.length,
                    access);
}

absl::Status GpuRegistrationError(const MemoryRegion& region,
                                  const GpuDmabufRange& dmabuf,
                                  absl::string_view nic, int err) {
  const std::string what = absl::StrCat(
      region.length, " bytes of GPU memory on cuda:", region.cuda_device,
      " at 0x", absl::Hex(region.addr));
  if (dmabuf.fd >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ibv_reg_dmabuf_mr of ", what, " on ", nic, ": ", std::strerror(err),
        err == EOPNOTSUPP ? " (this NIC's driver cannot import dma-bufs; "
                            "rdma-core 34 and Linux 5.12 or later have it)"
                          : ""));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot register ", what, " on ", nic, ": there is no dma-buf of it (",
      dmabuf.why_not, ") and ibv_reg_mr of the GPU address failed (",
      std::strerror(err),
      err == EFAULT ? "; the kernel cannot pin GPU memory without the "
                      "nvidia-peermem module: modprobe nvidia-peermem"
                    : "",
      ")"));
}

}  // namespace ferry::rdma
