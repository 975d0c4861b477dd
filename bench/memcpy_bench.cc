// memcpy bandwidth by block size: the reference bench/matrix sets beside
// Ferry's same-host figures (Google Benchmark). Each iteration copies one
// block; successive blocks walk a region far larger than the caches, as a
// transfer walks its buffer, with every page touched before timing.
//   memcpy_bench --benchmark_filter='BM_Memcpy/65536$'
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstring>
#include <vector>

namespace {

// Every block size (up to 64 MiB) walks the same 256 MiB, allocated and
// touched once: Google Benchmark runs each case several times.
constexpr size_t kRegion = size_t{256} << 20;

void BM_Memcpy(benchmark::State& state) {
  static std::vector<char>* const src = new std::vector<char>(kRegion, 1);
  static std::vector<char>* const dst = new std::vector<char>(kRegion, 2);
  const size_t block = static_cast<size_t>(state.range(0));
  const size_t region = kRegion / block * block;
  size_t off = 0;
  for (auto _ : state) {
    std::memcpy(dst->data() + off, src->data() + off, block);
    benchmark::ClobberMemory();
    off += block;
    if (off == region) off = 0;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(block));
}
BENCHMARK(BM_Memcpy)->RangeMultiplier(4)->Range(4 << 10, 64 << 20);

}  // namespace

BENCHMARK_MAIN();
