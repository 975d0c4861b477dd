// Microbenchmarks of the RDMA transport's per-slice and per-run hot paths
// that need no NIC: rail selection (RailRouter), the endpoint store's SIEVE
// cache (lookup and eviction), and the per-run endpoint lookup (PeerTable
// by segment name, then the peer's rail). Every benchmark checks its
// results and fails (SkipWithError) on a wrong one, so a broken hot path
// cannot pass as a fast one. //transport/rdma:hotpath_benchmark_test runs
// them briefly in CI.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/endpoint_store.h"
#include "transport/rdma/peer.h"
#include "transport/rdma/rail_router.h"
#include "transport/rdma/sieve_cache.h"

namespace ferry::rdma {
namespace {

constexpr uint64_t kSliceBytes = 64 << 10;  // RdmaOptions::slice_bytes.

// Random indices in [0, n), a power-of-two many so the loop can wrap with
// a mask: the lookups then miss caches as a real mix of peers would,
// instead of hitting one hot entry.
std::vector<uint32_t> RandomIndices(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> pick(0, static_cast<uint32_t>(n - 1));
  std::vector<uint32_t> v(4096);
  for (auto& i : v) i = pick(rng);
  return v;
}

// One run of slices to one peer as SlicePath::RouteRun routes it: a
// fresh router per run (NIC states and the buffer's keys loaded), then
// Choose + Assign per slice. Args: local NICs, remote NICs, slices per run.
void BM_RailRouteRun(benchmark::State& state) {
  const int n_local = static_cast<int>(state.range(0));
  const int n_remote = static_cast<int>(state.range(1));
  const int run = static_cast<int>(state.range(2));
  // Half the NICs one topology tier away, as on a two-socket host.
  std::vector<int> tiers(n_local);
  for (int i = 0; i < n_local; ++i) tiers[i] = i < (n_local + 1) / 2 ? 0 : 1;
  uint64_t rotation = 0;
  std::vector<int> used(n_local);
  for (auto _ : state) {
    RailRouter router(n_local, n_remote, kSliceBytes, rotation++);
    for (int i = 0; i < n_local; ++i) router.SetNic(i, 0, true);
    for (int j = 0; j < n_remote; ++j) router.SetKey(j, 1000 + j);
    std::fill(used.begin(), used.end(), 0);
    for (int s = 0; s < run; ++s) {
      const int r = router.Choose(tiers, 0);
      if (r < 0 || r >= router.n_rails() ||
          router.key(router.remote_of(r)) < 0) {
        state.SkipWithError("Choose returned no rail or one without a key");
        return;
      }
      router.Assign(r, kSliceBytes);
      ++used[router.local_of(r)];
    }
    benchmark::DoNotOptimize(used.data());
    // The router's purpose: a run of at least four slices per NIC reaches
    // every local NIC (the tier charge is four slices).
    if (run >= 5 * n_local) {
      for (int u : used) {
        if (u == 0) {
          state.SkipWithError("a run did not stripe over every local NIC");
          return;
        }
      }
    }
  }
  state.SetItemsProcessed(state.iterations() * run);
}
BENCHMARK(BM_RailRouteRun)
    ->ArgNames({"local", "remote", "run"})
    ->Args({1, 1, 16})
    ->Args({2, 2, 16})
    ->Args({8, 8, 16})
    ->Args({8, 8, 64});

// SieveCache::Find hits among `n` cached entries, in random order.
void BM_SieveCacheFind(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  SieveCache<uint64_t, uint64_t> cache(n,
                                       [](const uint64_t&) { return false; });
  for (uint64_t k = 0; k < n; ++k) cache.Insert(k, k * 3 + 1);
  const std::vector<uint32_t> keys = RandomIndices(n, 1);
  size_t i = 0;
  for (auto _ : state) {
    const uint64_t k = keys[i++ & (keys.size() - 1)];
    const uint64_t* v = cache.Find(k);
    if (v == nullptr || *v != k * 3 + 1) {
      state.SkipWithError("Find missed or returned another key's value");
      return;
    }
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SieveCacheFind)->Arg(64)->Arg(4096);

// SieveCache::Insert of a new key into a full cache of `n`: one eviction
// per insert. A quarter of the entries are hit between inserts, so the
// hand has visited bits to clear and sweeps past them, as with a hot set.
void BM_SieveCacheInsertEvict(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  SieveCache<uint64_t, uint64_t> cache(n,
                                       [](const uint64_t&) { return false; });
  uint64_t next = 0;
  for (; next < n; ++next) cache.Insert(next, next);
  std::vector<uint64_t> evicted;
  for (auto _ : state) {
    cache.Find(next - 1 - (next % (n / 4 + 1)));
    evicted.clear();
    cache.Insert(next, next, &evicted);
    ++next;
    if (evicted.size() != 1 || cache.size() != n) {
      state.SkipWithError("a full cache did not evict exactly one entry");
      return;
    }
    benchmark::DoNotOptimize(evicted.data());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SieveCacheInsertEvict)->Arg(64)->Arg(4096);

std::shared_ptr<Endpoint> IdleEndpoint(uint64_t id) {
  // No peer, NIC or QPs: the store looks only at the id and the flags
  // (as endpoint_store_test.cc builds them).
  auto ep = std::make_shared<Endpoint>(id, nullptr, 1, 0, nullptr, "nic");
  MutexLock lock(&ep->mu);
  ep->SetStateLocked(Endpoint::State::kConnected);
  ep->confirmed.store(true);
  return ep;
}

// EndpointStore::Insert into a store full of idle endpoints (the bound,
// rdma.max_endpoints, is `n`): one eviction per insert, under the store's
// lock, with the `used` flags the data path sets read by the hand.
void BM_EndpointStoreInsertEvict(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  EndpointStore store(n);
  // Twice the bound, inserted round robin: FIFO order then always evicts
  // the one inserted n inserts ago, which is the next to come back.
  std::vector<std::shared_ptr<Endpoint>> pool;
  for (uint64_t id = 0; id < 2 * n; ++id) pool.push_back(IdleEndpoint(id));
  std::vector<std::shared_ptr<Endpoint>> evicted;
  for (size_t k = 0; k < n; ++k) store.Insert(pool[k], &evicted);
  size_t next = n;
  for (auto _ : state) {
    evicted.clear();
    store.Insert(pool[next++ % pool.size()], &evicted);
    if (evicted.size() != 1) {
      state.SkipWithError("a full store did not evict exactly one endpoint");
      return;
    }
  }
  if (store.live() != n) state.SkipWithError("the store left its bound");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_EndpointStoreInsertEvict)->Arg(64)->Arg(4096);

// The per-run endpoint lookup, part 1: PeerTable::Get of the target
// segment's record (RailLifecycle::PeerForView), among `n` known peers.
void BM_PeerTableGet(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  PeerTable table(n, [](const std::string& name) {
    return std::make_shared<Peer>(name, true, 1000000000);
  });
  std::vector<std::string> names;
  for (size_t k = 0; k < n; ++k) {
    names.push_back(absl::StrCat("10.0.", k / 256, ".", k % 256, ":12345"));
    table.Get(names.back());
  }
  const std::vector<uint32_t> order = RandomIndices(n, 2);
  size_t i = 0;
  for (auto _ : state) {
    const std::string& name = names[order[i++ & (order.size() - 1)]];
    PeerTable::PeerPtr peer = table.Get(name);
    if (peer == nullptr || peer->name() != name) {
      state.SkipWithError("Get returned another peer's record");
      return;
    }
    benchmark::DoNotOptimize(peer.get());
  }
  if (table.size() != n) state.SkipWithError("the table changed size");
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PeerTableGet)->Arg(1)->Arg(64)->Arg(1024);

// The per-run endpoint lookup, part 2: the rail's current endpoint under
// the peer's lock (RailLifecycle::RailEndpoint), among `local` x `remote`
// rails, each with a connected endpoint.
void BM_PeerRailLookup(benchmark::State& state) {
  const int n_local = static_cast<int>(state.range(0));
  const int n_remote = static_cast<int>(state.range(1));
  Peer peer("peer:1", true, 1000000000);
  std::vector<std::string> nics;
  for (int j = 0; j < n_remote; ++j) nics.push_back(absl::StrCat("mlx5_", j));
  uint64_t id = 0;
  {
    MutexLock lock(&peer.mu);
    for (int i = 0; i < n_local; ++i) {
      for (int j = 0; j < n_remote; ++j) {
        peer.GetRail(i, nics[j]).ep = IdleEndpoint(id++);
      }
    }
  }
  const std::vector<uint32_t> order =
      RandomIndices(static_cast<size_t>(n_local) * n_remote, 3);
  size_t i = 0;
  for (auto _ : state) {
    const uint32_t r = order[i++ & (order.size() - 1)];
    const int local = static_cast<int>(r / n_remote);
    const int remote = static_cast<int>(r % n_remote);
    std::shared_ptr<Endpoint> ep;
    {
      MutexLock lock(&peer.mu);
      Peer::Rail& rail = peer.GetRail(local, nics[remote]);
      if (rail.ep != nullptr &&
          rail.ep->state() == Endpoint::State::kConnected) {
        ep = rail.ep;
      }
    }
    if (ep == nullptr || ep->id() != r) {
      state.SkipWithError("the rail's endpoint was not found");
      return;
    }
    benchmark::DoNotOptimize(ep.get());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PeerRailLookup)
    ->ArgNames({"local", "remote"})
    ->Args({1, 1})
    ->Args({2, 2})
    ->Args({8, 8});

}  // namespace
}  // namespace ferry::rdma

BENCHMARK_MAIN();
