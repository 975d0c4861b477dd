// engine_bench: the cost of the engine itself (submit -> slice -> post ->
// poll -> status) for small WRITEs, with both segments in one process on a
// softrnic loopback device (no TCP hop), so neither a NIC nor a network is
// the limit. Google Benchmark; run on softrnic:
//   FERRY_SOFTRNIC_DEVICES=softrnic0=127.0.0.1
//     tools/softrnic-run bazel-bin/tools/engine_bench
// The counter `transfers/s` is what decides whether the engine would limit
// 8x400 Gbps at 64 KiB slices (about 6 million slices per second).
#include <cstdlib>
#include <memory>
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

  Setup() {
    EngineOptions t;
    t.local_segment_name = "bench-target";
    t.transports = {"rdma"};
    if (!target.Init(t).ok()) std::abort();
    EngineOptions i = t;
    i.local_segment_name = "bench-initiator";
    i.metadata_endpoint = target.metadata_address();
    if (!initiator.Init(i).ok()) std::abort();
    remote.reset(new uint8_t[kBytes]());
    local.reset(new uint8_t[kBytes]());
    if (!target.RegisterLocalMemory(remote.get(), kBytes).ok() ||
        !initiator.RegisterLocalMemory(local.get(), kBytes).ok()) {
      std::abort();
    }
    seg = *initiator.OpenSegment("bench-target");
  }
};

Setup& Shared() {
  static Setup* s = new Setup();
  return *s;
}

// One batch of `batch` WRITEs of `size` bytes: allocate, submit, wait, free.
void BM_EngineWrite(benchmark::State& state) {
  Setup& s = Shared();
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
BENCHMARK(BM_EngineWrite)
    ->Args({64, 1})
    ->Args({64, 64})
    ->Args({64, 512})
    ->Args({65536, 64})
    ->UseRealTime();

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
