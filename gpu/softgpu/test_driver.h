// For softgpu's tests: loads softgpu's libcuda.so.1 as Ferry loads a CUDA
// driver, with dlopen of the library file, each entry point resolved by
// dlsym under the symbol name gpu/cuda_abi.h gives it, into its PFN_ type.
// So every test also proves the library exports those names. EXPECT_CU
// and friends compare CUresults by name (gtest's, so gtest comes first).
#ifndef FERRY_GPU_SOFTGPU_TEST_DRIVER_H_
#define FERRY_GPU_SOFTGPU_TEST_DRIVER_H_

#include <dlfcn.h>
#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "gpu/cuda_abi.h"

namespace softgpu {

// X(member, exported symbol): member has type PFN_<member>.
#define SOFTGPU_ENTRY_POINTS(X)                                \
  X(cuInit, "cuInit")                                          \
  X(cuDriverGetVersion, "cuDriverGetVersion")                  \
  X(cuGetErrorString, "cuGetErrorString")                      \
  X(cuGetErrorName, "cuGetErrorName")                          \
  X(cuDeviceGetCount, "cuDeviceGetCount")                      \
  X(cuDeviceGet, "cuDeviceGet")                                \
  X(cuDeviceGetName, "cuDeviceGetName")                        \
  X(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId")                \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute")              \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")      \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2") \
  X(cuCtxSetCurrent, "cuCtxSetCurrent")                        \
  X(cuCtxGetCurrent, "cuCtxGetCurrent")                        \
  X(cuMemAlloc, "cuMemAlloc_v2")                               \
  X(cuMemFree, "cuMemFree_v2")                                 \
  X(cuMemGetAddressRange, "cuMemGetAddressRange_v2")           \
  X(cuMemHostAlloc, "cuMemHostAlloc")                          \
  X(cuMemFreeHost, "cuMemFreeHost")                            \
  X(cuMemcpyHtoD, "cuMemcpyHtoD_v2")                           \
  X(cuMemcpyDtoH, "cuMemcpyDtoH_v2")                           \
  X(cuMemcpyDtoD, "cuMemcpyDtoD_v2")                           \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2")                 \
  X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2")                 \
  X(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2")                 \
  X(cuIpcGetMemHandle, "cuIpcGetMemHandle")                    \
  X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2")               \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle")                \
  X(cuMemsetD8, "cuMemsetD8_v2")                               \
  X(cuStreamCreate, "cuStreamCreate")                          \
  X(cuStreamDestroy, "cuStreamDestroy_v2")                     \
  X(cuStreamSynchronize, "cuStreamSynchronize")                \
  X(cuStreamQuery, "cuStreamQuery")                            \
  X(cuLaunchHostFunc, "cuLaunchHostFunc")                      \
  X(cuPointerGetAttribute, "cuPointerGetAttribute")            \
  X(cuPointerGetAttributes, "cuPointerGetAttributes")          \
  X(cuPointerSetAttribute, "cuPointerSetAttribute")            \
  X(cuMemGetHandleForAddressRange, "cuMemGetHandleForAddressRange")

struct CudaApi {
#define SOFTGPU_MEMBER(name, symbol) PFN_##name name = nullptr;
  SOFTGPU_ENTRY_POINTS(SOFTGPU_MEMBER)
#undef SOFTGPU_MEMBER
};

// The library at $SOFTGPU_LIBCUDA (the test's data dependency), loaded
// once per process. Exits the process, saying why, if it cannot be loaded
// or lacks an entry point. Does not call cuInit.
inline const CudaApi& Cuda() {
  static const CudaApi* api = [] {
    const char* path = std::getenv("SOFTGPU_LIBCUDA");
    if (path == nullptr) {
      std::fprintf(stderr, "SOFTGPU_LIBCUDA is not set\n");
      std::exit(2);
    }
    // Never closed: the driver's stream threads live in it.
    void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      std::fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
      std::exit(2);
    }
    auto* a = new CudaApi;
#define SOFTGPU_RESOLVE(name, symbol)                              \
  a->name = reinterpret_cast<PFN_##name>(dlsym(lib, symbol));      \
  if (a->name == nullptr) {                                        \
    std::fprintf(stderr, "%s does not export %s\n", path, symbol); \
    std::exit(2);                                                  \
  }
    SOFTGPU_ENTRY_POINTS(SOFTGPU_RESOLVE)
#undef SOFTGPU_RESOLVE
    return a;
  }();
  return *api;
}

// The FERRY_SOFTGPU_* variables softgpu reads at cuInit.
inline constexpr const char* kSoftgpuVariables[] = {
    "FERRY_SOFTGPU_DEVICES",
    "FERRY_SOFTGPU_MEMORY_MIB",
    "FERRY_SOFTGPU_DMABUF",
    "FERRY_SOFTGPU_COPY_DELAY_US",
};

// Sets exactly `env` among kSoftgpuVariables (the rest unset), then calls
// cuInit. For a fresh process (a death test's child): a driver is
// initialised once per process.
inline CUresult InitWith(
    std::initializer_list<std::pair<const char*, const char*>> env) {
  for (const char* name : kSoftgpuVariables) unsetenv(name);
  for (const auto& [name, value] : env) setenv(name, value, 1);
  return Cuda().cuInit(0);
}

// CUDA_SUCCESS etc., so that a failed comparison says which error.
inline std::string Name(CUresult r) {
  const char* name = nullptr;
  Cuda().cuGetErrorName(r, &name);
  return name != nullptr ? name : "CUresult " + std::to_string(r);
}

// CU_POINTER_ATTRIBUTE_MEMORY_TYPE of `ptr` by cuPointerGetAttributes, as
// Ferry classifies a pointer: 0 for memory the driver does not know; 99
// if the query fails.
inline unsigned int MemoryType(CUdeviceptr ptr) {
  unsigned int type = 99;
  CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
  void* data[] = {&type};
  Cuda().cuPointerGetAttributes(1, &attr, data, ptr);
  return type;
}

}  // namespace softgpu

#define EXPECT_CU(expected, call) \
  EXPECT_EQ(::softgpu::Name(call), ::softgpu::Name(expected))
#define ASSERT_CU(expected, call) \
  ASSERT_EQ(::softgpu::Name(call), ::softgpu::Name(expected))
#define ASSERT_CU_OK(call) ASSERT_CU(CUDA_SUCCESS, call)

#endif  // FERRY_GPU_SOFTGPU_TEST_DRIVER_H_
