// LocalMr: the RDMA transport's handle of one registered local buffer (the
// MemoryHandle slices carry): its MR on every NIC and each NIC's topology
// tier for the buffer's location, resolved once at registration so the
// data path does no lookup. Immutable while registered.
#ifndef FERRY_TRANSPORT_RDMA_LOCAL_MR_H_
#define FERRY_TRANSPORT_RDMA_LOCAL_MR_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ferry::rdma {

struct LocalMr {
  uintptr_t addr = 0;
  size_t length = 0;
  std::vector<ibv_mr*> mrs;     // One per NIC, in the transport's NIC order.
  std::vector<uint32_t> lkeys;  // mrs[i]->lkey.
  std::vector<int> tiers;       // Topology tier of each NIC; 0 is nearest.
  // GPU memory (registered through a dma-buf or nvidia-peermem): the CPU
  // must never read it, so WRITEs from it are never posted inline.
  bool gpu = false;
  // GPU memory no NIC could register (no GPUDirect): no MRs; this engine's
  // slices of it go through the transport's staging (gpu_staging.h).
  bool staged = false;
  int device = -1;  // GPU memory's device.
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_LOCAL_MR_H_
