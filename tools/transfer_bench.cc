// transfer_bench: measures Ferry transfers between two engines. Flags follow
// Mooncake TE's transfer_engine_bench so existing scripts carry over.
//
//   target:    transfer_bench --mode=target --local_server_name=target
//   initiator: transfer_bench --mode=initiator --metadata_server=H:P
//                  --segment_id=target --operation=write --block_size=1048576
//   local:     transfer_bench --mode=local   (both in one process; the demo)
//
// Each initiator thread loops: allocate batch -> submit batch_size requests
// of block_size -> WaitBatch -> free. Latency figures are per batch (submit
// to the last completion); with --batch_size=1 they are per request.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/mutex.h"
#include "engine/transfer_engine.h"
#include "tools/pattern.h"

ABSL_FLAG(std::string, mode, "local", "target | initiator | local");
ABSL_FLAG(std::string, metadata_server, "embedded",
          "\"embedded\" or host:port of a metadata service");
ABSL_FLAG(std::string, local_server_name, "",
          "this engine's segment name (default: target/initiator)");
ABSL_FLAG(std::string, segment_id, "target", "segment name of the target");
ABSL_FLAG(std::string, listen_host, "127.0.0.1", "address to listen on");
ABSL_FLAG(int, rpc_port, 0, "port of this engine's gRPC server (0: any)");
ABSL_FLAG(std::string, protocol, "tcp", "tcp | rdma");
ABSL_FLAG(std::string, operation, "write", "read | write");
ABSL_FLAG(uint64_t, block_size, 65536, "bytes per request");
ABSL_FLAG(int, batch_size, 16, "requests per batch");
ABSL_FLAG(int, threads, 1, "initiator threads");
ABSL_FLAG(double, duration, 5, "seconds to run the initiator");
ABSL_FLAG(double, warmup, 0,
          "seconds to run before measuring (like iperf3 -O)");
ABSL_FLAG(uint64_t, buffer_size, 1ull << 30, "bytes registered on each side");
ABSL_FLAG(bool, verify, false,
          "check every byte moved (READ: against the target's pattern; "
          "WRITE: read back and compare)");
ABSL_FLAG(std::string, report, "text", "text | json (last line)");
ABSL_FLAG(int, tcp_connections, 1, "TCP connections per peer");
ABSL_FLAG(uint64_t, tcp_slice_bytes, 4 << 20, "TCP transport slice size");
ABSL_FLAG(std::string, device_name, "",
          "RDMA devices to use, comma-separated (empty: every active one)");
ABSL_FLAG(uint64_t, rdma_slice_bytes, 64 << 10, "RDMA transport slice size");
ABSL_FLAG(int, qps_per_endpoint, 2, "RDMA QPs per (local, remote NIC) pair");
ABSL_FLAG(double, target_seconds, 0,
          "target mode: exit after this long (0: run until SIGINT/SIGTERM)");

namespace ferry {
namespace {

constexpr uint64_t kTargetSeed = 0x7a7a7a7a;

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

[[noreturn]] void Die(const absl::Status& s, const std::string& what) {
  std::fprintf(stderr, "transfer_bench: %s: %s\n", what.c_str(),
               s.ToString().c_str());
  std::exit(1);
}

struct ThreadStats {
  Mutex mu;
  std::vector<double> batch_us ABSL_GUARDED_BY(mu);
};

struct Totals {
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> transfers{0};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> failed_batches{0};
  std::atomic<uint64_t> verify_failures{0};
};

void* AllocBuffer(size_t size) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, size) != 0) {
    Die(absl::ResourceExhaustedError("posix_memalign"), "allocating buffer");
  }
  return p;
}

EngineOptions BaseOptions(const std::string& name, const std::string& md) {
  EngineOptions o;
  o.local_segment_name = name;
  o.metadata_endpoint = md;
  o.listen_host = absl::GetFlag(FLAGS_listen_host);
  o.transports = {absl::GetFlag(FLAGS_protocol)};
  o.tcp.connections_per_peer = absl::GetFlag(FLAGS_tcp_connections);
  o.tcp.max_slice_bytes = absl::GetFlag(FLAGS_tcp_slice_bytes);
  if (const std::string d = absl::GetFlag(FLAGS_device_name); !d.empty()) {
    o.rdma.devices = absl::StrSplit(d, ',', absl::SkipEmpty());
  }
  o.rdma.slice_bytes = absl::GetFlag(FLAGS_rdma_slice_bytes);
  o.rdma.qps_per_endpoint = absl::GetFlag(FLAGS_qps_per_endpoint);
  return o;
}

// Registers a target buffer filled with the pattern READs are checked with.
void* SetUpTarget(TransferEngine& engine, size_t size) {
  auto* buf = static_cast<uint8_t*>(AllocBuffer(size));
  FillPattern(buf, size, 0, kTargetSeed);
  if (absl::Status s = engine.RegisterLocalMemory(buf, size, "cpu:0", true);
      !s.ok()) {
    Die(s, "registering target buffer");
  }
  return buf;
}

void InitiatorThread(TransferEngine& engine, SegmentHandle seg, uint8_t* local,
                     uint64_t remote_base, size_t region, int tid,
                     absl::Time measure_from, absl::Time end, Totals* totals,
                     ThreadStats* stats) {
  const bool write = absl::GetFlag(FLAGS_operation) == "write";
  const bool verify = absl::GetFlag(FLAGS_verify);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  const size_t batch_size = absl::GetFlag(FLAGS_batch_size);
  const size_t per_batch = block * batch_size;
  const size_t batches_in_region = std::max<size_t>(1, region / per_batch);
  const size_t base = static_cast<size_t>(tid) * region;
  std::vector<TransferRequest> reqs(batch_size);
  uint64_t iter = 0;
  while (absl::Now() < end && !g_stop.load()) {
    const size_t off = base + (iter % batches_in_region) * per_batch;
    const uint64_t seed = Mix64((static_cast<uint64_t>(tid) << 40) ^ iter);
    if (write && verify) FillPattern(local + off, per_batch, off, seed);
    for (size_t i = 0; i < batch_size; ++i) {
      reqs[i].opcode = write ? OpCode::kWrite : OpCode::kRead;
      reqs[i].source = local + off + i * block;
      reqs[i].target_id = seg;
      reqs[i].target_offset = remote_base + off + i * block;
      reqs[i].length = block;
    }
    absl::Time start = absl::Now();
    auto batch = engine.AllocateBatch(batch_size);
    if (!batch.ok()) Die(batch.status(), "AllocateBatch");
    if (absl::Status s = engine.SubmitTransfer(*batch, reqs); !s.ok()) {
      Die(s, "SubmitTransfer");
    }
    auto st = engine.WaitBatch(*batch, absl::Seconds(60));
    if (!st.ok()) Die(st.status(), "WaitBatch");
    double us = absl::ToDoubleMicroseconds(absl::Now() - start);
    if (absl::Status s = engine.FreeBatch(*batch); !s.ok()) Die(s, "FreeBatch");
    const bool measured = start >= measure_from;
    if (measured) totals->bytes.fetch_add(st->transferred_bytes);
    if (measured) totals->transfers.fetch_add(st->completed);
    totals->errors.fetch_add(st->failed);
    if (st->failed > 0 && totals->failed_batches.fetch_add(1) < 3) {
      std::fprintf(stderr, "transfer failed: %s\n",
                   st->first_error.ToString().c_str());
    }
    if (measured) {
      MutexLock lock(&stats->mu);
      stats->batch_us.push_back(us);
    }
    if (verify && st->failed == 0) {
      if (write) {
        // Read the same range back into the next region and compare.
        std::vector<uint8_t> back(per_batch);
        for (size_t i = 0; i < batch_size; ++i) {
          reqs[i].opcode = OpCode::kRead;
          reqs[i].source = local + off + i * block;
        }
        std::memset(local + off, 0, per_batch);
        auto vb = engine.AllocateBatch(batch_size);
        if (!vb.ok()) Die(vb.status(), "AllocateBatch");
        if (absl::Status s = engine.SubmitTransfer(*vb, reqs); !s.ok()) {
          Die(s, "SubmitTransfer (verify)");
        }
        auto vs = engine.WaitBatch(*vb, absl::Seconds(60));
        if (!vs.ok() || vs->failed > 0) totals->verify_failures.fetch_add(1);
        engine.FreeBatch(*vb).IgnoreError();
        if (CheckPattern(local + off, per_batch, off, seed) != per_batch) {
          totals->verify_failures.fetch_add(1);
        }
      } else if (CheckPattern(local + off, per_batch, off, kTargetSeed) !=
                 per_batch) {
        totals->verify_failures.fetch_add(1);
      }
    }
    ++iter;
  }
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  size_t k = static_cast<size_t>(p * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

int RunInitiator(TransferEngine& engine) {
  const size_t buffer = absl::GetFlag(FLAGS_buffer_size);
  const int threads = absl::GetFlag(FLAGS_threads);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  const int batch_size = absl::GetFlag(FLAGS_batch_size);
  if (threads < 1 || batch_size < 1 || block == 0) {
    Die(absl::InvalidArgumentError("threads, batch_size and block_size must "
                                   "be positive"),
        "flags");
  }
  const size_t region = buffer / static_cast<size_t>(threads);
  if (region < block * static_cast<size_t>(batch_size)) {
    Die(absl::InvalidArgumentError(
            absl::StrCat("buffer_size ", buffer, " is too small for ", threads,
                         " thread(s) x batch_size x block_size")),
        "flags");
  }
  auto seg = engine.OpenSegment(absl::GetFlag(FLAGS_segment_id));
  if (!seg.ok()) Die(seg.status(), "OpenSegment");
  auto bufs = engine.GetSegmentBuffers(*seg);
  if (!bufs.ok()) Die(bufs.status(), "GetSegmentBuffers");
  if (bufs->empty() || bufs->front().length < buffer) {
    Die(absl::FailedPreconditionError(
            "target has no remote-accessible buffer of buffer_size bytes "
            "(start the target with the same --buffer_size)"),
        "target");
  }
  auto* local = static_cast<uint8_t*>(AllocBuffer(buffer));
  std::memset(local, 0, buffer);
  if (absl::Status s =
          engine.RegisterLocalMemory(local, buffer, "cpu:0", false);
      !s.ok()) {
    Die(s, "registering local buffer");
  }
  Totals totals;
  std::vector<ThreadStats> stats(static_cast<size_t>(threads));
  const absl::Time start =
      absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_warmup));
  const absl::Time end = start + absl::Seconds(absl::GetFlag(FLAGS_duration));
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back(InitiatorThread, std::ref(engine), *seg, local,
                         bufs->front().addr, region, t, start, end, &totals,
                         &stats[static_cast<size_t>(t)]);
  }
  const bool json = absl::GetFlag(FLAGS_report) == "json";
  absl::SleepFor(start - absl::Now());
  uint64_t last_bytes = totals.bytes.load();
  absl::Time last = absl::Now();
  while (absl::Now() < end && !g_stop.load()) {
    absl::SleepFor(std::min(absl::Seconds(1), end - absl::Now()));
    absl::Time now = absl::Now();
    uint64_t bytes = totals.bytes.load();
    std::fprintf(json ? stderr : stdout,
                 "[%5.1fs] %8.3f GB/s  %llu transfers  %llu errors\n",
                 absl::ToDoubleSeconds(now - start),
                 static_cast<double>(bytes - last_bytes) /
                     absl::ToDoubleSeconds(now - last) / 1e9,
                 static_cast<unsigned long long>(totals.transfers.load()),
                 static_cast<unsigned long long>(totals.errors.load()));
    std::fflush(json ? stderr : stdout);
    last_bytes = bytes;
    last = now;
  }
  for (auto& w : workers) w.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::vector<double> lat;
  for (auto& s : stats) {
    MutexLock lock(&s.mu);
    lat.insert(lat.end(), s.batch_us.begin(), s.batch_us.end());
  }
  const double p50 = Percentile(lat, 0.50), p99 = Percentile(lat, 0.99);
  const double gbps = static_cast<double>(totals.bytes.load()) / secs / 1e9;
  const double tps = static_cast<double>(totals.transfers.load()) / secs;
  engine.UnregisterLocalMemory(local).IgnoreError();
  std::free(local);
  const uint64_t errors = totals.errors.load() + totals.verify_failures.load();
  // The transport's counters: which NIC carried what, retries.
  std::string nics;
  uint64_t retries = 0;
  for (const TransportStats& t : engine.GetTransportStats()) {
    retries += t.retries;
    for (const NicStats& n : t.nics) {
      absl::StrAppend(&nics, nics.empty() ? "" : ",", "{\"name\":\"", n.name,
                      "\",\"port_active\":", n.port_active ? "true" : "false",
                      ",\"slices\":", n.slices, ",\"bytes\":", n.bytes,
                      ",\"errors\":", n.errors, "}");
    }
  }
  if (json) {
    std::printf(
        "{\"protocol\":\"%s\",\"operation\":\"%s\",\"block_size\":%zu,"
        "\"batch_size\":%d,\"threads\":%d,\"seconds\":%.3f,"
        "\"throughput_gbps\":%.4f,\"transfers_per_sec\":%.1f,"
        "\"p50_us\":%.1f,\"p99_us\":%.1f,\"bytes\":%llu,\"errors\":%llu,"
        "\"verified\":%s,\"verify_failures\":%llu,\"retries\":%llu,"
        "\"nics\":[%s]}\n",
        absl::GetFlag(FLAGS_protocol).c_str(),
        absl::GetFlag(FLAGS_operation).c_str(), block, batch_size, threads,
        secs, gbps, tps, p50, p99,
        static_cast<unsigned long long>(totals.bytes.load()),
        static_cast<unsigned long long>(errors),
        absl::GetFlag(FLAGS_verify) ? "true" : "false",
        static_cast<unsigned long long>(totals.verify_failures.load()),
        static_cast<unsigned long long>(retries), nics.c_str());
  } else {
    std::printf(
        "%s %s: %.3f GB/s, %.0f transfers/s, batch latency p50 %.1f us p99 "
        "%.1f us, %llu bytes, %llu errors%s\n",
        absl::GetFlag(FLAGS_protocol).c_str(),
        absl::GetFlag(FLAGS_operation).c_str(), gbps, tps, p50, p99,
        static_cast<unsigned long long>(totals.bytes.load()),
        static_cast<unsigned long long>(errors),
        absl::GetFlag(FLAGS_verify) ? ", every byte verified" : "");
  }
  return errors == 0 && totals.bytes.load() > 0 ? 0 : 1;
}

int Main() {
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const std::string op = absl::GetFlag(FLAGS_operation);
  if (op != "read" && op != "write") {
    Die(absl::InvalidArgumentError("--operation must be read or write"),
        "flags");
  }
  const std::string report = absl::GetFlag(FLAGS_report);
  if (report != "text" && report != "json") {
    Die(absl::InvalidArgumentError("--report must be text or json"), "flags");
  }
  const size_t buffer = absl::GetFlag(FLAGS_buffer_size);
  std::string name = absl::GetFlag(FLAGS_local_server_name);
  const std::string md = absl::GetFlag(FLAGS_metadata_server);
  if (mode == "target") {
    if (name.empty()) name = absl::GetFlag(FLAGS_segment_id);
    EngineOptions o = BaseOptions(name, md);
    o.rpc_port = static_cast<uint16_t>(absl::GetFlag(FLAGS_rpc_port));
    TransferEngine engine;
    if (absl::Status s = engine.Init(o); !s.ok()) Die(s, "Init");
    void* target_buf = SetUpTarget(engine, buffer);
    std::printf("target ready: segment=%s metadata=%s\n", name.c_str(),
                engine.metadata_address().c_str());
    std::fflush(stdout);
    const double life = absl::GetFlag(FLAGS_target_seconds);
    const absl::Time end =
        life > 0 ? absl::Now() + absl::Seconds(life) : absl::InfiniteFuture();
    while (!g_stop.load() && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    engine.Shutdown();
    std::free(target_buf);
    return 0;
  }
  if (mode == "initiator") {
    if (name.empty()) name = "initiator";
    if (md == "embedded") {
      Die(absl::InvalidArgumentError(
              "initiator needs --metadata_server=host:port (the target's)"),
          "flags");
    }
    TransferEngine engine;
    if (absl::Status s = engine.Init(BaseOptions(name, md)); !s.ok()) {
      Die(s, "Init");
    }
    return RunInitiator(engine);
  }
  if (mode == "local") {
    // Two engines in one process: the target embeds the metadata service.
    TransferEngine target;
    if (absl::Status s =
            target.Init(BaseOptions(absl::GetFlag(FLAGS_segment_id), md));
        !s.ok()) {
      Die(s, "Init target");
    }
    void* target_buf = SetUpTarget(target, buffer);
    TransferEngine initiator;
    if (absl::Status s = initiator.Init(
            BaseOptions(name.empty() ? "initiator" : name,
                        md == "embedded" ? target.metadata_address() : md));
        !s.ok()) {
      Die(s, "Init initiator");
    }
    int rc = RunInitiator(initiator);
    initiator.Shutdown();
    target.Shutdown();
    std::free(target_buf);
    return rc;
  }
  Die(absl::InvalidArgumentError("--mode must be target, initiator or local"),
      "flags");
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Measures Ferry transfers; see the comment at the top of "
      "tools/transfer_bench.cc");
  absl::ParseCommandLine(argc, argv);
  return ferry::Main();
}
