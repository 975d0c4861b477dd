#include "transport/rdma/mr_table.h"

#include <errno.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/rdma/gpu_mr.h"

namespace ferry::rdma {

MrTable::MrTable(const std::vector<std::unique_ptr<Nic>>& nics,
                 const Topology& topology, const RdmaOptions& options,
                 PrepareStaging prepare_staging)
    : nics_(nics),
      topology_(topology),
      options_(options),
      prepare_staging_(std::move(prepare_staging)) {}

void MrTable::LogGpuPreference(const MemoryRegion& region) {
  if (region.cuda_device < 0 || region.cuda_device >= 64) return;
  {
    MutexLock lock(&gpu_logged_mu_);
    const uint64_t bit = uint64_t{1} << region.cuda_device;
    if ((gpu_logged_ & bit) != 0) return;
    gpu_logged_ |= bit;
  }
  std::vector<std::string> names;
  for (const auto& nic : nics_) names.push_back(nic->name());
  FERRY_LOG(kInfo, "rdma", "GPU memory on ", region.location, " goes through ",
            topology_.Describe(region.location, names),
            options_.topology_json.empty()
                ? " (tier 2, another NUMA node: only when no nearer NIC is "
                  "up)"
                : " (the priority matrix given)");
}

absl::StatusOr<MemoryHandle> MrTable::Register(const MemoryRegion& region,
                                               descriptor::Buffer* published) {
  int access = IBV_ACCESS_LOCAL_WRITE;
  if (region.remote_accessible) {
    access |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  }
  LogGpuPreference(region);
  auto entry = std::make_unique<LocalMr>();
  entry->addr = region.addr;
  entry->length = region.length;
  entry->gpu = region.cuda_device >= 0;
  // Tiers are resolved once here, not per slice on the data path. Host
  // memory spills to farther NICs when the near ones are loaded (the
  // router weighs each tier as a few slices of queue). GPU memory does
  // not go through a NIC beyond its NUMA node (tier 2) unless none nearer
  // is up: GPUDirect across the CPU interconnect runs at a fraction of
  // the NIC's rate, when the platform allows it at all.
  // A priority matrix the user gave is taken as it is.
  constexpr int kFailoverOnlyTier = 1 << 16;
  const bool from_sysfs = options_.topology_json.empty();
  for (size_t i = 0; i < nics_.size(); ++i) {
    const int tier = topology_.Tier(region.location, i);
    entry->tiers.push_back(
        entry->gpu && from_sysfs && tier >= 2 ? kFailoverOnlyTier : tier);
  }
  // Registration pins and maps pages: for large buffers do the NICs in
  // parallel, as their page-table builds are independent.
  entry->mrs.assign(nics_.size(), nullptr);
  std::vector<int> errors(nics_.size(), 0);
  // GPU memory: a dma-buf of it, which each NIC registers (GPUDirect RDMA).
  auto dmabuf = region.cuda_device >= 0 ? GpuDmabuf(region)
                                        : absl::StatusOr<GpuDmabufRange>();
  if (region.cuda_device >= 0 && !dmabuf.ok()) {
    // No driver, or SYNC_MEMOPS refused: nothing staging could fix.
    return dmabuf.status();
  }
  auto reg = [&](size_t i) {
    // A dead device (IBV_EVENT_DEVICE_FATAL) registers nothing: the buffer
    // is used, and published, on the others.
    if (nics_[i]->fatal()) return;
    entry->mrs[i] = RegisterRegion(
        nics_[i]->pd(), region,
        region.cuda_device >= 0 ? *dmabuf : GpuDmabufRange{}, access);
    if (entry->mrs[i] == nullptr) errors[i] = errno;
  };
  if (region.length >= (1u << 30) && nics_.size() > 1) {
    // Pinning a large region takes a while per NIC: in parallel. A NIC
    // whose thread cannot start (a pids limit) is registered here, in
    // turn, instead of aborting the process.
    std::vector<std::thread> threads;
    size_t i = 0;
    try {
      for (; i < nics_.size(); ++i) threads.emplace_back(reg, i);
    } catch (const std::system_error&) {
      for (; i < nics_.size(); ++i) reg(i);
    }
    for (auto& t : threads) t.join();
  } else {
    for (size_t i = 0; i < nics_.size(); ++i) reg(i);
  }
  // The NICs hold the dma-buf now (an MR is an attachment of it).
  if (region.cuda_device >= 0 && dmabuf->fd >= 0) close(dmabuf->fd);
  for (size_t i = 0; i < nics_.size(); ++i) {
    if (entry->mrs[i] == nullptr && !nics_[i]->fatal()) {
      for (ibv_mr* mr : entry->mrs) {
        if (mr != nullptr) ibv_dereg_mr(mr);
      }
      if (region.cuda_device >= 0) {
        return RegisterStaged(
            region, std::move(entry->tiers),
            GpuRegistrationError(region, *dmabuf, nics_[i]->name(), errors[i]));
      }
      const std::string what =
          absl::StrCat("ibv_reg_mr of ", region.length, " bytes at 0x",
                       absl::Hex(region.addr), " on ", nics_[i]->name(), ": ",
                       std::strerror(errors[i]));
      if (errors[i] == EFAULT) {
        // Not memory a NIC can pin: a hole, inaccessible memory (a GPU
        // address with no GPU registration path), or read-only memory.
        return absl::InvalidArgumentError(
            absl::StrCat(what, " (the range is not all mapped",
                         region.remote_accessible ? " read-write" : " readable",
                         " memory)"));
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          what, errors[i] == ENOMEM ? MemlockAdvice(nics_.size()) : ""));
    }
    entry->lkeys.push_back(entry->mrs[i] != nullptr ? entry->mrs[i]->lkey : 0);
  }
  if (region.remote_accessible) {
    for (size_t i = 0; i < nics_.size(); ++i) {
      if (entry->mrs[i] == nullptr) continue;
      descriptor::NicKey* k = published->add_keys();
      k->set_nic(nics_[i]->name());
      k->set_rkey(entry->mrs[i]->rkey);
    }
  }
  const LocalMr* handle = entry.get();
  MutexLock lock(&mu_);
  if (mrs_.count(region.addr) != 0) {
    // Registered twice (the engine checks its own registry first; this
    // catches a caller that did not): replacing the entry would leave the
    // first one's MRs registered and unfindable.
    for (ibv_mr* mr : entry->mrs) {
      if (mr != nullptr) ibv_dereg_mr(mr);
    }
    return absl::AlreadyExistsError(absl::StrCat(
        "memory at 0x", absl::Hex(region.addr), " is registered already"));
  }
  mrs_[region.addr] = std::move(entry);
  return handle;
}

absl::StatusOr<MemoryHandle> MrTable::RegisterStaged(const MemoryRegion& region,
                                                     std::vector<int> tiers,
                                                     const absl::Status& why) {
  if (!options_.gpu_staging) {
    return absl::Status(
        why.code(),
        absl::StrCat(why.message(),
                     " (rdma.gpu_staging is off, so it is not staged through "
                     "host memory instead)"));
  }
  if (absl::Status s = prepare_staging_(region.cuda_device); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(why.message(),
                                               "; staging it through host "
                                               "memory instead failed too: ",
                                               s.message()));
  }
  FERRY_LOG_EVERY(kWarn, "rdma", absl::Seconds(10), "GPU memory at 0x",
                  absl::Hex(region.addr), "+", region.length, " on ",
                  region.location,
                  " is staged through pinned host memory (slower, and "
                  "peers cannot reach it over RDMA), since GPUDirect RDMA "
                  "is not available: ",
                  why.message());
  auto entry = std::make_unique<LocalMr>();
  entry->addr = region.addr;
  entry->length = region.length;
  entry->gpu = true;
  entry->staged = true;
  entry->device = region.cuda_device;
  entry->tiers = std::move(tiers);
  const LocalMr* handle = entry.get();
  MutexLock lock(&mu_);
  if (mrs_.count(region.addr) != 0) {  // As Register: never replaced.
    return absl::AlreadyExistsError(absl::StrCat(
        "memory at 0x", absl::Hex(region.addr), " is registered already"));
  }
  mrs_[region.addr] = std::move(entry);
  staged_.fetch_add(1, std::memory_order_relaxed);
  return handle;
}

absl::Status MrTable::Unregister(uintptr_t addr) {
  std::unique_ptr<LocalMr> entry;
  {
    MutexLock lock(&mu_);
    auto it = mrs_.find(addr);
    if (it == mrs_.end()) {
      return absl::NotFoundError("buffer not registered with RDMA");
    }
    entry = std::move(it->second);
    mrs_.erase(it);
    if (entry->staged) {
      staged_.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  // The engine no longer uses the buffer (its leases are gone); a peer
  // still accessing it gets a remote access error, never stale memory:
  // ibv_dereg_mr waits for accesses in progress.
  for (ibv_mr* mr : entry->mrs) {
    if (mr != nullptr) ibv_dereg_mr(mr);
  }
  return absl::OkStatus();
}

void MrTable::DeregisterAll() {
  MutexLock lock(&mu_);
  for (auto& [addr, entry] : mrs_) {
    for (ibv_mr* mr : entry->mrs) {
      if (mr != nullptr) ibv_dereg_mr(mr);
    }
  }
  mrs_.clear();
}

}  // namespace ferry::rdma
