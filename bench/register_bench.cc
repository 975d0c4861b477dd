// register_bench: the cost of registering large host memory -- a KV cache
// of many GiB registered at start-up -- with the RDMA transport, against
// what the kernel itself needs for the same memory, in the same run.
// Google Benchmark; run on softrnic:
//   FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1
//     tools/softrnic-run bazel-bin/bench/register_bench
//
// Registering host memory pins it: a NIC's ibv_reg_mr has the kernel fault
// in and pin every page, and softrnic does the same work when
// FERRY_SOFTRNIC_PIN_PAGES=1 (MADV_POPULATE_WRITE,
// transport/softrnic/mr_pages.cc), which this benchmark sets unless it is
// set already (FERRY_SOFTRNIC_PIN_PAGES=0: softrnic's bookkeeping alone).
// On a NIC the kernel also builds the NIC's page table, which softrnic
// has no cost for. So the reference
// is BM_Populate: the kernel faulting the same fresh memory in, on one
// thread and on as many as registration uses. `fresh`: memory never
// touched before it is registered (as an allocation at start-up is);
// otherwise it was written first (untimed), and registration only walks
// pages that are there.
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "ferry/transfer_engine.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace ferry {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TransferEngine& Engine() {
  static TransferEngine* engine = [] {
    setenv("FERRY_SOFTRNIC_PIN_PAGES", "1", /*overwrite=*/0);
    auto* e = new TransferEngine();
    EngineOptions o;
    o.local_segment_name = "register-bench";
    o.transports = {"rdma"};
    if (absl::Status s = e->Init(o); !s.ok()) {
      std::fprintf(stderr, "register_bench: %s\n", s.ToString().c_str());
      std::exit(1);
    }
    return e;
  }();
  return *engine;
}

// Fresh anonymous memory of `bytes`, written first unless `fresh`.
uint8_t* Map(size_t bytes, bool fresh) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("register_bench: mmap");
    std::exit(1);
  }
  if (!fresh && madvise(p, bytes, MADV_POPULATE_WRITE) != 0) {
    std::perror("register_bench: madvise(MADV_POPULATE_WRITE)");
    std::exit(1);
  }
  return static_cast<uint8_t*>(p);
}

std::vector<BufferEntry> Pieces(uint8_t* base, size_t total, size_t piece) {
  std::vector<BufferEntry> entries;
  for (size_t off = 0; off < total; off += piece) {
    entries.push_back(BufferEntry{base + off, std::min(piece, total - off)});
  }
  return entries;
}

void Report(benchmark::State& state, size_t total) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * total));
  state.counters["pieces"] = static_cast<double>(
      (total + static_cast<size_t>(state.range(1)) * kMiB - 1) /
      (static_cast<size_t>(state.range(1)) * kMiB));
}

// Args: total MiB, piece MiB, fresh. `batch`: one RegisterLocalMemoryBatch
// for all pieces; else one RegisterLocalMemory call per piece, in turn.
void RunRegister(benchmark::State& state, bool batch) {
  const size_t total = static_cast<size_t>(state.range(0)) * kMiB;
  const size_t piece = static_cast<size_t>(state.range(1)) * kMiB;
  const bool fresh = state.range(2) != 0;
  TransferEngine& e = Engine();
  for (auto _ : state) {
    state.PauseTiming();
    uint8_t* base = Map(total, fresh);
    std::vector<BufferEntry> entries = Pieces(base, total, piece);
    state.ResumeTiming();
    absl::Status s;
    if (batch) {
      s = e.RegisterLocalMemoryBatch(entries);
    } else {
      for (const BufferEntry& b : entries) {
        s = e.RegisterLocalMemory(b.addr, b.length);
        if (!s.ok()) break;
      }
    }
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    state.PauseTiming();
    std::vector<void*> addrs;
    for (const BufferEntry& b : entries) addrs.push_back(b.addr);
    if (!e.UnregisterLocalMemoryBatch(addrs).ok()) std::abort();
    munmap(base, total);
    state.ResumeTiming();
  }
  Report(state, total);
}
void BM_RegisterBatch(benchmark::State& state) { RunRegister(state, true); }
void BM_RegisterOneByOne(benchmark::State& state) { RunRegister(state, false); }

// Reference. Args: total MiB, piece MiB, threads: the kernel faulting in
// fresh memory (MADV_POPULATE_WRITE per piece), the pieces spread over the
// threads.
void BM_Populate(benchmark::State& state) {
  const size_t total = static_cast<size_t>(state.range(0)) * kMiB;
  const size_t piece = static_cast<size_t>(state.range(1)) * kMiB;
  const int threads = static_cast<int>(state.range(2));
  for (auto _ : state) {
    state.PauseTiming();
    uint8_t* base = Map(total, /*fresh=*/true);
    const std::vector<BufferEntry> entries = Pieces(base, total, piece);
    state.ResumeTiming();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (size_t i = t; i < entries.size(); i += threads) {
          if (madvise(entries[i].addr, entries[i].length,
                      MADV_POPULATE_WRITE) != 0) {
            std::abort();
          }
        }
      });
    }
    for (std::thread& th : pool) th.join();
    state.PauseTiming();
    munmap(base, total);
    state.ResumeTiming();
  }
  Report(state, total);
}

// 4 GiB by default: a KV cache's order of magnitude that fits this VM
// (64 GiB does not: registering pins, so the memory must exist);
// REGISTER_BENCH_MIB sets it (the smoke test's 64). Pieces of a quarter of
// it (1 GiB by default) and of 2 MiB (a block per hugepage: 2,048).
int64_t TotalMib() {
  const char* v = std::getenv("REGISTER_BENCH_MIB");
  const int64_t mib = v != nullptr ? std::atoll(v) : 0;
  return mib >= 8 ? mib : 4096;
}
void RegisterArgs(benchmark::internal::Benchmark* b) {
  const int64_t total = TotalMib();
  b->ArgNames({"total_mib", "piece_mib", "fresh"});
  for (int fresh : {1, 0}) {
    b->Args({total, total / 4, fresh});
    b->Args({total, 2, fresh});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);
}
void PopulateArgs(benchmark::internal::Benchmark* b) {
  const int64_t total = TotalMib();
  b->ArgNames({"total_mib", "piece_mib", "threads"});
  for (int threads : {1, 2}) {
    b->Args({total, total / 4, threads});
    b->Args({total, 2, threads});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);
}
BENCHMARK(BM_RegisterBatch)->Apply(RegisterArgs);
BENCHMARK(BM_RegisterOneByOne)->Apply(RegisterArgs);
BENCHMARK(BM_Populate)->Apply(PopulateArgs);

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
