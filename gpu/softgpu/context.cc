// Initialisation, devices, primary contexts and streams.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <utility>

#include "gpu/softgpu/softgpu.h"

namespace softgpu {
namespace {

std::atomic<Driver*> g_driver{nullptr};

// The calling thread's current context (cuCtxSetCurrent), as in CUDA.
// initial-exec: this library is dlopen'ed, and a general-dynamic variable
// would go through __tls_get_addr on every call; there ASan's DTLS
// bookkeeping (LLVM 14) guesses a block's bounds from the word before it
// when the block sits 16 bytes past a page boundary, and now and then
// read garbage bounds that crashed LeakSanitizer's scan at exit (about 1
// run in 25 of tests:gpu_affinity_test). Eight bytes fit glibc's static
// TLS surplus, which exists for dlopen'ed initial-exec variables.
__attribute__((tls_model("initial-exec"))) thread_local CUctx_st* t_current =
    nullptr;

// Stream handles count up from here in steps of 16, like pointers; 1 and 2
// are CUDA's CU_STREAM_LEGACY and CU_STREAM_PER_THREAD (kStreamLegacy,
// kStreamPerThread), which must not be
// mistaken for streams of ours.
constexpr uintptr_t kFirstStreamHandle = 0x5f000;
constexpr uintptr_t kStreamHandleStep = 16;

}  // namespace

CUresult Driver::Start() {
  Config config;
  std::string error;
  if (!LoadConfig(&config, &error)) {
    std::fprintf(stderr, "softgpu: cuInit: %s\n", error.c_str());
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (config.devices.empty()) return CUDA_ERROR_NO_DEVICE;
  // Never destroyed: its streams' threads and the caller's handles live
  // as long as the process.
  g_driver.store(new Driver(std::move(config)), std::memory_order_release);
  return CUDA_SUCCESS;
}

Driver* Driver::Get() { return g_driver.load(std::memory_order_acquire); }

CUresult Driver::Init(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  static std::once_flag once;
  static CUresult result = CUDA_ERROR_NOT_INITIALIZED;
  std::call_once(once, [] { result = Start(); });
  return result;
}

Driver::Driver(Config config)
    : config_(std::move(config)),
      page_size_(static_cast<size_t>(sysconf(_SC_PAGESIZE))),
      contexts_(new CUctx_st[config_.devices.size()]),
      legacy_stream_(Stream::Start(-1, config_.copy_delay_us)),
      retains_(config_.devices.size(), 0),
      used_bytes_(config_.devices.size(), 0),
      next_stream_handle_(kFirstStreamHandle) {
  for (int i = 0; i < device_count(); ++i) contexts_[i].device = i;
}

CUresult Driver::DeviceGetAttribute(int* value, CUdevice_attribute attribute,
                                    CUdevice dev) const {
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  const DeviceConfig& d = config_.devices[dev];
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
      *value = d.bus;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
      *value = d.device;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
      *value = d.domain;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED:
      *value = 1;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED:
      *value = config_.dmabuf ? 1 : 0;
      return CUDA_SUCCESS;
  }
  // Attributes outside gpu/cuda_abi.h: a caller that needs one must add it
  // to the contract first.
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult Driver::PrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  MutexLock lock(&mu_);
  ++retains_[dev];
  *ctx = &contexts_[dev];
  return CUDA_SUCCESS;
}

CUresult Driver::PrimaryCtxRelease(CUdevice dev) {
  if (!ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  // Freed after the lock is dropped: unmapping must not stall every other
  // call. The streams' queued work still runs, in the background, as
  // after cuStreamDestroy; it keeps the memory it uses mapped.
  std::vector<Entry> freed;
  std::vector<std::shared_ptr<Stream>> streams;
  {
    MutexLock lock(&mu_);
    if (retains_[dev] == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (--retains_[dev] > 0) return CUDA_SUCCESS;
    // The last reference: the context is reset, as CUDA resets it.
    for (auto* table : {&device_memory_, &host_memory_}) {
      for (auto it = table->begin(); it != table->end();) {
        if (it->second.allocation->device() != dev) {
          ++it;
          continue;
        }
        freed.push_back(std::move(it->second));
        it = table->erase(it);
      }
    }
    used_bytes_[dev] = 0;
    for (auto it = streams_.begin(); it != streams_.end();) {
      if (it->second->device() != dev) {
        ++it;
        continue;
      }
      streams.push_back(std::move(it->second));
      it = streams_.erase(it);
    }
  }
  for (const std::shared_ptr<Stream>& s : streams) s->Stop();
  return CUDA_SUCCESS;
}

CUresult Driver::CtxSetCurrent(CUcontext ctx) {
  if (ctx != nullptr) {
    bool ours = false;
    for (int i = 0; i < device_count(); ++i) ours |= ctx == &contexts_[i];
    if (!ours) return CUDA_ERROR_INVALID_CONTEXT;
  }
  t_current = ctx;
  return CUDA_SUCCESS;
}

CUresult Driver::CtxGetCurrent(CUcontext* ctx) {
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *ctx = t_current;
  return CUDA_SUCCESS;
}

CUresult Driver::CurrentDevice(int* dev) {
  // A context released to zero is reset and no longer usable, though a
  // thread may still have it current.
  if (t_current == nullptr || retains_[t_current->device] == 0) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  *dev = t_current->device;
  return CUDA_SUCCESS;
}

std::shared_ptr<Stream> Driver::FindStream(CUstream stream) {
  const uintptr_t handle = reinterpret_cast<uintptr_t>(stream);
  if (handle == 0 || handle == kStreamLegacy || handle == kStreamPerThread) {
    return legacy_stream_;
  }
  auto it = streams_.find(handle);
  return it == streams_.end() ? nullptr : it->second;
}

CUresult Driver::StreamCreate(CUstream* stream, unsigned int flags) {
  if (stream == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // CU_STREAM_DEFAULT and CU_STREAM_NON_BLOCKING behave alike: softgpu
  // does not make blocking streams wait for the legacy stream (nor it for
  // them), so a caller that relies on that implicit ordering instead of
  // synchronising sees its bug here rather than on some GPU.
  if ((flags & ~CU_STREAM_NON_BLOCKING) != 0) return CUDA_ERROR_INVALID_VALUE;
  MutexLock lock(&mu_);
  int dev = 0;
  if (CUresult r = CurrentDevice(&dev); r != CUDA_SUCCESS) return r;
  const uintptr_t handle = next_stream_handle_;
  next_stream_handle_ += kStreamHandleStep;
  streams_[handle] = Stream::Start(dev, config_.copy_delay_us);
  *stream = reinterpret_cast<CUstream>(handle);
  return CUDA_SUCCESS;
}

CUresult Driver::StreamDestroy(CUstream stream) {
  std::shared_ptr<Stream> s;
  {
    MutexLock lock(&mu_);
    // The legacy stream is the driver's, not the caller's to destroy,
    // under any of its handles (none is in streams_).
    auto it = streams_.find(reinterpret_cast<uintptr_t>(stream));
    if (stream == nullptr || it == streams_.end()) {
      return CUDA_ERROR_INVALID_HANDLE;
    }
    s = std::move(it->second);
    streams_.erase(it);
  }
  // Returns at once, as NVIDIA's driver does: the handle is invalid now,
  // and the work queued on it still completes in the background.
  s->Stop();
  return CUDA_SUCCESS;
}

std::shared_ptr<Stream> Driver::LockedFindStream(CUstream stream) {
  MutexLock lock(&mu_);
  return FindStream(stream);
}

CUresult Driver::StreamSynchronize(CUstream stream) {
  std::shared_ptr<Stream> s = LockedFindStream(stream);
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  s->Synchronize();
  return CUDA_SUCCESS;
}

CUresult Driver::LaunchHostFunc(CUstream stream, CUhostFn fn, void* user_data) {
  if (fn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::shared_ptr<Stream> s = LockedFindStream(stream);
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  s->Enqueue([fn, user_data] { fn(user_data); });
  return CUDA_SUCCESS;
}

CUresult Driver::StreamQuery(CUstream stream) {
  std::shared_ptr<Stream> s = LockedFindStream(stream);
  if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  return s->Idle() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

}  // namespace softgpu
