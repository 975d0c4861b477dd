// The doctor's GPU checks: the CUDA driver and its GPUs, whether the RDMA
// transport can register their memory (dma-buf or nvidia-peermem, then a
// registration tried on each NIC), and which NICs sit near each GPU, as a
// matrix like `nvidia-smi topo -m`.
#ifndef FERRY_TOOLS_DOCTOR_GPU_H_
#define FERRY_TOOLS_DOCTOR_GPU_H_

#include <string>
#include <vector>

#include "tools/doctor_probe.h"

namespace ferry::doctor {

// The PCI address of each CUDA ordinal, from the driver (loading it);
// empty where there is none.
std::vector<std::string> GpuBusIds();

// Appends the GPU checks. `nics`: the usable NICs (for the affinity
// matrix); `sysfs`: the sysfs root ("/sys").
void CheckGpus(const std::vector<std::string>& nics, const std::string& sysfs,
               std::vector<Check>* out);

}  // namespace ferry::doctor

#endif  // FERRY_TOOLS_DOCTOR_GPU_H_
