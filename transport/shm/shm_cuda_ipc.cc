// The shm transport's GPU path: a target publishes the driver's IPC handle
// of each GPU buffer's allocation; a same-host initiator opens it once per
// buffer and copies with the GPU (host to device, device to host, device
// to device) on a stream of its copy thread, waiting for the copy before
// it leaves the lane, so the withdrawal protocol of shm_table.h covers GPU
// memory as it covers host memory.
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "gpu/cuda_driver.h"
#include "transport/shm/shm_peer.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {
namespace {

// The device to copy with: the local buffer's GPU, else the one the target
// buffer's location names (the same ordinals on one host), else GPU 0.
int CopyDevice(const Slice& s, const gpu::CudaDriver& driver) {
  if (const int d = GpuStaging::DeviceOf(s.local_handle); d >= 0) return d;
  absl::string_view loc = s.target->buffer(s.remote_buffer).location();
  int d = 0;
  if (absl::ConsumePrefix(&loc, "cuda:") && absl::SimpleAtoi(loc, &d) &&
      d >= 0 && d < driver.device_count()) {
    return d;
  }
  return 0;
}

}  // namespace

absl::Status ShmTransport::PublishIpc(const MemoryRegion& region,
                                      descriptor::Buffer* published) {
  // The engine classified the region as GPU memory: a driver is loaded.
  const gpu::CudaDriver* driver = gpu::CudaDriver::IfLoaded();
  if (driver == nullptr) {
    return absl::FailedPreconditionError("no CUDA driver is loaded");
  }
  FERRY_RETURN_IF_ERROR(driver->UseDevice(region.cuda_device));
  const auto& api = driver->api();
  CUipcMemHandle handle;
  FERRY_RETURN_IF_ERROR(driver->Check(
      api.cuIpcGetMemHandle(&handle, region.addr), "cuIpcGetMemHandle"));
  CUdeviceptr base = 0;
  size_t size = 0;
  FERRY_RETURN_IF_ERROR(
      driver->Check(api.cuMemGetAddressRange(&base, &size, region.addr),
                    "cuMemGetAddressRange"));
  published->mutable_cuda_ipc()->set_handle(handle.reserved,
                                            sizeof(handle.reserved));
  published->mutable_cuda_ipc()->set_base(base);
  return absl::OkStatus();
}

void ShmTransport::CopyRunGpu(Peer& peer, uint32_t lane, int worker,
                              absl::Span<Slice* const> slices) {
  absl::StatusOr<const gpu::CudaDriver*> driver = gpu::CudaDriver::Get();
  if (!driver.ok()) {
    FailAll(slices, absl::FailedPreconditionError(absl::StrCat(
                        "shm: the target buffer is GPU memory, and this "
                        "process has no CUDA driver: ",
                        driver.status().message())));
    return;
  }
  const gpu::CudaDriver& d = **driver;
  const auto& api = d.api();
  if (peer.gone.load(std::memory_order_relaxed) || peer.Exited()) {
    peer.gone.store(true, std::memory_order_relaxed);
    FailAll(slices, absl::UnavailableError(
                        absl::StrCat("shm: the process of segment '", peer.name,
                                     "' (pid ", peer.pid, ") exited")));
    return;
  }
  std::vector<absl::Status> status(slices.size());
  std::vector<CUstream>& streams = streams_[worker];
  if (streams.empty()) streams.assign(d.device_count(), nullptr);
  std::vector<int> used;  // Devices whose stream has copies to wait for.
  const absl::Time now = clock_->Now();
  peer.table->Enter(lane);
  for (size_t k = 0; k < slices.size(); ++k) {
    Slice* s = slices[k];
    const descriptor::Buffer& b = s->target->buffer(s->remote_buffer);
    if (now >= s->deadline) {
      status[k] = absl::DeadlineExceededError(
          "shm: the slice's deadline passed before its copy");
      continue;
    }
    if (!peer.table->Live(b.shm_key())) {
      status[k] = absl::FailedPreconditionError(absl::StrCat(
          "shm: GPU buffer 0x", absl::Hex(b.addr()), " of segment '",
          s->target->name(),
          "' was unregistered (the descriptor is stale); nothing copied"));
      MutexLock lock(&peer.ipc_mu);
      if (auto it = peer.opened.find(b.shm_key()); it != peer.opened.end()) {
        // Withdrawn for good (keys are not reused): let the mapping go.
        d.Check(api.cuIpcCloseMemHandle(it->second), "cuIpcCloseMemHandle")
            .IgnoreError();
        peer.opened.erase(it);
      }
      continue;
    }
    const int device = CopyDevice(*s, d);
    if (absl::Status u = d.UseDevice(device); !u.ok()) {
      status[k] = u;
      continue;
    }
    // Where the target's byte s->remote is in this process.
    CUdeviceptr remote = s->remote;
    if (!peer.same_process) {
      MutexLock lock(&peer.ipc_mu);
      auto it = peer.opened.find(b.shm_key());
      if (it == peer.opened.end()) {
        CUipcMemHandle h;
        std::memcpy(h.reserved, b.cuda_ipc().handle().data(),
                    sizeof(h.reserved));
        CUdeviceptr base = 0;
        if (absl::Status o =
                d.Check(api.cuIpcOpenMemHandle(
                            &base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                        "cuIpcOpenMemHandle");
            !o.ok()) {
          status[k] = absl::Status(
              o.code(), absl::StrCat("shm: opening GPU buffer 0x",
                                     absl::Hex(b.addr()), " of segment '",
                                     s->target->name(), "': ", o.message()));
          continue;
        }
        it = peer.opened.emplace(b.shm_key(), base).first;
      }
      remote = it->second + (s->remote - b.cuda_ipc().base());
    }
    CUstream& stream = streams[device];
    if (stream == nullptr) {
      if (absl::Status c =
              d.Check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING),
                      "cuStreamCreate");
          !c.ok()) {
        stream = nullptr;
        status[k] = c;
        continue;
      }
    }
    const CUdeviceptr local = reinterpret_cast<CUdeviceptr>(s->local);
    const bool local_gpu = GpuStaging::DeviceOf(s->local_handle) >= 0;
    CUresult r;
    if (s->op == OpCode::kWrite) {
      r = local_gpu
              ? api.cuMemcpyDtoDAsync(remote, local, s->length, stream)
              : api.cuMemcpyHtoDAsync(remote, s->local, s->length, stream);
    } else {
      r = local_gpu
              ? api.cuMemcpyDtoDAsync(local, remote, s->length, stream)
              : api.cuMemcpyDtoHAsync(s->local, remote, s->length, stream);
    }
    status[k] = d.Check(r, "shm GPU copy");
    if (status[k].ok() &&
        std::find(used.begin(), used.end(), device) == used.end()) {
      used.push_back(device);
    }
  }
  // Every copy done before the lane is left: then an unregistration that
  // waited for the lane has nothing in flight on its buffer.
  for (int device : used) {
    absl::Status w = d.UseDevice(device);
    if (w.ok()) {
      w = d.Check(api.cuStreamSynchronize(streams[device]),
                  "cuStreamSynchronize");
    }
    if (!w.ok()) {
      for (size_t k = 0; k < slices.size(); ++k) {
        if (status[k].ok() && CopyDevice(*slices[k], d) == device) {
          status[k] = w;
        }
      }
    }
  }
  peer.table->Exit(lane);
  Complete(slices, status);
}

void ShmTransport::CloseLater(
    const absl::flat_hash_map<uint64_t, CUdeviceptr>& opened) {
  MutexLock lock(&queue_mu_);
  for (const auto& [key, dptr] : opened) to_close_.push_back(dptr);
  queue_cv_.SignalAll();
}

void ShmTransport::CloseIpc(const std::vector<CUdeviceptr>& dptrs) {
  if (dptrs.empty()) return;
  const gpu::CudaDriver* driver = gpu::CudaDriver::IfLoaded();
  if (driver == nullptr) return;  // Nothing was opened without one.
  for (CUdeviceptr p : dptrs) {
    absl::Status s = driver->Check(driver->api().cuIpcCloseMemHandle(p),
                                   "cuIpcCloseMemHandle");
    if (!s.ok()) FERRY_LOG(kWarn, "shm", s.message());
  }
}

void ShmTransport::DestroyStreams() {
  const gpu::CudaDriver* driver = gpu::CudaDriver::IfLoaded();
  for (std::vector<CUstream>& row : streams_) {
    for (size_t device = 0; device < row.size(); ++device) {
      if (row[device] == nullptr || driver == nullptr) continue;
      if (driver->UseDevice(static_cast<int>(device)).ok()) {
        driver->api().cuStreamDestroy(row[device]);
      }
      row[device] = nullptr;
    }
  }
}

}  // namespace ferry::shm
