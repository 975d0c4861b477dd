// The CUDA driver's copy bandwidth by block size: the reference Ferry's GPU
// figures are set beside (bench/matrix's VRAM cells, devtools/gpu_check.sh),
// since the staging path's cost is these copies (Google Benchmark).
//   gpu_copy_bench --benchmark_filter='BM_HtoD/1048576$'
// BM_HtoD and BM_DtoH copy between pinned host memory and device memory,
// as the TCP transport's staging does; BM_DtoD within one GPU. Each
// iteration copies one block, walking a 256 MiB region of the first GPU
// (the driver loaded at run time: tools/softgpu-run for the emulated one,
// whose copies are memcpy, not a GPU's DMA).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>

#include "gpu/cuda_driver.h"

namespace {

constexpr size_t kRegion = size_t{256} << 20;

struct Buffers {
  const ferry::gpu::CudaDriver* driver = nullptr;
  CUdeviceptr dev = 0, dev2 = 0;
  void* host = nullptr;
};

// Allocated once; the process exits with a message if there is no GPU.
const Buffers& Get() {
  static const Buffers b = [] {
    Buffers b;
    auto d = ferry::gpu::CudaDriver::Get();
    if (!d.ok() || (*d)->device_count() == 0) {
      std::fprintf(stderr, "gpu_copy_bench: no GPU: %s\n",
                   d.ok() ? "the driver lists none"
                          : std::string(d.status().message()).c_str());
      std::exit(1);
    }
    b.driver = *d;
    const auto& api = b.driver->api();
    if (!b.driver->UseDevice(0).ok() ||
        api.cuMemAlloc(&b.dev, kRegion) != CUDA_SUCCESS ||
        api.cuMemAlloc(&b.dev2, kRegion) != CUDA_SUCCESS ||
        api.cuMemHostAlloc(&b.host, kRegion, CU_MEMHOSTALLOC_PORTABLE) !=
            CUDA_SUCCESS ||
        api.cuMemsetD8(b.dev, 1, kRegion) != CUDA_SUCCESS) {
      std::fprintf(stderr,
                   "gpu_copy_bench: cannot allocate 2 x 256 MiB of "
                   "device memory and 256 MiB pinned\n");
      std::exit(1);
    }
    return b;
  }();
  return b;
}

enum class Kind { kHtoD, kDtoH, kDtoD };

void Copy(benchmark::State& state, Kind kind) {
  const Buffers& b = Get();
  if (!b.driver->UseDevice(0).ok()) state.SkipWithError("UseDevice");
  const auto& api = b.driver->api();
  const size_t block = static_cast<size_t>(state.range(0));
  const size_t region = kRegion / block * block;
  auto* host = static_cast<char*>(b.host);
  size_t off = 0;
  for (auto _ : state) {
    CUresult r = CUDA_SUCCESS;
    switch (kind) {
      case Kind::kHtoD:
        r = api.cuMemcpyHtoD(b.dev + off, host + off, block);
        break;
      case Kind::kDtoH:
        r = api.cuMemcpyDtoH(host + off, b.dev + off, block);
        break;
      case Kind::kDtoD:
        r = api.cuMemcpyDtoD(b.dev2 + off, b.dev + off, block);
        // DtoD returns before it ran: time the copy, not its launch.
        if (r == CUDA_SUCCESS) r = api.cuStreamSynchronize(nullptr);
        break;
    }
    if (r != CUDA_SUCCESS) {
      state.SkipWithError("copy failed");
      break;
    }
    off += block;
    if (off == region) off = 0;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(block));
}

void BM_HtoD(benchmark::State& s) { Copy(s, Kind::kHtoD); }
void BM_DtoH(benchmark::State& s) { Copy(s, Kind::kDtoH); }
void BM_DtoD(benchmark::State& s) { Copy(s, Kind::kDtoD); }
BENCHMARK(BM_HtoD)->RangeMultiplier(4)->Range(4 << 10, 64 << 20);
BENCHMARK(BM_DtoH)->RangeMultiplier(4)->Range(4 << 10, 64 << 20);
BENCHMARK(BM_DtoD)->RangeMultiplier(4)->Range(4 << 10, 64 << 20);

}  // namespace

BENCHMARK_MAIN();
