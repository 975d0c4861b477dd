// engine_bench: the cost of the engine itself (submit -> slice -> post ->
// poll -> status) for small WRITEs, with both segments in one process on a
// softrnic loopback device (no TCP hop), so neither a NIC nor a network is
// the limit. Google Benchmark; run on softrnic:
//   FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1
//     tools/softrnic-run bazel-bin/tools/engine_bench
// The counter `transfers/s` is what decides whether the engine would limit
// 8x400 Gbps at 64 KiB slices (about 6 million slices per second).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/transfer_engine.h"

namespace ferry {
namespace {

struct Setup {
  TransferEngine target, initiator;
  std::unique_ptr<uint8_t[]> remote, local;
  SegmentHandle seg = 0;
  static constexpr size_t kBytes = 16 << 20;

  // `wait_spin` zero: WaitBatch blocks at once and the NIC's worker thread
  // reaps every completion (a hand-off between two threads per batch).
  explicit Setup(absl::Duration wait_spin, const char* name) {
    EngineOptions t;
    t.local_segment_name = std::string(name) + "-target";
    t.transports = {"rdma"};
    t.wait_spin = wait_spin;
    if (!target.Init(t).ok()) std::abort();
    EngineOptions i = t;
    i.local_segment_name = std::string(name) + "-initiator";
    i.metadata_endpoint = target.metadata_address();
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
