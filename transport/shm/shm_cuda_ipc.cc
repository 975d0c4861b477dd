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
  published->mutable_cuda_ipc()->set_size(size);
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
    // Its memory stays alive while mapped here: let it go now.
    std::vector<OpenedGpuMemory> closing;
    {
      MutexLock lock(&peer.ipc_mu);
      for (auto it = peer.opened.begin(); it != peer.opened.end();) {
        it->second.withdrawn = true;
        if (it->second.users == 0) {
          closing.push_back(it->second);
          peer.opened.erase(it++);
        } else {
          ++it;
        }
      }
    }
    CloseIpc(closing);
    FailAll(slices, absl::UnavailableError(
                        absl::StrCat("shm: the process of segment '", peer.name,
                                     "' (pid ", peer.pid, ") exited")));
    return;
  }
  std::vector<absl::Status> status(slices.size());
  std::vector<CUstream>& streams = streams_[worker];
  if (streams.empty()) streams.assign(d.device_count(), nullptr);
  std::vector<int> used;       // Devices whose stream has copies to wait for.
  std::vector<uint64_t> held;  // Mappings this run uses (a user each).
  std::vector<OpenedGpuMemory> closing;
  {
    // Withdrawn buffers' mappings go (their memory is the target's to free;
    // a mapping keeps it alive), once no copy thread uses them.
    MutexLock lock(&peer.ipc_mu);
    for (auto it = peer.opened.begin(); it != peer.opened.end();) {
      if (!it->second.withdrawn && !peer.table->Live(it->first)) {
        it->second.withdrawn = true;
      }
      if (it->second.withdrawn && it->second.users == 0) {
        closing.push_back(it->second);
        peer.opened.erase(it++);
      } else {
        ++it;
      }
    }
  }
  CloseIpc(closing);
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
        OpenedGpuMemory o;
        o.device = device;
        CUipcMemHandle h;
        std::memcpy(h.reserved, b.cuda_ipc().handle().data(),
                    sizeof(h.reserved));
        absl::Status opened =
            d.Check(api.cuIpcOpenMemHandle(&o.ptr, h,
                                           CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle");
        CUdeviceptr start = 0;
        if (opened.ok()) {
          // The allocation's size, as this process's driver maps it: what
          // bounds every copy into it, whatever the descriptor says.
          opened = d.Check(api.cuMemGetAddressRange(&start, &o.size, o.ptr),
                           "cuMemGetAddressRange");
          if (!opened.ok()) {
            d.api().cuIpcCloseMemHandle(o.ptr);
          }
        }
        if (!opened.ok()) {
          status[k] = absl::Status(
              opened.code(),
              absl::StrCat("shm: opening GPU buffer 0x", absl::Hex(b.addr()),
                           " of segment '", s->target->name(),
                           "': ", opened.message()));
          continue;
        }
        it = peer.opened.emplace(b.shm_key(), o).first;
      }
      const uint64_t base = b.cuda_ipc().base();
      if (s->remote < base || s->remote - base > it->second.size ||
          s->length > it->second.size - (s->remote - base)) {
        status[k] = absl::FailedPreconditionError(
            absl::StrCat("shm: 0x", absl::Hex(s->remote), "+", s->length,
                         " of segment '", s->target->name(),
                         "' lies outside the GPU allocation its "
                         "descriptor names (base 0x",
                         absl::Hex(base), ", ", it->second.size,
                         " bytes opened); nothing copied"));
        continue;
      }
      remote = it->second.ptr + (s->remote - base);
      ++it->second.users;
      held.push_back(b.shm_key());
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
  // waited for the lane has nothing in flight on its buffer. A failed
  // synchronisation reports the stream's copies failed: they have ended.
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
  if (!held.empty()) {
    closing.clear();
    MutexLock lock(&peer.ipc_mu);
    for (uint64_t key : held) {
      auto it = peer.opened.find(key);
      if (it == peer.opened.end()) continue;
      if (--it->second.users == 0 && it->second.withdrawn) {
        closing.push_back(it->second);
        peer.opened.erase(it);
      }
    }
  }
  CloseIpc(closing);
  Complete(slices, status);
}

void ShmTransport::CloseLater(
    const absl::flat_hash_map<uint64_t, OpenedGpuMemory>& opened) {
  MutexLock lock(&queue_mu_);
  for (const auto& [key, o] : opened) to_close_.push_back(o);
  queue_cv_.SignalAll();
}

void ShmTransport::CloseIpc(const std::vector<OpenedGpuMemory>& mappings) {
  if (mappings.empty()) return;
  const gpu::CudaDriver* driver = gpu::CudaDriver::IfLoaded();
  if (driver == nullptr) return;  // Nothing was opened without one.
  for (const OpenedGpuMemory& o : mappings) {
    // In the context that opened it.
    absl::Status s = driver->UseDevice(o.device);
    if (s.ok()) {
      s = driver->Check(driver->api().cuIpcCloseMemHandle(o.ptr),
                        "cuIpcCloseMemHandle");
    }
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
