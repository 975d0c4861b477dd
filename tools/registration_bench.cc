// registration_bench: the cost of registering n buffers with an engine, one
// RegisterLocalMemory call each or one RegisterLocalMemoryBatch, including
// the publication of each in the metadata service (the engine's embedded
// one, over gRPC on loopback) -- the cost a KV-cache store pays at start-up
// for its blocks. TCP transport, so no NIC registration is measured.
// Google Benchmark:
//   bazel run -c opt //tools:registration_bench
#include <cstdlib>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/transfer_engine.h"

namespace ferry {
namespace {

constexpr size_t kBufferBytes = 4096;

struct Setup {
  TransferEngine engine;
  std::unique_ptr<uint8_t[]> memory;
  explicit Setup(size_t n) : memory(new uint8_t[n * 2 * kBufferBytes]()) {
    EngineOptions o;
    o.local_segment_name = "registration-bench";
    o.transports = {"tcp"};
    o.log_level = "warn";
    if (!engine.Init(o).ok()) std::abort();
  }
  std::vector<BufferEntry> Entries(size_t n) {
    std::vector<BufferEntry> e(n);
    for (size_t i = 0; i < n; ++i) {
      e[i] = {memory.get() + i * 2 * kBufferBytes, kBufferBytes};
    }
    return e;
  }
};

void Unregister(Setup& s, const std::vector<BufferEntry>& entries) {
  std::vector<void*> addrs;
  for (const BufferEntry& e : entries) addrs.push_back(e.addr);
  if (!s.engine.UnregisterLocalMemoryBatch(addrs).ok()) std::abort();
}

void BM_RegisterOneByOne(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  Setup s(n);
  const std::vector<BufferEntry> entries = s.Entries(n);
  for (auto _ : state) {
    for (const BufferEntry& e : entries) {
      if (!s.engine.RegisterLocalMemory(e.addr, e.length).ok()) std::abort();
    }
    state.PauseTiming();
    Unregister(s, entries);
    state.ResumeTiming();
  }
  state.counters["buffers/s"] = benchmark::Counter(
      static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_RegisterBatch(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  Setup s(n);
  const std::vector<BufferEntry> entries = s.Entries(n);
  for (auto _ : state) {
    if (!s.engine.RegisterLocalMemoryBatch(entries).ok()) std::abort();
    state.PauseTiming();
    Unregister(s, entries);
    state.ResumeTiming();
  }
  state.counters["buffers/s"] = benchmark::Counter(
      static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_RegisterOneByOne)
    ->Arg(100)
    ->Arg(1000)
    ->Arg(10000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_RegisterBatch)
    ->Arg(100)
    ->Arg(1000)
    ->Arg(10000)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
