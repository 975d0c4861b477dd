// Microbenchmarks of the key lookups on the submit path:
//   - local: MemoryRegistry::Acquire, the registered buffer (and with it
//     every transport's handle, e.g. the RDMA lkeys in LocalMr) that holds
//     a request's source, and Lease::Clone, the shortcut a request takes
//     when the previous request of its batch came from the same buffer;
//   - remote: SegmentView::FindBufferIndex + DeviceKey, the target buffer
//     and its rkey on one remote NIC.
// With 1, 64 and 4096 registered buffers and random addresses inside them.
// Every benchmark checks that it found the right buffer or key, and fails
// (SkipWithError) otherwise. //transport:hotpath_benchmark_test runs them
// briefly in CI.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "descriptor/descriptor.pb.h"
#include "transport/memory_registry.h"
#include "transport/segment_view.h"

namespace ferry {
namespace {

// Buffers are only address ranges to both indexes: no memory behind them.
constexpr uintptr_t kBase = uintptr_t{1} << 40;
constexpr uint64_t kBufferBytes = 1 << 20;
constexpr uint64_t kStride = 2 << 20;  // Gaps between buffers.
constexpr uint64_t kAccess = 4096;

struct Access {
  uint32_t buffer;
  uintptr_t addr;
};

// Random 4 KiB ranges inside random buffers; a power-of-two many, so the
// loop wraps with a mask.
std::vector<Access> RandomAccesses(size_t buffers, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Access> v(4096);
  for (Access& a : v) {
    a.buffer = static_cast<uint32_t>(rng() % buffers);
    a.addr = kBase + a.buffer * kStride + rng() % (kBufferBytes - kAccess);
  }
  return v;
}

void BM_RegistryAcquire(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  MemoryRegistry registry;
  for (size_t b = 0; b < n; ++b) {
    MemoryRegion r;
    r.addr = kBase + b * kStride;
    r.length = kBufferBytes;
    if (!registry.Add(r).ok()) {
      state.SkipWithError("Add failed");
      return;
    }
  }
  const std::vector<Access> accesses = RandomAccesses(n, 1);
  size_t i = 0;
  for (auto _ : state) {
    const Access& a = accesses[i++ & (accesses.size() - 1)];
    absl::StatusOr<MemoryRegistry::Lease> lease =
        registry.Acquire(a.addr, kAccess, /*need_remote=*/false);
    if (!lease.ok() || lease->region().addr != kBase + a.buffer * kStride) {
      state.SkipWithError("Acquire found no buffer or the wrong one");
      return;
    }
    benchmark::DoNotOptimize(lease->handle(0));
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_RegistryAcquire)->Arg(1)->Arg(64)->Arg(4096);

// Covers + Clone: what Prepare does instead of Acquire when a request lies
// in the buffer of the request before it (one atomic, no lock).
void BM_LeaseClone(benchmark::State& state) {
  MemoryRegistry registry;
  MemoryRegion r;
  r.addr = kBase;
  r.length = kBufferBytes;
  if (!registry.Add(r).ok()) {
    state.SkipWithError("Add failed");
    return;
  }
  {
    auto prev = registry.Acquire(kBase, kAccess, false);
    if (!prev.ok()) {
      state.SkipWithError("Acquire failed");
      return;
    }
    const std::vector<Access> accesses = RandomAccesses(1, 2);
    size_t i = 0;
    for (auto _ : state) {
      const Access& a = accesses[i++ & (accesses.size() - 1)];
      MemoryRegistry::Lease lease;
      if (prev->Covers(a.addr, kAccess)) lease = prev->Clone();
      if (!lease.held() || lease.region().addr != kBase) {
        state.SkipWithError("Clone did not lease the covering buffer");
        return;
      }
      benchmark::DoNotOptimize(lease.handle(0));
    }
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_LeaseClone);

// A target segment of `n` buffers, each with a key on every one of
// `devices` RDMA NICs; the key of buffer b on device d is b * devices + d
// + 1, so a lookup can be checked.
descriptor::SegmentDescriptor Descriptor(size_t n, int devices) {
  descriptor::SegmentDescriptor d;
  d.set_name("target");
  d.set_incarnation(1);
  auto* rdma = d.add_transports();
  rdma->set_transport("rdma");
  for (int k = 0; k < devices; ++k) {
    auto* dev = rdma->add_devices();
    dev->set_name(absl::StrCat("mlx5_", k));
    dev->set_gid(std::string(16, '\1'));
  }
  for (size_t b = 0; b < n; ++b) {
    auto* buf = d.add_buffers();
    buf->set_addr(kBase + b * kStride);
    buf->set_length(kBufferBytes);
    for (int k = 0; k < devices; ++k) {
      auto* key = buf->add_keys();
      key->set_nic(absl::StrCat("mlx5_", k));
      key->set_rkey(static_cast<uint32_t>(b * devices + k + 1));
    }
  }
  return d;
}

// The remote buffer holding a slice's range and its rkey on one of 8
// remote NICs (Prepare finds the buffer once per request; RouteRun reads
// the keys whenever the buffer changes).
void BM_SegmentViewKeyLookup(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  constexpr int kDevices = 8;
  auto view = SegmentView::Create(Descriptor(n, kDevices));
  if (!view.ok()) {
    state.SkipWithError(std::string(view.status().message()).c_str());
    return;
  }
  const SegmentView& v = **view;
  const int t = v.FindTransportIndex("rdma");
  const std::vector<Access> accesses = RandomAccesses(n, 3);
  size_t i = 0;
  for (auto _ : state) {
    const Access& a = accesses[i & (accesses.size() - 1)];
    const int device = static_cast<int>(i++ % kDevices);
    const int b = v.FindBufferIndex(a.addr, kAccess);
    uint32_t key = 0;
    if (b < 0 || !v.DeviceKey(t, b, device, &key) ||
        key != a.buffer * kDevices + device + 1) {
      state.SkipWithError("the lookup found the wrong buffer or key");
      return;
    }
    benchmark::DoNotOptimize(key);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SegmentViewKeyLookup)->Arg(1)->Arg(64)->Arg(4096);

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
