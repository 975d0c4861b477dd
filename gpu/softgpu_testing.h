// For tests that run Ferry on softgpu: the process's CUDA driver is
// softgpu's libcuda.so.1 from the test's runfiles (a data dependency on
// //gpu/softgpu:libcuda.so.1), loaded as CudaDriver::Get() loads a driver,
// so that the engine's own lookups (CudaDriver::IfLoaded) find it too.
#ifndef FERRY_GPU_SOFTGPU_TESTING_H_
#define FERRY_GPU_SOFTGPU_TESTING_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gpu/cuda_driver.h"

namespace ferry::gpu {

// softgpu's library in the runfiles of the running test.
inline std::string SoftgpuLibrary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  return std::string(srcdir != nullptr ? srcdir : ".") + "/" +
         (ws != nullptr ? ws : "ferry") + "/gpu/softgpu/libcuda.so.1";
}

// The process's driver, softgpu with the GPUs `devices` names
// (FERRY_SOFTGPU_DEVICES: a count, or PCI addresses), read at the first
// call only. Aborts, saying why, if it does not load: every test of the
// binary needs it.
inline const CudaDriver& SoftgpuDriverWith(const std::string& devices) {
  static const CudaDriver* driver = [&devices] {
    setenv("FERRY_CUDA_LIBRARY", SoftgpuLibrary().c_str(), 1);
    setenv("FERRY_SOFTGPU_DEVICES", devices.c_str(), 1);
    auto d = CudaDriver::Get();
    if (!d.ok()) {
      std::fprintf(stderr, "softgpu: %s\n", d.status().ToString().c_str());
      std::abort();
    }
    return *d;
  }();
  return *driver;
}

// As SoftgpuDriverWith, with `devices` GPUs.
inline const CudaDriver& SoftgpuDriver(int devices = 1) {
  return SoftgpuDriverWith(std::to_string(devices));
}

}  // namespace ferry::gpu

#endif  // FERRY_GPU_SOFTGPU_TESTING_H_
