// Topology: which NICs each memory location should prefer.
//
// Given as Mooncake TE's priority matrix, JSON mapping a location to tiers
// of NIC names, best first: {"cpu:0": [["mlx5_0"], ["mlx5_1"]],
// "cuda:0": [["mlx5_1"], ["mlx5_0"]]}. Without one, it is read from sysfs:
//   - "cpu:N": a NIC whose device/numa_node is N is tier 0, others tier 1;
//   - "cuda:N": the NICs nearest to GPU N in the PCI tree (fewest hops
//     through bridges and switches) are tier 0, other NICs on the GPU's
//     NUMA node (or where either node is unknown) tier 1, NICs on another
//     node tier 2. GPU N is the one at the PCI
//     address the CUDA driver gives for ordinal N, when the caller passes
//     them (the driver's order is its own: fastest first unless
//     CUDA_DEVICE_ORDER=PCI_BUS_ID); else the N-th NVIDIA GPU in PCI bus
//     order.
// Location "*" (or one not listed) prefers no NIC. Immutable after
// construction; thread-safe.
#ifndef FERRY_TRANSPORT_RDMA_TOPOLOGY_H_
#define FERRY_TRANSPORT_RDMA_TOPOLOGY_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::rdma {

class Topology {
 public:
  // Parses a priority matrix. InvalidArgument for malformed JSON, a
  // location that is not an array of arrays of strings, or a NIC name not
  // in `nics`.
  static absl::StatusOr<Topology> FromJson(
      const std::string& json, const std::vector<std::string>& nics);
  // Builds the matrix from `numa_node` of each NIC (-1: unknown).
  static Topology FromNumaNodes(const std::vector<std::string>& nics,
                                const std::vector<int>& numa_nodes);
  // Reads NUMA nodes and GPU placement from the sysfs tree at `root`
  // ("/sys"; tests pass a fake tree). NICs without a sysfs entry (soft
  // devices) have no NUMA node and no PCI position. `gpu_bus_ids`: the PCI
  // address ("dddd:bb:dd.f") of each CUDA ordinal, from the driver; empty:
  // PCI bus order. An ordinal whose address sysfs lacks gets no entry.
  static Topology FromSysfs(const std::string& root,
                            const std::vector<std::string>& nics,
                            const std::vector<std::string>& gpu_bus_ids = {});

  // Tier of NIC `nic` (index into the constructor's list) for memory at
  // `location`: 0 is best. Unlisted NICs rank after every listed tier.
  int Tier(const std::string& location, size_t nic) const;

  // The NICs `location` prefers, for logs: "mlx5_1 (tier 0), mlx5_0
  // (tier 2)"; "every NIC alike" where it has no entry.
  std::string Describe(const std::string& location,
                       const std::vector<std::string>& nics) const;

  // The matrix in Mooncake TE's JSON form, locations sorted (for logs,
  // tests and the docs).
  std::string ToJson(const std::vector<std::string>& nics) const;

 private:
  // location -> tier per NIC index.
  std::map<std::string, std::vector<int>> tiers_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_TOPOLOGY_H_
