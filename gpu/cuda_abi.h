// The part of NVIDIA's CUDA driver API (libcuda.so.1) that Ferry uses,
// declared from NVIDIA's documented ABI (the CUDA Driver API reference,
// "Data types used by CUDA driver"), so that Ferry builds with no CUDA
// headers and loads the driver at run time with dlopen. The same header is
// the contract softgpu (gpu/softgpu), the emulated driver CI runs on,
// implements.
//
// Only what Ferry calls is here. Values are the documented ones and must
// not change: they cross the ABI. Entry points are listed with the symbol
// name the driver exports; several carry a _v2 suffix since CUDA 3.2
// (64-bit device pointers), which NVIDIA's cuda.h hides behind macros.
#ifndef FERRY_GPU_CUDA_ABI_H_
#define FERRY_GPU_CUDA_ABI_H_

#include <cstddef>
#include <cstdint>

extern "C" {

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;  // NOLINT: the ABI's own type
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;

// CUresult values (cudaError_enum).
enum : CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_UNKNOWN = 999,
};

// CUmemorytype.
enum : unsigned int {
  CU_MEMORYTYPE_HOST = 1,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_MEMORYTYPE_ARRAY = 3,
  CU_MEMORYTYPE_UNIFIED = 4,
};

// CUpointer_attribute.
typedef unsigned int CUpointer_attribute;
enum : CUpointer_attribute {
  CU_POINTER_ATTRIBUTE_CONTEXT = 1,            // CUcontext
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,        // unsigned int, CUmemorytype
  CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,     // CUdeviceptr
  CU_POINTER_ATTRIBUTE_HOST_POINTER = 4,       // void*
  CU_POINTER_ATTRIBUTE_SYNC_MEMOPS = 6,        // unsigned int (bool)
  CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,          // unsigned long long
  CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,         // unsigned int (bool)
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,     // int
  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,  // CUdeviceptr
  CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,        // size_t
  CU_POINTER_ATTRIBUTE_MAPPED = 13,            // unsigned int (bool)
  CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 15,  // unsigned int
};

// CUdevice_attribute (the few Ferry reads).
typedef int CUdevice_attribute;
enum : CUdevice_attribute {
  CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
  CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
  CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 116,
  CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
};

// CUmemRangeHandleType, for cuMemGetHandleForAddressRange.
typedef int CUmemRangeHandleType;
enum : CUmemRangeHandleType {
  CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 0x1,
};

// cuMemHostAlloc flags.
enum : unsigned int {
  CU_MEMHOSTALLOC_PORTABLE = 0x1,
  CU_MEMHOSTALLOC_DEVICEMAP = 0x2,
};

// An allocation exported to another process (cuIpcGetMemHandle): opaque
// bytes, passed by value.
enum : unsigned int { CU_IPC_HANDLE_SIZE = 64 };
typedef struct CUipcMemHandle_st {
  char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;
// cuIpcOpenMemHandle flags.
enum : unsigned int { CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1 };

// cuStreamCreate flags.
enum : unsigned int {
  CU_STREAM_DEFAULT = 0x0,
  CU_STREAM_NON_BLOCKING = 0x1,
};

// Entry points, as function types; the exported symbol name follows each.
typedef CUresult (*PFN_cuInit)(unsigned int flags);        // cuInit
typedef CUresult (*PFN_cuDriverGetVersion)(int* version);  // cuDriverGetVersion
typedef CUresult (*PFN_cuGetErrorString)(CUresult error,
                                         const char** str);  // cuGetErrorString
typedef CUresult (*PFN_cuGetErrorName)(CUresult error,
                                       const char** str);  // cuGetErrorName
typedef CUresult (*PFN_cuDeviceGetCount)(int* count);      // cuDeviceGetCount
typedef CUresult (*PFN_cuDeviceGet)(CUdevice* device,
                                    int ordinal);  // cuDeviceGet
typedef CUresult (*PFN_cuDeviceGetName)(char* name, int len,
                                        CUdevice dev);  // cuDeviceGetName
typedef CUresult (*PFN_cuDeviceGetPCIBusId)(
    char* bus_id, int len,
    CUdevice dev);  // cuDeviceGetPCIBusId
typedef CUresult (*PFN_cuDeviceGetAttribute)(
    int* value, CUdevice_attribute attrib,
    CUdevice dev);  // cuDeviceGetAttribute
typedef CUresult (*PFN_cuDevicePrimaryCtxRetain)(
    CUcontext* ctx, CUdevice dev);  // cuDevicePrimaryCtxRetain
typedef CUresult (*PFN_cuDevicePrimaryCtxRelease)(
    CUdevice dev);  // cuDevicePrimaryCtxRelease_v2
typedef CUresult (*PFN_cuCtxSetCurrent)(CUcontext ctx);   // cuCtxSetCurrent
typedef CUresult (*PFN_cuCtxGetCurrent)(CUcontext* ctx);  // cuCtxGetCurrent
typedef CUresult (*PFN_cuMemAlloc)(CUdeviceptr* dptr,
                                   size_t bytesize);  // cuMemAlloc_v2
typedef CUresult (*PFN_cuMemFree)(CUdeviceptr dptr);  // cuMemFree_v2
typedef CUresult (*PFN_cuMemGetAddressRange)(
    CUdeviceptr* base, size_t* size,
    CUdeviceptr dptr);  // cuMemGetAddressRange_v2
typedef CUresult (*PFN_cuMemHostAlloc)(void** pp, size_t bytesize,
                                       unsigned int flags);  // cuMemHostAlloc
typedef CUresult (*PFN_cuMemFreeHost)(void* p);              // cuMemFreeHost
typedef CUresult (*PFN_cuMemcpyHtoD)(CUdeviceptr dst, const void* src,
                                     size_t bytes);  // cuMemcpyHtoD_v2
typedef CUresult (*PFN_cuMemcpyDtoH)(void* dst, CUdeviceptr src,
                                     size_t bytes);  // cuMemcpyDtoH_v2
typedef CUresult (*PFN_cuMemcpyDtoD)(CUdeviceptr dst, CUdeviceptr src,
                                     size_t bytes);  // cuMemcpyDtoD_v2
typedef CUresult (*PFN_cuMemcpyHtoDAsync)(
    CUdeviceptr dst, const void* src, size_t bytes,
    CUstream stream);  // cuMemcpyHtoDAsync_v2
typedef CUresult (*PFN_cuMemcpyDtoHAsync)(
    void* dst, CUdeviceptr src, size_t bytes,
    CUstream stream);  // cuMemcpyDtoHAsync_v2
typedef CUresult (*PFN_cuMemcpyDtoDAsync)(
    CUdeviceptr dst, CUdeviceptr src, size_t bytes,
    CUstream stream);  // cuMemcpyDtoDAsync_v2
// Another process's device allocation: exported (a handle for the whole
// allocation holding dptr), opened here (a device pointer to its start in
// this process; opening the same one again counts a reference), and
// closed. The exporter must not free it while it is open elsewhere.
typedef CUresult (*PFN_cuIpcGetMemHandle)(
    CUipcMemHandle* handle, CUdeviceptr dptr);  // cuIpcGetMemHandle
typedef CUresult (*PFN_cuIpcOpenMemHandle)(
    CUdeviceptr* pdptr, CUipcMemHandle handle,
    unsigned int flags);  // cuIpcOpenMemHandle_v2
typedef CUresult (*PFN_cuIpcCloseMemHandle)(
    CUdeviceptr dptr);  // cuIpcCloseMemHandle
typedef CUresult (*PFN_cuMemsetD8)(CUdeviceptr dst, unsigned char value,
                                   size_t n);  // cuMemsetD8_v2
typedef CUresult (*PFN_cuStreamCreate)(CUstream* stream,
                                       unsigned int flags);  // cuStreamCreate
typedef CUresult (*PFN_cuStreamDestroy)(CUstream stream);  // cuStreamDestroy_v2
typedef CUresult (*PFN_cuStreamSynchronize)(
    CUstream stream);                                    // cuStreamSynchronize
typedef CUresult (*PFN_cuStreamQuery)(CUstream stream);  // cuStreamQuery
// Runs on a driver thread once the stream's earlier work is done; the
// stream's later work waits for it to return. It must not call CUDA.
typedef void (*CUhostFn)(void* user_data);
typedef CUresult (*PFN_cuLaunchHostFunc)(CUstream stream, CUhostFn fn,
                                         void* user_data);  // cuLaunchHostFunc
typedef CUresult (*PFN_cuPointerGetAttribute)(
    void* data, CUpointer_attribute attribute,
    CUdeviceptr ptr);  // cuPointerGetAttribute
// Unlike cuPointerGetAttribute, succeeds for a pointer CUDA does not know
// (plain host memory), leaving each attribute at its null value (memory
// type 0, which is what Ferry relies on).
typedef CUresult (*PFN_cuPointerGetAttributes)(
    unsigned int num_attributes, CUpointer_attribute* attributes, void** data,
    CUdeviceptr ptr);  // cuPointerGetAttributes
typedef CUresult (*PFN_cuPointerSetAttribute)(
    const void* value, CUpointer_attribute attribute,
    CUdeviceptr ptr);  // cuPointerSetAttribute
// A dma-buf file descriptor for [dptr, dptr + size), both aligned to the
// host page size; the caller owns the fd (CUDA 11.7+, Linux kernel 5.12+).
typedef CUresult (*PFN_cuMemGetHandleForAddressRange)(
    void* handle, CUdeviceptr dptr, size_t size,
    CUmemRangeHandleType handle_type,
    unsigned long long flags);  // NOLINT cuMemGetHandleForAddressRange

}  // extern "C"

#endif  // FERRY_GPU_CUDA_ABI_H_
