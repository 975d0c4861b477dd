// The CUDA driver, loaded at run time: Ferry links no CUDA library, so one
// binary runs on hosts with and without GPUs. On a host with NVIDIA's
// driver it loads libcuda.so.1; in CI, softgpu's (gpu/softgpu), through
// LD_LIBRARY_PATH (tools/softgpu-run) or FERRY_CUDA_LIBRARY.
//
// Every call returns absl::Status: a CUDA error becomes a status naming the
// call, the driver's error name and its description. Thread-safe: the
// driver's entry points are, and this class holds no mutable state.
#ifndef FERRY_GPU_CUDA_DRIVER_H_
#define FERRY_GPU_CUDA_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/mutex.h"
#include "gpu/cuda_abi.h"

namespace ferry::gpu {

// Where a pointer's memory lives, as the driver sees it.
struct PointerInfo {
  enum class Kind {
    kHost,        // memory the driver does not know: pageable host memory
    kPinnedHost,  // host memory the driver allocated or registered
    kDevice,      // device memory: not CPU-accessible
    kManaged,     // unified memory (Ferry treats it as device memory)
  };
  Kind kind = Kind::kHost;
  int device = -1;  // the device ordinal, for every kind but kHost
  // The driver's allocation containing the pointer (0 for kHost).
  CUdeviceptr range_start = 0;
  size_t range_size = 0;
  // A process-wide id of that allocation, never reused: tells a freed and
  // reallocated range at the same address apart (0 for kHost).
  uint64_t buffer_id = 0;
};

class CudaDriver {
 public:
  // The process's driver, loaded and initialised (cuInit) on first use and
  // kept for the life of the process, or the reason there is none:
  // NotFound when the library cannot be loaded (no NVIDIA driver on this
  // host), FailedPrecondition when it loads but does not work (an entry
  // point is missing, or cuInit fails: no device, a driver/kernel module
  // mismatch). The library is $FERRY_CUDA_LIBRARY when set, else
  // "libcuda.so.1" from the loader's search path. The outcome is cached:
  // a host that had no driver keeps having none.
  static absl::StatusOr<const CudaDriver*> Get();

  // The process's driver if the process has loaded one already (an
  // application that allocates GPU memory has: PyTorch, the CUDA runtime,
  // or Get()), else null, without loading anything. So a host-memory user
  // on a GPU host never pays for cuInit or a GPU context, and pointer
  // checks on every registration cost nothing where no GPU is in use.
  static const CudaDriver* IfLoaded();

  // A driver of its own from `library` (a path, or a name the dynamic
  // loader searches): for tests and tools that want to pick one. The
  // library stays loaded for the life of the process (unloading a CUDA
  // driver is not supported).
  static absl::StatusOr<std::unique_ptr<CudaDriver>> Load(
      const std::string& library);

  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  // The driver's version, as cuDriverGetVersion gives it (12040 = 12.4).
  int version() const { return version_; }
  int device_count() const { return device_count_; }
  const std::string& library() const { return library_; }

  // What `ptr` is. Pageable host memory is kHost, not an error; an error
  // comes only from the driver failing.
  absl::StatusOr<PointerInfo> Classify(const void* ptr) const;

  // Makes device `device`'s primary context current on the calling thread
  // (driver calls act on the current context). The context is retained
  // once per device, on the first call, for the life of the process.
  // Thread-safe.
  absl::Status UseDevice(int device) const;

  // The device's PCI address, "dddd:bb:dd.f" in lower case, as sysfs
  // names it (for NIC affinity).
  absl::StatusOr<std::string> PciBusId(int device) const;
  absl::StatusOr<std::string> DeviceName(int device) const;
  // Whether the device can export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_
  // SUPPORTED), the path by which a NIC registers device memory without
  // nvidia-peermem.
  absl::StatusOr<bool> DmaBufSupported(int device) const;

  // Synchronous copies. CopyFromDevice returns with the bytes in host
  // memory. CopyToDevice returns once `src` may be reused; as CUDA
  // documents, the bytes are certain to be in device memory for another
  // engine (a NIC) only if the allocation has SYNC_MEMOPS (SetSyncMemops).
  absl::Status CopyToDevice(CUdeviceptr dst, const void* src,
                            size_t bytes) const;
  absl::Status CopyFromDevice(void* dst, CUdeviceptr src, size_t bytes) const;

  // A dma-buf file descriptor for [ptr, ptr + bytes), both page-aligned;
  // the caller owns it. Unimplemented when the driver or kernel cannot
  // export one, with what to do about it.
  absl::StatusOr<int> DmaBufFd(CUdeviceptr ptr, size_t bytes) const;

  // Sets CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the allocation holding `ptr`:
  // synchronous copies to it then complete before they return, which a
  // NIC reading it right after needs.
  absl::Status SetSyncMemops(CUdeviceptr ptr) const;

  // The driver's entry points, for the code that drives streams itself
  // (the staging path). Never null.
  struct Api {
    PFN_cuInit cuInit;
    PFN_cuDriverGetVersion cuDriverGetVersion;
    PFN_cuGetErrorString cuGetErrorString;
    PFN_cuGetErrorName cuGetErrorName;
    PFN_cuDeviceGetCount cuDeviceGetCount;
    PFN_cuDeviceGet cuDeviceGet;
    PFN_cuDeviceGetName cuDeviceGetName;
    PFN_cuDeviceGetPCIBusId cuDeviceGetPCIBusId;
    PFN_cuDeviceGetAttribute cuDeviceGetAttribute;
    PFN_cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRetain;
    PFN_cuDevicePrimaryCtxRelease cuDevicePrimaryCtxRelease;
    PFN_cuCtxSetCurrent cuCtxSetCurrent;
    PFN_cuCtxGetCurrent cuCtxGetCurrent;
    PFN_cuMemAlloc cuMemAlloc;
    PFN_cuMemFree cuMemFree;
    PFN_cuMemGetAddressRange cuMemGetAddressRange;
    PFN_cuMemHostAlloc cuMemHostAlloc;
    PFN_cuMemFreeHost cuMemFreeHost;
    PFN_cuMemcpyHtoD cuMemcpyHtoD;
    PFN_cuMemcpyDtoH cuMemcpyDtoH;
    PFN_cuMemcpyDtoD cuMemcpyDtoD;
    PFN_cuMemcpyHtoDAsync cuMemcpyHtoDAsync;
    PFN_cuMemcpyDtoHAsync cuMemcpyDtoHAsync;
    PFN_cuMemcpyDtoDAsync cuMemcpyDtoDAsync;
    PFN_cuIpcGetMemHandle cuIpcGetMemHandle;
    PFN_cuIpcOpenMemHandle cuIpcOpenMemHandle;
    PFN_cuIpcCloseMemHandle cuIpcCloseMemHandle;
    PFN_cuMemsetD8 cuMemsetD8;
    PFN_cuStreamCreate cuStreamCreate;
    PFN_cuStreamDestroy cuStreamDestroy;
    PFN_cuStreamSynchronize cuStreamSynchronize;
    PFN_cuStreamQuery cuStreamQuery;
    PFN_cuLaunchHostFunc cuLaunchHostFunc;
    PFN_cuPointerGetAttribute cuPointerGetAttribute;
    PFN_cuPointerGetAttributes cuPointerGetAttributes;
    PFN_cuPointerSetAttribute cuPointerSetAttribute;
    PFN_cuMemGetHandleForAddressRange cuMemGetHandleForAddressRange;
  };
  const Api& api() const { return api_; }

  // OK for CUDA_SUCCESS; otherwise a status naming `call` and the error.
  absl::Status Check(CUresult result, absl::string_view call) const;

 private:
  CudaDriver() = default;

  std::string library_;
  Api api_{};
  // Each device's primary context once retained (UseDevice), by ordinal.
  mutable Mutex primary_mu_;
  mutable std::vector<CUcontext> primary_ ABSL_GUARDED_BY(primary_mu_);
  int version_ = 0;
  int device_count_ = 0;
};

}  // namespace ferry::gpu

#endif  // FERRY_GPU_CUDA_DRIVER_H_
