#include "bench/bench_memory.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/pattern.h"
#include "common/status_macros.h"

namespace ferry {
namespace {

// Device memory moves through host memory in pieces of this size.
constexpr size_t kChunk = 16 << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<BenchMemory>> BenchMemory::Allocate(
    int gpu, size_t bytes) {
  if (gpu < 0) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, bytes) != 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
    }
    return std::unique_ptr<BenchMemory>(
        new BenchMemory(nullptr, -1, static_cast<uint8_t*>(p), bytes));
  }
  absl::StatusOr<const gpu::CudaDriver*> driver = gpu::CudaDriver::Get();
  if (!driver.ok()) {
    return absl::Status(
        driver.status().code(),
        absl::StrCat(
            "--use_vram needs a CUDA driver: ", driver.status().message(),
            " (tools/softgpu-run runs the bench on an emulated GPU)"));
  }
  FERRY_RETURN_IF_ERROR((*driver)->UseDevice(gpu));
  CUdeviceptr ptr = 0;
  if (absl::Status s = (*driver)->Check(
          (*driver)->api().cuMemAlloc(&ptr, bytes), "cuMemAlloc");
      !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("allocating ", bytes, " bytes on cuda:", gpu,
                               ": ", s.message()));
  }
  return std::unique_ptr<BenchMemory>(
      new BenchMemory(*driver, gpu, reinterpret_cast<uint8_t*>(ptr), bytes));
}

BenchMemory::~BenchMemory() {
  if (driver_ == nullptr) {
    std::free(data_);
  } else if (driver_->UseDevice(gpu_).ok()) {
    driver_->api().cuMemFree(reinterpret_cast<CUdeviceptr>(data_));
  }
}

std::string BenchMemory::location() const {
  return gpu_ < 0 ? std::string("cpu:0") : absl::StrCat("cuda:", gpu_);
}

absl::Status BenchMemory::Fill(uint8_t* p, size_t len, size_t off,
                               uint64_t seed) const {
  if (driver_ == nullptr) {
    FillPattern(p, len, off, seed);
    return absl::OkStatus();
  }
  FERRY_RETURN_IF_ERROR(driver_->UseDevice(gpu_));
  std::vector<uint8_t> host(std::min(len, kChunk));
  for (size_t done = 0; done < len;) {
    const size_t n = std::min(len - done, kChunk);
    FillPattern(host.data(), n, off + done, seed);
    FERRY_RETURN_IF_ERROR(driver_->CopyToDevice(
        reinterpret_cast<CUdeviceptr>(p + done), host.data(), n));
    done += n;
  }
  return absl::OkStatus();
}

absl::Status BenchMemory::Clear(uint8_t* p, size_t len) const {
  if (driver_ == nullptr) {
    std::memset(p, 0, len);
    return absl::OkStatus();
  }
  FERRY_RETURN_IF_ERROR(driver_->UseDevice(gpu_));
  return driver_->Check(
      driver_->api().cuMemsetD8(reinterpret_cast<CUdeviceptr>(p), 0, len),
      "cuMemsetD8");
}

absl::StatusOr<BenchMemory::Mismatch> BenchMemory::Check(const uint8_t* p,
                                                         size_t len, size_t off,
                                                         uint64_t seed) const {
  Mismatch m;
  if (driver_ == nullptr) {
    m.index = CheckPattern(p, len, off, seed);
    if (m.index < len) m.found = p[m.index];
    return m;
  }
  FERRY_RETURN_IF_ERROR(driver_->UseDevice(gpu_));
  std::vector<uint8_t> host(std::min(len, kChunk));
  for (size_t done = 0; done < len;) {
    const size_t n = std::min(len - done, kChunk);
    FERRY_RETURN_IF_ERROR(driver_->CopyFromDevice(
        host.data(), reinterpret_cast<CUdeviceptr>(p + done), n));
    const size_t bad = CheckPattern(host.data(), n, off + done, seed);
    if (bad < n) {
      m.index = done + bad;
      m.found = host[bad];
      return m;
    }
    done += n;
  }
  m.index = len;
  return m;
}

}  // namespace ferry
