// Microbenchmarks of the engine's hot paths through its public API, with
// two engines in one process over loopback TCP (no NIC needed, so CI runs
// them: //engine:hotpath_benchmark_test):
//   - slicing: SubmitTransfer of one request cut into 1, 256 or 4096 slices.
//     The slicing (EngineImpl::SliceTask) is private, so this is the
//     smallest unit that runs it; the difference between the sizes is the
//     cost per slice (slicing plus the TCP transport's enqueue; the bytes
//     move on the transport's threads, outside the timed call);
//   - batch status polling: GetBatchStatus and GetTransferStatus of a batch
//     of 1, 128 or 4096 completed requests.
// Every benchmark checks the engine's answer (every request completed,
// every byte counted) and fails with SkipWithError otherwise.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "ferry/transfer_engine.h"

namespace ferry {
namespace {

constexpr size_t kBytes = 16 << 20;
// Small slices keep the bytes the benchmark moves (and the transport
// threads' share of the 2 cores) low; the cost of cutting a request does
// not depend on the slice size.
constexpr size_t kSliceBytes = 4096;

struct Setup {
  TransferEngine target, initiator;
  std::unique_ptr<uint8_t[]> remote, local;
  SegmentHandle seg = 0;

  Setup() {
    EngineOptions t;
    t.local_segment_name = "hotpath-target";
    t.listen_host = "127.0.0.1";
    t.transports = {"tcp"};
    if (!target.Init(t).ok()) std::abort();
    EngineOptions i = t;
    i.local_segment_name = "hotpath-initiator";
    i.metadata_endpoint = target.metadata_address();
    i.tcp.max_slice_bytes = kSliceBytes;
    if (!initiator.Init(i).ok()) std::abort();
    remote.reset(new uint8_t[kBytes]());
    local.reset(new uint8_t[kBytes]());
    if (!target.RegisterLocalMemory(remote.get(), kBytes).ok() ||
        !initiator.RegisterLocalMemory(local.get(), kBytes).ok()) {
      std::abort();
    }
    auto s = initiator.OpenSegment("hotpath-target");
    if (!s.ok()) std::abort();
    seg = *s;
  }

  TransferRequest Write(size_t offset, size_t length) const {
    TransferRequest r;
    r.opcode = OpCode::kWrite;
    r.source = local.get() + offset;
    r.target_id = seg;
    r.target_offset = reinterpret_cast<uint64_t>(remote.get()) + offset;
    r.length = length;
    return r;
  }
};

Setup& Engines() {
  static Setup* s = new Setup();
  return *s;
}

// SubmitTransfer of `requests` requests of `slices` slices each; only that
// call is timed (allocating, waiting and freeing are not). Read the CPU
// time column: the call ends with a hand-off to the TCP transport's event
// loop, whose sending can keep the caller off the CPU on 2 cores (wall
// time), and that wait is the transport's, not slicing work. Iterations
// are counted in wall time so that the runs stay short.
void BM_SubmitSlicing(benchmark::State& state) {
  Setup& s = Engines();
  const size_t requests = static_cast<size_t>(state.range(0));
  const size_t slices = static_cast<size_t>(state.range(1));
  const size_t length = slices * kSliceBytes;
  std::vector<TransferRequest> reqs;
  for (size_t k = 0; k < requests; ++k) {
    reqs.push_back(s.Write(k * length, length));
  }
  for (auto _ : state) {
    state.PauseTiming();
    auto id = s.initiator.AllocateBatch(requests);
    if (!id.ok()) {
      state.SkipWithError("AllocateBatch failed");
      return;
    }
    state.ResumeTiming();
    const absl::Status submitted = s.initiator.SubmitTransfer(*id, reqs);
    state.PauseTiming();
    auto st = s.initiator.WaitBatch(*id, absl::Seconds(10));
    if (!submitted.ok() || !st.ok() || st->state != TransferState::kCompleted ||
        st->transferred_bytes != requests * length) {
      state.SkipWithError("the sliced requests did not complete in full");
      return;
    }
    if (!s.initiator.FreeBatch(*id).ok()) {
      state.SkipWithError("FreeBatch failed");
      return;
    }
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * requests * slices);
}
// One request cut into 1, 256, 4096 slices; and 256 one-slice requests,
// as many slices without the cutting, for what a request costs besides.
BENCHMARK(BM_SubmitSlicing)
    ->ArgNames({"requests", "slices"})
    ->Args({1, 1})
    ->Args({1, 256})
    ->Args({1, 4096})
    ->Args({256, 1})
    ->UseRealTime();

// A batch of `n` completed 64-byte WRITEs, for the polling benchmarks.
class CompletedBatch {
 public:
  CompletedBatch(Setup& s, size_t n) : s_(s) {
    auto id = s.initiator.AllocateBatch(n);
    if (!id.ok()) return;
    id_ = *id;
    std::vector<TransferRequest> reqs;
    for (size_t k = 0; k < n; ++k) reqs.push_back(s.Write(k * 64, 64));
    if (!s.initiator.SubmitTransfer(id_, reqs).ok()) return;
    auto st = s.initiator.WaitBatch(id_, absl::Seconds(30));
    ok_ = st.ok() && st->state == TransferState::kCompleted;
  }
  ~CompletedBatch() {
    if (id_ != 0) (void)s_.initiator.FreeBatch(id_);
  }
  bool ok() const { return ok_; }
  BatchId id() const { return id_; }

 private:
  Setup& s_;
  BatchId id_ = 0;
  bool ok_ = false;
};

// GetBatchStatus: drive the transports' completions, lock the batch, sum
// up its n tasks. Items are tasks summarized.
void BM_GetBatchStatus(benchmark::State& state) {
  Setup& s = Engines();
  const size_t n = static_cast<size_t>(state.range(0));
  CompletedBatch batch(s, n);
  if (!batch.ok()) {
    state.SkipWithError("the batch did not complete");
    return;
  }
  for (auto _ : state) {
    auto st = s.initiator.GetBatchStatus(batch.id());
    if (!st.ok() || st->state != TransferState::kCompleted ||
        st->completed != n || st->transferred_bytes != n * 64) {
      state.SkipWithError("GetBatchStatus miscounted the batch");
      return;
    }
    benchmark::DoNotOptimize(*st);
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_GetBatchStatus)->Arg(1)->Arg(128)->Arg(4096);

// GetTransferStatus of each of the n tasks in turn (Mooncake's
// getTransferStatus loop). Items are tasks polled.
void BM_GetTransferStatus(benchmark::State& state) {
  Setup& s = Engines();
  const size_t n = static_cast<size_t>(state.range(0));
  CompletedBatch batch(s, n);
  if (!batch.ok()) {
    state.SkipWithError("the batch did not complete");
    return;
  }
  for (auto _ : state) {
    for (size_t k = 0; k < n; ++k) {
      auto st = s.initiator.GetTransferStatus(batch.id(), k);
      if (!st.ok() || st->state != TransferState::kCompleted ||
          st->transferred_bytes != 64) {
        state.SkipWithError("GetTransferStatus misreported a task");
        return;
      }
      benchmark::DoNotOptimize(*st);
    }
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_GetTransferStatus)->Arg(1)->Arg(128)->Arg(4096);

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
