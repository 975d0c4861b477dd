// metadata_bench: the metadata plane's costs, Google Benchmark.
//   - registering n buffers with an engine, one RegisterLocalMemory call
//     each or one RegisterLocalMemoryBatch, including their publication in
//     the metadata service (the engine's embedded one, over gRPC on
//     loopback): what a KV-cache store pays at start-up for its blocks.
//     TCP transport, so no NIC registration is measured;
//     Second argument: 0 the embedded (in-memory) service, 1 a standalone
//     service with the durable store (an fdatasync per change, in
//     $TMPDIR), 2 etcd directly (METADATA_BENCH_ETCD=etcd://host:port);
//   - GetSegment from 1 and 64 concurrent clients (each its own channel)
//     against the metadata service the standalone metadata_server runs
//     (MetadataServiceImpl behind RpcServer, here in-process on loopback),
//     for a segment of 16 or 1,024 buffers: calls/s and the clients' p50 and
//     p99 latency. Second argument: 0 in-memory store, 1 durable, 2 etcd
//     (the server's store is etcd at METADATA_BENCH_ETCD).
//   bazel run -c opt //bench:metadata_bench
#include <stdlib.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "ferry/transfer_engine.h"
#include "metadata/address/metadata_address.h"
#include "metadata/durable_store.h"
#include "metadata/etcd/etcd_store.h"
#include "metadata/metadata_client.h"
#include "metadata/metadata_service.h"
#include "metadata/rpc_server.h"
#include "metadata/segment_store.h"

namespace ferry {
namespace {

constexpr size_t kBufferBytes = 4096;
int g_prefix = 0;  // Key prefixes and namespaces, fresh per run.

std::string EtcdAddress() {
  const char* e = std::getenv("METADATA_BENCH_ETCD");
  return e != nullptr ? e : "";
}

// Backend 2 (etcd) runs only against a running etcd.
bool BackendAvailable(benchmark::State& state) {
  if (state.range(1) == 2 && EtcdAddress().empty()) {
    state.SkipWithError("etcd: set METADATA_BENCH_ETCD=etcd://host:port");
    return false;
  }
  return true;
}

// The server, shared by the threads of one benchmark run.
struct Server {
  std::unique_ptr<metadata::Store> store;
  std::unique_ptr<metadata::MetadataServiceImpl> service;
  std::unique_ptr<metadata::RpcServer> rpc;
  // Backend 0: in memory; 1: durable, its files in a fresh directory;
  // 2: etcd at $METADATA_BENCH_ETCD, under a fresh key prefix.
  Server(int buffers, int backend) {
    if (backend == 2) {
      auto a = metadata::ParseMetadataAddress(EtcdAddress());
      if (!a.ok() || a->kind != metadata::MetadataAddress::Kind::kEtcd) {
        std::abort();
      }
      metadata::EtcdOptions o;
      o.endpoints = a->endpoints;
      o.prefix =
          absl::StrCat("metadata-bench-", getpid(), "-", ++g_prefix, "/");
      auto e = metadata::EtcdStore::Create(o);
      if (!e.ok()) std::abort();
      store = std::move(*e);
    } else if (backend == 1) {
      const char* tmp = std::getenv("TMPDIR");
      std::string dir =
          std::string(tmp != nullptr ? tmp : "/tmp") + "/metadata_bench-XXXXXX";
      if (mkdtemp(dir.data()) == nullptr) std::abort();
      auto d = metadata::DurableStore::Open(dir);
      if (!d.ok()) std::abort();
      store = std::move(*d);
    } else {
      store = std::make_unique<metadata::SegmentStore>();
    }
    service = std::make_unique<metadata::MetadataServiceImpl>(store.get());
    auto s = metadata::RpcServer::Start("127.0.0.1:0", {service.get()});
    if (!s.ok()) std::abort();
    rpc = std::move(*s);
    if (buffers < 0) return;  // No segment of its own.
    descriptor::SegmentDescriptor d;
    d.set_name("bench");
    d.set_incarnation(1);
    d.set_rpc_address("127.0.0.1:1");
    descriptor::TransportEndpoint* t = d.add_transports();
    t->set_transport("rdma");
    for (int n = 0; n < 2; ++n) {
      descriptor::Device* dev = t->add_devices();
      dev->set_name("mlx5_" + std::to_string(n));
      dev->set_gid(std::string(16, '\1'));
    }
    for (int i = 0; i < buffers; ++i) {
      descriptor::Buffer* b = d.add_buffers();
      b->set_addr(0x10000000ull + uint64_t(i) * 0x100000);
      b->set_length(0x100000);
      b->set_location("cpu:0");
      for (int n = 0; n < 2; ++n) {
        descriptor::NicKey* k = b->add_keys();
        k->set_nic("mlx5_" + std::to_string(n));
        k->set_rkey(1000 + i);
      }
    }
    metadata::MetadataClient c(rpc->address(), absl::Seconds(5));
    metadata::PutSegmentRequest put;
    *put.mutable_segment() = d;
    put.set_owner_key(metadata::NewOwnerKey());
    if (!c.Put(put).ok()) std::abort();
  }
  ~Server() { rpc->Shutdown(); }
};
struct Setup {
  std::unique_ptr<Server> server;  // Standalone durable service, or none.
  TransferEngine engine;
  std::unique_ptr<uint8_t[]> memory;
  // Backend 0: the embedded service; 1: a standalone one over the durable
  // store; 2: etcd directly (engine metadata etcd://...).
  Setup(size_t n, int backend) : memory(new uint8_t[n * 2 * kBufferBytes]()) {
    EngineOptions o;
    if (backend == 1) {
      server = std::make_unique<Server>(-1, 1);
      o.metadata_endpoint = server->rpc->address();
    } else if (backend == 2) {
      o.metadata_endpoint = EtcdAddress();
      o.metadata_namespace = absl::StrCat("bench-", getpid(), "-", ++g_prefix);
    }
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
  if (!BackendAvailable(state)) return;
  Setup s(n, static_cast<int>(state.range(1)));
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
  if (!BackendAvailable(state)) return;
  Setup s(n, static_cast<int>(state.range(1)));
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
    ->ArgsProduct({{100, 1000, 10000}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_RegisterBatch)
    ->ArgsProduct({{100, 1000, 10000}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

Server* g_server = nullptr;

void BM_GetSegment(benchmark::State& state) {
  if (!BackendAvailable(state)) return;
  if (state.thread_index() == 0) {
    delete g_server;  // The previous run's; its threads are done.
    g_server = new Server(static_cast<int>(state.range(0)),
                          static_cast<int>(state.range(1)));
  }
  // Thread 0 made the server before any thread enters the loop (the
  // library starts them together); each thread has its own channel.
  std::unique_ptr<metadata::MetadataClient> client;
  std::vector<double> us;
  for (auto _ : state) {
    if (client == nullptr) {
      state.PauseTiming();
      client = std::make_unique<metadata::MetadataClient>(
          g_server->rpc->address(), absl::Seconds(5));
      state.ResumeTiming();
    }
    const absl::Time t0 = absl::Now();
    if (!client->Get("bench").ok()) std::abort();
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  std::sort(us.begin(), us.end());
  state.counters["p50_us"] =
      benchmark::Counter(us[us.size() / 2], benchmark::Counter::kAvgThreads);
  state.counters["p99_us"] = benchmark::Counter(
      us[us.size() * 99 / 100], benchmark::Counter::kAvgThreads);
  state.counters["calls/s"] = benchmark::Counter(static_cast<double>(us.size()),
                                                 benchmark::Counter::kIsRate);
  if (state.thread_index() == 0) {
    // The others are past the loop's end barrier: no call is in flight.
    client.reset();
  }
}
BENCHMARK(BM_GetSegment)
    ->ArgsProduct({{16, 1024}, {0, 1, 2}})
    ->Threads(1)
    ->Threads(64)
    ->UseRealTime();

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
