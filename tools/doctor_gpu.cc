#include "tools/doctor_gpu.h"

#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ferry/options.h"
#include "gpu/cuda_driver.h"
#include "transport/memory_registry.h"
#include "transport/rdma/gpu_mr.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/topology.h"

namespace ferry::doctor {
namespace {

// Linux's version as major * 100 + minor (5.12 -> 512); 0 if unknown.
int KernelVersion() {
  utsname u{};
  if (uname(&u) != 0) return 0;
  int major = 0, minor = 0;
  if (std::sscanf(u.release, "%d.%d", &major, &minor) != 2) return 0;
  return major * 100 + minor;
}

// nvidia-smi's words for a GPU-NIC pair, from the topology's tiers.
const char* Affinity(int tier) {
  switch (tier) {
    case 0:
      return "NEAR";  // The nearest NICs in the PCI tree.
    case 1:
      return "NODE";  // Same NUMA node, farther in the tree.
    default:
      return "SYS";  // Across the CPU interconnect.
  }
}

// Registers a buffer of each GPU on each NIC the way the rdma transport
// does (a dma-buf, else the device address for nvidia-peermem). The
// driver's and the kernel's capabilities do not settle it: the NIC's
// driver must import the dma-buf too, and an emulated NIC (softrnic)
// cannot reach a real GPU's memory at all.
Check ProbeGpuRegistration(const gpu::CudaDriver& d,
                           const std::vector<std::string>& nics) {
  constexpr size_t kProbeBytes = 2 << 20;
  const char* kWhat = "GPU memory on the NICs";
  auto devices = rdma::ListDevices(nics);
  if (!devices.ok()) {
    return {kWhat, Level::kWarn, std::string(devices.status().message()), ""};
  }
  std::vector<std::unique_ptr<rdma::Nic>> open;
  for (ibv_device* dev : *devices) {
    auto nic = rdma::Nic::Open(dev, rdma::EffectiveGidIndex(RdmaOptions()));
    if (nic.ok()) open.push_back(*std::move(nic));
  }
  std::vector<std::string> cells;
  std::string first_error;
  for (int g = 0; g < d.device_count(); ++g) {
    CUdeviceptr ptr = 0;
    if (absl::Status s = d.UseDevice(g); !s.ok()) {
      cells.push_back(absl::StrCat("cuda:", g, ": ", s.message()));
      continue;
    }
    if (absl::Status s =
            d.Check(d.api().cuMemAlloc(&ptr, kProbeBytes), "cuMemAlloc");
        !s.ok()) {
      cells.push_back(absl::StrCat("cuda:", g, ": ", s.message()));
      continue;
    }
    MemoryRegion region;
    region.addr = ptr;
    region.length = kProbeBytes;
    region.location = absl::StrCat("cuda:", g);
    region.remote_accessible = true;
    region.cuda_device = g;
    absl::StatusOr<rdma::GpuDmabufRange> dmabuf = rdma::GpuDmabuf(region);
    for (const auto& nic : open) {
      std::string cell = absl::StrCat("cuda:", g, " on ", nic->name(), ": ");
      if (!dmabuf.ok()) {
        cells.push_back(absl::StrCat(cell, dmabuf.status().message()));
        if (first_error.empty()) {
          first_error = std::string(dmabuf.status().message());
        }
        continue;
      }
      const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                         IBV_ACCESS_REMOTE_READ;
      ibv_mr* mr = rdma::RegisterRegion(nic->pd(), region, *dmabuf, access);
      const int err = errno;
      if (mr != nullptr) {
        ibv_dereg_mr(mr);
        cells.push_back(
            absl::StrCat(cell, dmabuf->fd >= 0 ? "dma-buf" : "nvidia-peermem"));
        continue;
      }
      cells.push_back(absl::StrCat(cell, "refused (", std::strerror(err), ")"));
      if (first_error.empty()) {
        first_error = std::string(
            rdma::GpuRegistrationError(region, *dmabuf, nic->name(), err)
                .message());
      }
    }
    if (dmabuf.ok() && dmabuf->fd >= 0) close(dmabuf->fd);
    d.api().cuMemFree(ptr);
  }
  if (open.empty()) {
    return {kWhat, Level::kWarn, "no NIC could be opened to try", ""};
  }
  if (first_error.empty()) {
    return {kWhat, Level::kOk,
            absl::StrCat(absl::StrJoin(cells, "; "),
                         ": peers READ and WRITE it over RDMA"),
            ""};
  }
  return {kWhat, Level::kWarn,
          absl::StrCat(absl::StrJoin(cells, "; "), ". ", first_error),
          "the rdma transport stages such memory through host memory for "
          "this engine's own transfers, and peers reach it only over TCP: "
          "run tcp beside rdma on both engines (transports rdma,tcp) or "
          "make GPUDirect RDMA work (see the detail)"};
}

}  // namespace

std::vector<std::string> GpuBusIds() {
  std::vector<std::string> ids;
  absl::StatusOr<const gpu::CudaDriver*> d = gpu::CudaDriver::Get();
  if (!d.ok()) return ids;
  for (int g = 0; g < (*d)->device_count(); ++g) {
    absl::StatusOr<std::string> id = (*d)->PciBusId(g);
    ids.push_back(id.ok() ? *id : "");
  }
  return ids;
}

void CheckGpus(const std::vector<std::string>& nics, const std::string& sysfs,
               std::vector<Check>* out) {
  absl::StatusOr<const gpu::CudaDriver*> got = gpu::CudaDriver::Get();
  if (!got.ok()) {
    // Not a problem for host memory: say what the host lacks, no more.
    out->push_back(
        {"CUDA driver",
         got.status().code() == absl::StatusCode::kNotFound ? Level::kOk
                                                            : Level::kFail,
         absl::StrCat("none usable: ", got.status().message(),
                      "; Ferry moves host memory only"),
         got.status().code() == absl::StatusCode::kNotFound
             ? ""
             : "fix the driver (nvidia-smi must list the GPUs), or unset "
               "FERRY_CUDA_LIBRARY"});
    return;
  }
  const gpu::CudaDriver& d = **got;
  out->push_back({"CUDA driver", Level::kOk,
                  absl::StrCat(d.version() / 1000, ".", d.version() % 1000 / 10,
                               " (", d.library(), ")"),
                  ""});
  std::vector<std::string> gpus, bus_ids;
  bool any_dmabuf = false;
  for (int g = 0; g < d.device_count(); ++g) {
    absl::StatusOr<std::string> name = d.DeviceName(g);
    absl::StatusOr<std::string> bus = d.PciBusId(g);
    bus_ids.push_back(bus.ok() ? *bus : "");
    gpus.push_back(absl::StrCat("cuda:", g, " ", name.ok() ? *name : "?",
                                " at ", bus.ok() ? *bus : "?"));
    absl::StatusOr<bool> dmabuf = d.DmaBufSupported(g);
    any_dmabuf = any_dmabuf || (dmabuf.ok() && *dmabuf);
  }
  out->push_back({"GPUs", d.device_count() > 0 ? Level::kOk : Level::kWarn,
                  d.device_count() > 0 ? absl::StrJoin(gpus, "; ") : "none",
                  d.device_count() > 0
                      ? ""
                      : "the driver sees no GPU: check nvidia-smi and "
                        "CUDA_VISIBLE_DEVICES"});
  if (d.device_count() == 0) return;

  // GPUDirect RDMA: a dma-buf (driver and kernel) or nvidia-peermem.
  const int kernel = KernelVersion();
  const bool dmabuf_ok = any_dmabuf && kernel >= 512;
  const bool peermem =
      std::filesystem::exists(sysfs + "/module/nvidia_peermem");
  out->push_back(
      {"GPUDirect RDMA", dmabuf_ok || peermem ? Level::kOk : Level::kWarn,
       absl::StrCat(
           "dma-buf export: ",
           any_dmabuf ? "the driver has it" : "the driver lacks it",
           kernel >= 512 ? ""
                         : absl::StrCat(" (Linux ", kernel / 100, ".",
                                        kernel % 100, " is older than 5.12)"),
           "; nvidia-peermem: ", peermem ? "loaded" : "not loaded",
           dmabuf_ok || peermem
               ? "; the NICs can be asked to register GPU memory (the next "
                 "line says whether they do)"
               : "; the rdma transport cannot register GPU memory (the tcp "
                 "transport stages it through host memory)"),
       dmabuf_ok || peermem
           ? ""
           : "use NVIDIA's open kernel modules (driver 515 or later) on "
             "Linux 5.12 or later for dma-bufs, or load nvidia-peermem "
             "(modprobe nvidia-peermem)"});

  if (nics.empty()) return;
  out->push_back(ProbeGpuRegistration(d, nics));
  // The matrix: each GPU against each NIC, from the topology Ferry uses.
  const rdma::Topology topo = rdma::Topology::FromSysfs(sysfs, nics, bus_ids);
  std::vector<std::string> rows;
  bool all_far = false;
  for (int g = 0; g < d.device_count(); ++g) {
    const std::string loc = absl::StrCat("cuda:", g);
    std::vector<std::string> cells;
    bool near = false;
    for (size_t i = 0; i < nics.size(); ++i) {
      const int tier = topo.Tier(loc, i);
      near = near || tier < 2;
      cells.push_back(absl::StrCat(nics[i], " ", Affinity(tier)));
    }
    all_far = all_far || !near;
    rows.push_back(absl::StrCat(loc, ": ", absl::StrJoin(cells, ", ")));
  }
  out->push_back(
      {"GPU-NIC affinity", all_far ? Level::kWarn : Level::kOk,
       absl::StrCat(absl::StrJoin(rows, "; "),
                    " (NEAR: nearest in the PCI tree; NODE: same NUMA node; "
                    "SYS: across the CPU interconnect, used only when no "
                    "nearer NIC is up)"),
       all_far ? "a GPU has no NIC on its NUMA node: its GPUDirect traffic "
                 "crosses the CPU interconnect; put a NIC on its PCIe switch "
                 "or root complex, or give a priority matrix"
               : ""});
}

}  // namespace ferry::doctor
