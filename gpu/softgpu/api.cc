// The exported entry points: exactly those of gpu/cuda_abi.h, under the
// symbol names listed there, and softgpu's test control of
// softgpu_control.h (libcuda.map keeps every other symbol local). Each
// checks that it has the type of its PFN_ typedef, so the header and
// the library cannot drift apart.
#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "gpu/softgpu/softgpu.h"
#include "gpu/softgpu/softgpu_control.h"

namespace softgpu {
namespace {

struct ErrorText {
  CUresult code;
  const char* name;
  const char* text;  // NVIDIA's wording
};

constexpr ErrorText kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED",
     "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED",
     "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE",
     "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE",
     "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT",
     "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE",
     "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED",
     "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ErrorText* FindError(CUresult code) {
  for (const ErrorText& e : kErrors) {
    if (e.code == code) return &e;
  }
  return nullptr;
}

// Runs `f` on the driver, or says there is none yet.
template <typename F>
CUresult WithDriver(F&& f) {
  Driver* d = Driver::Get();
  if (d == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return f(*d);
}

// `s` into name[0, len), cut short if it does not fit, as CUDA does.
CUresult CopyName(const std::string& s, char* name, int len) {
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  const size_t n = std::min(s.size(), static_cast<size_t>(len) - 1);
  std::memcpy(name, s.data(), n);
  name[n] = '\0';
  return CUDA_SUCCESS;
}

template <typename T>
void Put(void* data, T value) {
  std::memcpy(data, &value, sizeof(value));
}

// Writes attribute `attribute` of `ptr` (described by `info`) to `data`, in
// the type gpu/cuda_abi.h gives it; false for an attribute softgpu does not
// report. Memory the driver does not know reads as the null value of each
// attribute; its DEVICE_ORDINAL is -2, CUDA's ordinal for memory no device
// owns.
bool PutAttribute(void* data, CUpointer_attribute attribute,
                  const PointerInfo& info, CUdeviceptr ptr) {
  const bool known = info.memory_type != 0;
  const bool device = info.memory_type == CU_MEMORYTYPE_DEVICE;
  switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
      Put<CUcontext>(data, info.context);
      return true;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
      Put<unsigned int>(data, info.memory_type);
      return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
      Put<CUdeviceptr>(data, known ? ptr : 0);
      return true;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
      // Device memory has no host address: that is the point of softgpu.
      Put<void*>(data,
                 known && !device ? reinterpret_cast<void*>(ptr) : nullptr);
      return true;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS:
      Put<unsigned int>(data, info.sync_memops);
      return true;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
      Put<unsigned long long>(data, info.buffer_id);  // NOLINT: ABI type
      return true;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
      Put<unsigned int>(data, 0);
      return true;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
      Put<int>(data, info.device);
      return true;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
      Put<CUdeviceptr>(data, info.range_start);
      return true;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
      Put<size_t>(data, info.range_size);
      return true;
    case CU_POINTER_ATTRIBUTE_MAPPED:
      Put<unsigned int>(data, known ? 1 : 0);
      return true;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE:
      Put<unsigned int>(data, device ? 1 : 0);
      return true;
  }
  return false;
}

}  // namespace
}  // namespace softgpu

using softgpu::CopyEnd;
using softgpu::Driver;
using softgpu::WithDriver;

// Asserts that entry point `fn` has the type gpu/cuda_abi.h declares.
#define SOFTGPU_CHECK_TYPE(fn, pfn)                 \
  static_assert(std::is_same_v<decltype(&fn), pfn>, \
                #fn " does not have the type " #pfn)

SOFTGPU_EXPORT CUresult cuInit(unsigned int flags) {
  return Driver::Init(flags);
}
SOFTGPU_CHECK_TYPE(cuInit, PFN_cuInit);

SOFTGPU_EXPORT CUresult cuDriverGetVersion(int* version) {
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = softgpu::kDriverVersion;
  return CUDA_SUCCESS;
}
SOFTGPU_CHECK_TYPE(cuDriverGetVersion, PFN_cuDriverGetVersion);

SOFTGPU_EXPORT CUresult cuGetErrorString(CUresult error, const char** str) {
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const softgpu::ErrorText* e = softgpu::FindError(error);
  *str = e == nullptr ? nullptr : e->text;
  return e == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
SOFTGPU_CHECK_TYPE(cuGetErrorString, PFN_cuGetErrorString);

SOFTGPU_EXPORT CUresult cuGetErrorName(CUresult error, const char** str) {
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const softgpu::ErrorText* e = softgpu::FindError(error);
  *str = e == nullptr ? nullptr : e->name;
  return e == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
SOFTGPU_CHECK_TYPE(cuGetErrorName, PFN_cuGetErrorName);

SOFTGPU_EXPORT CUresult cuDeviceGetCount(int* count) {
  return WithDriver([&](Driver& d) -> CUresult {
    if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *count = d.device_count();
    return CUDA_SUCCESS;
  });
}
SOFTGPU_CHECK_TYPE(cuDeviceGetCount, PFN_cuDeviceGetCount);

SOFTGPU_EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  return WithDriver([&](Driver& d) -> CUresult {
    if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (!d.ValidDevice(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
  });
}
SOFTGPU_CHECK_TYPE(cuDeviceGet, PFN_cuDeviceGet);

SOFTGPU_EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  return WithDriver([&](Driver& d) -> CUresult {
    if (!d.ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
    return softgpu::CopyName(softgpu::kDeviceName, name, len);
  });
}
SOFTGPU_CHECK_TYPE(cuDeviceGetName, PFN_cuDeviceGetName);

SOFTGPU_EXPORT CUresult cuDeviceGetPCIBusId(char* bus_id, int len,
                                            CUdevice dev) {
  return WithDriver([&](Driver& d) -> CUresult {
    if (!d.ValidDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
    return softgpu::CopyName(d.device_config(dev).bus_id, bus_id, len);
  });
}
SOFTGPU_CHECK_TYPE(cuDeviceGetPCIBusId, PFN_cuDeviceGetPCIBusId);

SOFTGPU_EXPORT CUresult cuDeviceGetAttribute(int* value,
                                             CUdevice_attribute attribute,
                                             CUdevice dev) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.DeviceGetAttribute(value, attribute, dev);
  });
}
SOFTGPU_CHECK_TYPE(cuDeviceGetAttribute, PFN_cuDeviceGetAttribute);

SOFTGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.PrimaryCtxRetain(ctx, dev); });
}
SOFTGPU_CHECK_TYPE(cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain);

SOFTGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.PrimaryCtxRelease(dev); });
}
SOFTGPU_CHECK_TYPE(cuDevicePrimaryCtxRelease_v2, PFN_cuDevicePrimaryCtxRelease);

SOFTGPU_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.CtxSetCurrent(ctx); });
}
SOFTGPU_CHECK_TYPE(cuCtxSetCurrent, PFN_cuCtxSetCurrent);

SOFTGPU_EXPORT CUresult cuCtxGetCurrent(CUcontext* ctx) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.CtxGetCurrent(ctx); });
}
SOFTGPU_CHECK_TYPE(cuCtxGetCurrent, PFN_cuCtxGetCurrent);

SOFTGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.MemAlloc(dptr, bytesize); });
}
SOFTGPU_CHECK_TYPE(cuMemAlloc_v2, PFN_cuMemAlloc);

SOFTGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
  return WithDriver([&](Driver& d) -> CUresult { return d.MemFree(dptr); });
}
SOFTGPU_CHECK_TYPE(cuMemFree_v2, PFN_cuMemFree);

SOFTGPU_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size,
                                                CUdeviceptr dptr) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.MemGetAddressRange(base, size, dptr);
  });
}
SOFTGPU_CHECK_TYPE(cuMemGetAddressRange_v2, PFN_cuMemGetAddressRange);

SOFTGPU_EXPORT CUresult cuMemHostAlloc(void** pp, size_t bytesize,
                                       unsigned int flags) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.MemHostAlloc(pp, bytesize, flags);
  });
}
SOFTGPU_CHECK_TYPE(cuMemHostAlloc, PFN_cuMemHostAlloc);

SOFTGPU_EXPORT CUresult cuMemFreeHost(void* p) {
  return WithDriver([&](Driver& d) -> CUresult { return d.MemFreeHost(p); });
}
SOFTGPU_CHECK_TYPE(cuMemFreeHost, PFN_cuMemFreeHost);

namespace {

CopyEnd Device(CUdeviceptr p) { return CopyEnd{p, true}; }
CopyEnd Host(const void* p) {
  return CopyEnd{reinterpret_cast<uintptr_t>(p), false};
}

}  // namespace

SOFTGPU_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src,
                                        size_t bytes) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.Memcpy(Device(dst), Host(src), bytes, /*async=*/false, nullptr);
  });
}
SOFTGPU_CHECK_TYPE(cuMemcpyHtoD_v2, PFN_cuMemcpyHtoD);

SOFTGPU_EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src,
                                        size_t bytes) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.Memcpy(Host(dst), Device(src), bytes, /*async=*/false, nullptr);
  });
}
SOFTGPU_CHECK_TYPE(cuMemcpyDtoH_v2, PFN_cuMemcpyDtoH);

SOFTGPU_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src,
                                        size_t bytes) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.Memcpy(Device(dst), Device(src), bytes, /*async=*/false, nullptr);
  });
}
SOFTGPU_CHECK_TYPE(cuMemcpyDtoD_v2, PFN_cuMemcpyDtoD);

SOFTGPU_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src,
                                             size_t bytes, CUstream stream) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.Memcpy(Device(dst), Host(src), bytes, /*async=*/true, stream);
  });
}
SOFTGPU_CHECK_TYPE(cuMemcpyHtoDAsync_v2, PFN_cuMemcpyHtoDAsync);

SOFTGPU_EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src,
                                             size_t bytes, CUstream stream) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.Memcpy(Host(dst), Device(src), bytes, /*async=*/true, stream);
  });
}
SOFTGPU_CHECK_TYPE(cuMemcpyDtoHAsync_v2, PFN_cuMemcpyDtoHAsync);

SOFTGPU_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src,
                                             size_t bytes, CUstream stream) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.Memcpy(Device(dst), Device(src), bytes, /*async=*/true, stream);
  });
}
SOFTGPU_CHECK_TYPE(cuMemcpyDtoDAsync_v2, PFN_cuMemcpyDtoDAsync);

SOFTGPU_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle* handle,
                                          CUdeviceptr dptr) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.IpcGetMemHandle(handle, dptr); });
}
SOFTGPU_CHECK_TYPE(cuIpcGetMemHandle, PFN_cuIpcGetMemHandle);

SOFTGPU_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* pdptr,
                                              CUipcMemHandle handle,
                                              unsigned int flags) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.IpcOpenMemHandle(pdptr, handle, flags);
  });
}
SOFTGPU_CHECK_TYPE(cuIpcOpenMemHandle_v2, PFN_cuIpcOpenMemHandle);

SOFTGPU_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.IpcCloseMemHandle(dptr); });
}
SOFTGPU_CHECK_TYPE(cuIpcCloseMemHandle, PFN_cuIpcCloseMemHandle);

SOFTGPU_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value,
                                      size_t n) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.MemsetD8(dst, value, n); });
}
SOFTGPU_CHECK_TYPE(cuMemsetD8_v2, PFN_cuMemsetD8);

SOFTGPU_EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.StreamCreate(stream, flags); });
}
SOFTGPU_CHECK_TYPE(cuStreamCreate, PFN_cuStreamCreate);

SOFTGPU_EXPORT CUresult cuStreamDestroy_v2(CUstream stream) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.StreamDestroy(stream); });
}
SOFTGPU_CHECK_TYPE(cuStreamDestroy_v2, PFN_cuStreamDestroy);

SOFTGPU_EXPORT CUresult cuStreamSynchronize(CUstream stream) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.StreamSynchronize(stream); });
}
SOFTGPU_CHECK_TYPE(cuStreamSynchronize, PFN_cuStreamSynchronize);

SOFTGPU_EXPORT CUresult cuStreamQuery(CUstream stream) {
  return WithDriver(
      [&](Driver& d) -> CUresult { return d.StreamQuery(stream); });
}
SOFTGPU_CHECK_TYPE(cuStreamQuery, PFN_cuStreamQuery);

SOFTGPU_EXPORT CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn,
                                         void* user_data) {
  return WithDriver([&](Driver& d) -> CUresult {
    return d.LaunchHostFunc(stream, fn, user_data);
  });
}
SOFTGPU_CHECK_TYPE(cuLaunchHostFunc, PFN_cuLaunchHostFunc);

SOFTGPU_EXPORT CUresult cuPointerGetAttribute(void* data,
                                              CUpointer_attribute attribute,
                                              CUdeviceptr ptr) {
  return WithDriver([&](Driver& d) -> CUresult {
    if (data == nullptr) return CUDA_ERROR_INVALID_VALUE;
    const softgpu::PointerInfo info = d.QueryPointer(ptr);
    // Unlike cuPointerGetAttributes, an unknown pointer is an error here.
    if (info.memory_type == 0) return CUDA_ERROR_INVALID_VALUE;
    return softgpu::PutAttribute(data, attribute, info, ptr)
               ? CUDA_SUCCESS
               : CUDA_ERROR_INVALID_VALUE;
  });
}
SOFTGPU_CHECK_TYPE(cuPointerGetAttribute, PFN_cuPointerGetAttribute);

SOFTGPU_EXPORT CUresult cuPointerGetAttributes(unsigned int num_attributes,
                                               CUpointer_attribute* attributes,
                                               void** data, CUdeviceptr ptr) {
  return WithDriver([&](Driver& d) -> CUresult {
    if (num_attributes == 0 || attributes == nullptr || data == nullptr) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    const softgpu::PointerInfo info = d.QueryPointer(ptr);
    // Every attribute is checked before any is written: on error, nothing
    // is.
    alignas(8) char scratch[16];
    for (unsigned int i = 0; i < num_attributes; ++i) {
      if (data[i] == nullptr ||
          !softgpu::PutAttribute(scratch, attributes[i], info, ptr)) {
        return CUDA_ERROR_INVALID_VALUE;
      }
    }
    for (unsigned int i = 0; i < num_attributes; ++i) {
      softgpu::PutAttribute(data[i], attributes[i], info, ptr);
    }
    return CUDA_SUCCESS;
  });
}
SOFTGPU_CHECK_TYPE(cuPointerGetAttributes, PFN_cuPointerGetAttributes);

SOFTGPU_EXPORT CUresult cuPointerSetAttribute(const void* value,
                                              CUpointer_attribute attribute,
                                              CUdeviceptr ptr) {
  return WithDriver([&](Driver& d) -> CUresult {
    // SYNC_MEMOPS is the one attribute a caller may set.
    if (value == nullptr || attribute != CU_POINTER_ATTRIBUTE_SYNC_MEMOPS) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    unsigned int on = 0;
    std::memcpy(&on, value, sizeof(on));
    return d.SetSyncMemops(ptr, on);
  });
}
SOFTGPU_CHECK_TYPE(cuPointerSetAttribute, PFN_cuPointerSetAttribute);

SOFTGPU_EXPORT CUresult cuMemGetHandleForAddressRange(
    void* handle, CUdeviceptr dptr, size_t size,
    CUmemRangeHandleType handle_type,
    unsigned long long flags) {  // NOLINT: the ABI's type
  return WithDriver([&](Driver& d) -> CUresult {
    return d.ExportDmabuf(handle, dptr, size, handle_type, flags);
  });
}
SOFTGPU_CHECK_TYPE(cuMemGetHandleForAddressRange,
                   PFN_cuMemGetHandleForAddressRange);

// ---- softgpu's own control (softgpu_control.h), not NVIDIA's ABI ---------

SOFTGPU_EXPORT int softgpu_hold_streams(int hold) {
  softgpu::SetStreamsHeld(hold != 0);
  return 0;
}
static_assert(
    std::is_same_v<decltype(&softgpu_hold_streams), softgpu_hold_streams_fn>,
    "softgpu_hold_streams does not have softgpu_control.h's type");
