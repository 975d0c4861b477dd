// GPU memory on the RDMA transport (GPUDirect RDMA): what a NIC registers
// for a buffer in device memory. The preferred path is a dma-buf of the
// buffer (ibv_reg_dmabuf_mr, NVIDIA's open kernel modules); without one,
// the GPU address itself (ibv_reg_mr, which needs nvidia-peermem).
#ifndef FERRY_TRANSPORT_RDMA_GPU_MR_H_
#define FERRY_TRANSPORT_RDMA_GPU_MR_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/memory_registry.h"

namespace ferry::rdma {

struct GpuDmabufRange {
  // A dma-buf covering the buffer's pages (the caller closes it once the
  // NICs registered it), or -1 where the driver cannot export one.
  int fd = -1;
  uint64_t offset = 0;  // The buffer's first byte within the dma-buf.
  std::string why_not;  // Why there is no dma-buf (fd == -1).
};

// For `region` (region.cuda_device >= 0): sets SYNC_MEMOPS on its
// allocation (a synchronous copy into it must be complete before a NIC
// reads it) and exports its pages as a dma-buf. An error only where the
// driver fails outright; a driver or kernel without dma-buf gives fd -1.
absl::StatusOr<GpuDmabufRange> GpuDmabuf(const MemoryRegion& region);

// Registers `region` on `pd` the way the RDMA transport does: through
// `dmabuf` where it has one (GPU memory, ibv_reg_dmabuf_mr), else at its
// address (host memory, or GPU memory through nvidia-peermem). The MR, or
// null with errno set. `dmabuf` is ignored for host memory.
ibv_mr* RegisterRegion(ibv_pd* pd, const MemoryRegion& region,
                       const GpuDmabufRange& dmabuf, int access);

// The error for a NIC that could not register GPU memory (`err` its
// errno), saying which path failed and what to do.
absl::Status GpuRegistrationError(const MemoryRegion& region,
                                  const GpuDmabufRange& dmabuf,
                                  absl::string_view nic, int err);

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_GPU_MR_H_
