// engine_bench: the cost of the engine itself (submit -> slice -> post ->
// poll -> status) for small WRITEs, with both segments in one process on a
// softrnic loopback device (no TCP hop), so neither a NIC nor a network is
// the limit. Google Benchmark; run on softrnic:
//   FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1
//     tools/softrnic-run bazel-bin/bench/engine_bench
// The counter `transfers/s` is what decides whether the engine would limit
// 8x400 Gbps at 64 KiB slices (about 6 million slices per second).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "ferry/transfer_engine.h"

namespace ferry {
namespace {

// Lines of /proc/self/maps: softrnic's registration reads that file, so
// its cost grows with the process's mappings.
double MapsLines() {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return 0;
  double n = 0;
  for (int c; (c = std::fgetc(f)) != EOF;) n += c == '\n';
  std::fclose(f);
  return n;
}

struct Setup {
  TransferEngine target, initiator;
  std::unique_ptr<uint8_t[]> remote, local;
  SegmentHandle seg = 0;
  static constexpr size_t kBytes = 16 << 20;

  // `wait_spin` zero: WaitBatch blocks at once and the NIC's worker thread
  // reaps every completion (a hand-off between two threads per batch).
  // `mr_cache_bytes`: the initiator's (EngineOptions::mr_cache_bytes).
  explicit Setup(absl::Duration wait_spin, const char* name,
                 size_t mr_cache_bytes = 0) {
    EngineOptions t;
    t.local_segment_name = std::string(name) + "-target";
    t.transports = {"rdma"};
    t.wait_spin = wait_spin;
    if (!target.Init(t).ok()) std::abort();
    EngineOptions i = t;
    i.local_segment_name = std::string(name) + "-initiator";
    i.metadata_endpoint = target.metadata_address();
    i.mr_cache_bytes = mr_cache_bytes;
    if (!initiator.Init(i).ok()) std::abort();
    remote.reset(new uint8_t[kBytes]());
    local.reset(new uint8_t[kBytes]());
    if (!target.RegisterLocalMemory(remote.get(), kBytes).ok() ||
        !initiator.RegisterLocalMemory(local.get(), kBytes).ok()) {
      std::abort();
    }
    seg = *initiator.OpenSegment(std::string(name) + "-target");
  }
};

// One batch of `batch` WRITEs of `size` bytes: allocate, submit, wait, free.
void Run(benchmark::State& state, Setup& s) {
  const size_t size = static_cast<size_t>(state.range(0));
  const size_t batch = static_cast<size_t>(state.range(1));
  std::vector<TransferRequest> reqs(batch);
  for (size_t k = 0; k < batch; ++k) {
    reqs[k].opcode = OpCode::kWrite;
    reqs[k].source = s.local.get() + k * size;
    reqs[k].target_id = s.seg;
    reqs[k].target_offset =
        reinterpret_cast<uint64_t>(s.remote.get()) + k * size;
    reqs[k].length = size;
  }
  for (auto _ : state) {
    auto id = s.initiator.AllocateBatch(batch);
    if (!s.initiator.SubmitTransfer(*id, reqs).ok()) {
      state.SkipWithError("submit failed");
      break;
    }
    auto st = s.initiator.WaitBatch(*id, absl::Seconds(10));
    if (!st.ok() || st->state != TransferState::kCompleted) {
      state.SkipWithError("transfer failed");
      break;
    }
    (void)s.initiator.FreeBatch(*id);
  }
  state.counters["transfers/s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * batch),
                         benchmark::Counter::kIsRate);
  state.SetBytesProcessed(
      static_cast<int64_t>(state.iterations() * batch * size));
}
Setup& RunToCompletion() {
  static Setup* s = new Setup(absl::Microseconds(50), "rtc");
  return *s;
}

// Run to completion: the waiting application thread reaps its completions
// itself (the default), so one thread does all of the work.
void BM_EngineWrite(benchmark::State& state) { Run(state, RunToCompletion()); }
BENCHMARK(BM_EngineWrite)
    ->Args({64, 1})
    ->Args({64, 64})
    ->Args({64, 512})
    ->Args({65536, 64})
    ->UseRealTime();

// The NIC's worker thread reaps the completions; the application thread
// submits (and posts) and sleeps in WaitBatch.
void BM_EngineWriteWorkerCompletes(benchmark::State& state) {
  static Setup* s = new Setup(absl::ZeroDuration(), "worker");
  Run(state, *s);
}
BENCHMARK(BM_EngineWriteWorkerCompletes)
    ->Args({64, 1})
    ->Args({64, 512})
    ->UseRealTime();

// The reference for the 64 KiB case, in the same run: the same bytes
// memcpy'd between the same two buffers.
void BM_Memcpy(benchmark::State& state) {
  Setup& s = RunToCompletion();
  const size_t size = static_cast<size_t>(state.range(0));
  const size_t batch = static_cast<size_t>(state.range(1));
  for (auto _ : state) {
    for (size_t k = 0; k < batch; ++k) {
      std::memcpy(s.remote.get() + k * size, s.local.get() + k * size, size);
    }
    benchmark::ClobberMemory();
  }
  state.counters["transfers/s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * batch),
                         benchmark::Counter::kIsRate);
  state.SetBytesProcessed(
      static_cast<int64_t>(state.iterations() * batch * size));
}
BENCHMARK(BM_Memcpy)->Args({65536, 64})->UseRealTime();

// An anonymous mapping of `size` bytes, faulted in (so that registering it
// never waits for the page allocator); nullptr if mmap fails.
uint8_t* MapFaulted(size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::memset(p, 1, size);
  return static_cast<uint8_t*>(p);
}

// One WRITE of `size` bytes from `src` to the start of the target's buffer.
bool WriteOnce(Setup& s, uint8_t* src, size_t size) {
  TransferRequest r;
  r.opcode = OpCode::kWrite;
  r.source = src;
  r.target_id = s.seg;
  r.target_offset = reinterpret_cast<uint64_t>(s.remote.get());
  r.length = size;
  auto id = s.initiator.AllocateBatch(1);
  if (!id.ok()) return false;
  const bool ok = s.initiator.SubmitTransfer(*id, {r}).ok();
  auto st = ok ? s.initiator.WaitBatch(*id, absl::Seconds(10))
               : absl::StatusOr<BatchStatus>(absl::CancelledError());
  (void)s.initiator.FreeBatch(*id);
  return st.ok() && st->state == TransferState::kCompleted;
}

// The initiator with an MR cache of 256 MiB (EngineOptions::mr_cache_bytes).
Setup& WithCache() {
  static Setup* s = new Setup(absl::Microseconds(50), "cache", 256 << 20);
  return *s;
}

// One WRITE of `size` bytes (range 0) from a source that was not
// registered up front, by `mode` (range 1):
//   0 registered up front, cache off: the floor, as BM_EngineWrite;
//   1 cache hit: the same mapping every iteration (the first misses);
//   2 cache miss: a fresh mapping (faulted in) every iteration, unmapped
//     after the WRITE: the hook invalidates, so each iteration drops the
//     previous cover and registers a new one;
//   3 by hand, cache off: a fresh mapping, RegisterLocalMemory (not
//     remote-accessible), the WRITE, UnregisterLocalMemory, munmap;
//   4 reference: a fresh mapping faulted in and unmapped, no transfer.
// Counters: invalidations per iteration and the registrations cached at
// the end (the cache's, from GetEngineStats), and maps_lines (softrnic's
// registration reads /proc/self/maps).
void BM_EngineWriteUnregisteredSource(benchmark::State& state) {
  const size_t size = static_cast<size_t>(state.range(0));
  const int mode = static_cast<int>(state.range(1));
  Setup& s = mode == 1 || mode == 2 ? WithCache() : RunToCompletion();
  uint8_t* kept = mode == 1 ? MapFaulted(size) : nullptr;
  if (mode == 1 && kept == nullptr) {
    state.SkipWithError("mmap failed");
    return;
  }
  const EngineStats before = s.initiator.GetEngineStats();
  for (auto _ : state) {
    bool ok = true;
    uint8_t* p = nullptr;
    switch (mode) {
      case 0:
        ok = WriteOnce(s, s.local.get(), size);
        break;
      case 1:
        ok = WriteOnce(s, kept, size);
        break;
      case 2:
        ok = (p = MapFaulted(size)) != nullptr && WriteOnce(s, p, size);
        break;
      case 3:
        ok = (p = MapFaulted(size)) != nullptr &&
             s.initiator.RegisterLocalMemory(p, size, "*", false).ok() &&
             WriteOnce(s, p, size) && s.initiator.UnregisterLocalMemory(p).ok();
        break;
      default:
        ok = (p = MapFaulted(size)) != nullptr;
        break;
    }
    if (p != nullptr) ::munmap(p, size);
    if (!ok) {
      state.SkipWithError("mmap, registration or transfer failed");
      break;
    }
  }
  const EngineStats after = s.initiator.GetEngineStats();
  const double n =
      static_cast<double>(std::max<int64_t>(state.iterations(), 1));
  state.counters["invalidations/iter"] =
      static_cast<double>(after.mr_cache_invalidations -
                          before.mr_cache_invalidations) /
      n;
  // A gauge (registrations held now), not a count of registrations made:
  // a miss shows as an invalidation of the replaced mapping instead.
  state.counters["cached_registrations"] =
      static_cast<double>(after.mr_cache_registrations);
  state.counters["maps_lines"] = MapsLines();
  if (kept != nullptr) ::munmap(kept, size);
}
BENCHMARK(BM_EngineWriteUnregisteredSource)
    ->ArgNames({"size", "mode"})
    ->ArgsProduct({{4096, 65536, 1 << 20, 16 << 20}, {0, 1, 2, 3, 4}})
    ->UseRealTime();

// A working set of eight 1 MiB mappings written round robin (one WRITE
// per iteration), with an MR cache of range(0) MiB: 8 holds them all (hits
// after the first round); 4 is LRU over a cycle larger than the cache, so
// every access misses. Counter: evictions per iteration.
void BM_EngineWriteCacheWorkingSet(benchmark::State& state) {
  constexpr int kSources = 8;
  constexpr size_t kSize = 1 << 20;
  const size_t budget = static_cast<size_t>(state.range(0)) << 20;
  static auto* setups = new std::map<size_t, Setup*>();
  Setup*& s = (*setups)[budget];
  if (s == nullptr) {
    s = new Setup(absl::Microseconds(50),
                  ("ws" + std::to_string(state.range(0))).c_str(), budget);
  }
  uint8_t* src[kSources];
  for (auto& p : src) {
    p = MapFaulted(kSize);
    if (p == nullptr) {
      state.SkipWithError("mmap failed");
      return;
    }
  }
  const EngineStats before = s->initiator.GetEngineStats();
  int64_t i = 0;
  for (auto _ : state) {
    if (!WriteOnce(*s, src[i++ % kSources], kSize)) {
      state.SkipWithError("transfer failed");
      break;
    }
  }
  const EngineStats after = s->initiator.GetEngineStats();
  state.counters["evictions/iter"] =
      static_cast<double>(after.mr_cache_evictions -
                          before.mr_cache_evictions) /
      static_cast<double>(std::max<int64_t>(state.iterations(), 1));
  for (uint8_t* p : src) ::munmap(p, kSize);
}
BENCHMARK(BM_EngineWriteCacheWorkingSet)
    ->ArgName("budget_mib")
    ->Arg(8)
    ->Arg(4)
    ->UseRealTime();

// The reference for the hand-off's cost: one cache line bounced between
// two threads and back (each round trip moves it twice).
void BM_CrossThreadRoundTrip(benchmark::State& state) {
  std::atomic<int> turn{0};
  std::atomic<bool> stop{false};
  std::thread other([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      if (turn.load(std::memory_order_acquire) == 1) {
        turn.store(0, std::memory_order_release);
      }
    }
  });
  for (auto _ : state) {
    turn.store(1, std::memory_order_release);
    while (turn.load(std::memory_order_acquire) != 0) {
    }
  }
  stop.store(true);
  other.join();
}
BENCHMARK(BM_CrossThreadRoundTrip)->UseRealTime();

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
