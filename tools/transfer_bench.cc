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
//
// --verify checks every byte moved, whatever ran against the target before:
//   WRITE: each batch is read back into zeroed memory and compared.
//   READ:  the initiator first WRITEs a reference pattern (seed
//          --pattern_seed) over the target range the run reads (not
//          measured), then checks every READ, into zeroed memory, against
//          it. With --noverify_prepare it skips that step and checks the
//          pattern a target fills its buffer with at start (same seed): a
//          READ-only check of a target nothing has written to.
// Only one verified initiator should write a target at a time.
//
// Failures: a request that fails is counted; the first of each distinct
// status is printed, and at the end one line per status with its count.
// A thread whose batch failed entirely backs off (1 ms doubling to 100 ms)
// before the next; after --max_consecutive_errors failed requests with no
// completed one between them, the run stops. The exit status is 0 only if
// bytes moved and no request failed and no byte differed.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/mutex.h"
#include "common/pattern.h"
#include "common/socket_util.h"
#include "ferry/transfer_engine.h"
#include "metadata/auth.h"
#include "tools/bench_memory.h"

ABSL_FLAG(std::string, mode, "local", "target | initiator | local");
ABSL_FLAG(std::string, metadata_server, "embedded",
          "\"embedded\", host:port (or ferry://host:port) of a Ferry "
          "metadata service, etcd://host:port[,host:port...], or "
          "P2PHANDSHAKE (no metadata service: the target prints its "
          "segment name, host:port, for --segment_id)");
ABSL_FLAG(std::string, auth_token_file, "",
          "the cluster's auth token, from this file's first line "
          "(EngineOptions::auth_token)");
ABSL_FLAG(std::string, tls_ca_file, "",
          "mutual TLS on the engine's gRPC traffic (EngineOptions::tls_*): "
          "the cluster CA's PEM certificate");
ABSL_FLAG(std::string, tls_cert_file, "",
          "this engine's PEM certificate, signed by --tls_ca_file");
ABSL_FLAG(std::string, tls_key_file, "", "this engine's PEM private key");
ABSL_FLAG(std::string, tls_server_name, "",
          "the name servers' certificates carry (empty: the host dialled)");
ABSL_FLAG(std::string, metadata_namespace, "",
          "namespace (cluster id) of the segments: engines see only their "
          "namespace's (empty: none)");
ABSL_FLAG(std::string, local_server_name, "",
          "this engine's segment name (default: the target's is "
          "--segment_id, an initiator's initiator-HOST-PID, so that several "
          "initiators can share a metadata service). As in "
          "Mooncake, host:port (e.g. 10.0.0.1:12345) also sets the address "
          "advertised to peers and the RPC port, unless --advertise_host or "
          "--rpc_port say otherwise");
ABSL_FLAG(std::string, segment_id, "target", "segment name of the target");
ABSL_FLAG(std::string, listen_host, "",
          "address to bind to (empty: every interface, IPv4 and IPv6)");
ABSL_FLAG(std::string, advertise_host, "",
          "address peers are told to reach this engine at (empty: from "
          "--local_server_name=host:port, else --listen_host if it is one "
          "address, else the first RDMA NIC's, else the host's primary one)");
ABSL_FLAG(int, rpc_port, 0, "port of this engine's gRPC server (0: any)");
ABSL_FLAG(double, metadata_lease_seconds, 10,
          "lease on this engine's segment in the metadata service (0: none): "
          "a killed engine's segment goes away this long after it died");
ABSL_FLAG(int, tcp_port, 0, "port of the TCP transport (0: any)");
ABSL_FLAG(std::string, log_level, "",
          "log levels: a level (debug, info, warn, error, off) or per "
          "component ('warn,rdma=info'); empty: FERRY_LOG_LEVEL, else info");
ABSL_FLAG(std::string, protocol, "tcp",
          "tcp | rdma, or a comma-separated list in order of preference "
          "(a target with rdma,tcp serves initiators of either)");
ABSL_FLAG(std::string, operation, "write", "read | write");
ABSL_FLAG(uint64_t, block_size, 65536, "bytes per request");
// batch_size, threads, duration, block_size and buffer_size default to
// Mooncake's transfer_engine_bench values, so its command lines measure
// the same thing here.
ABSL_FLAG(int, batch_size, 128, "requests per batch");
ABSL_FLAG(uint64_t, block_stride, 0,
          "bytes from one request's start to the next one's in a batch "
          "(0: block_size, back to back); larger leaves gaps, as scattered "
          "KV-cache blocks do, so no request continues another in memory");
ABSL_FLAG(int, threads, 12, "initiator threads");
ABSL_FLAG(double, duration, 10,
          "seconds to run the initiator (each thread runs at least one "
          "batch)");
ABSL_FLAG(double, warmup, 0,
          "seconds to run before measuring (like iperf3 -O)");
ABSL_FLAG(uint64_t, buffer_size, 1ull << 30, "bytes registered on each side");
ABSL_FLAG(bool, verify, false,
          "check every byte moved. WRITE: read each batch back and compare. "
          "READ: first write a reference pattern over the target range read "
          "(not measured; see --verify_prepare), then compare every READ "
          "with it. Verify failures are counted and make the exit status 1");
ABSL_FLAG(bool, verify_prepare, true,
          "with --operation=read --verify: write the reference pattern "
          "before reading. false: check against the pattern the target "
          "filled its buffer with at start (--pattern_seed), which only a "
          "target nothing has written to still holds");
ABSL_FLAG(uint64_t, pattern_seed, 0x7a7a7a7a,
          "seed of the target's initial fill and of the READ reference "
          "pattern (initiator and target must agree)");
ABSL_FLAG(int, max_consecutive_errors, 100,
          "stop the run (exit status 1) after this many failed requests "
          "with no completed request between them, over all threads; 0: "
          "never stop (failing batches still back off)");
ABSL_FLAG(std::string, report, "text", "text | json (last line)");
ABSL_FLAG(std::string, report_unit, "GB",
          "throughput unit of the text report and the progress lines: GB, "
          "MB, KB (10^9, 10^6, 10^3 bytes), GiB, MiB, KiB (2^30, 2^20, 2^10 "
          "bytes), Gb, Mb, Kb (bits); the JSON report stays in GB/s");
ABSL_FLAG(int, report_precision, 2,
          "decimals of the throughput in the text report (0..9)");
ABSL_FLAG(bool, use_vram, false,
          "buffers in GPU memory (Mooncake's flag): device memory of "
          "--gpu_id, through the CUDA driver loaded at run time");
ABSL_FLAG(int, gpu_id, 0, "the GPU of --use_vram buffers");
ABSL_FLAG(int, tcp_connections, 1, "TCP connections per peer");
ABSL_FLAG(uint64_t, tcp_slice_bytes, 4 << 20, "TCP transport slice size");
ABSL_FLAG(std::string, device_name, "",
          "RDMA devices to use, comma-separated (empty: every active one)");
ABSL_FLAG(std::string, nic_priority_matrix, "",
          "file holding Mooncake TE's NIC priority matrix (JSON: each memory "
          "location's tiers of NIC names, best first; at most 1 MiB); "
          "empty: the topology read from sysfs");
ABSL_FLAG(bool, auto_discovery, false,
          "as in Mooncake: find every active NIC and the topology by itself, "
          "leaving --device_name and --nic_priority_matrix unused");
ABSL_FLAG(uint64_t, rdma_slice_bytes, 64 << 10, "RDMA transport slice size");
ABSL_FLAG(int, qps_per_endpoint, 2, "RDMA QPs per (local, remote NIC) pair");
ABSL_FLAG(int, rdma_signal_every, 16,
          "RDMA selective signaling: every Nth WR asks for a completion "
          "(1..32; the last WR of each chain always does)");
ABSL_FLAG(int, rdma_inline_bytes, 64,
          "RDMA WRITE WRs up to this many bytes go inline (0: none)");
ABSL_FLAG(double, target_seconds, 0,
          "target mode: exit after this long (0: run until SIGINT/SIGTERM)");

namespace ferry {
namespace {

// Distinct failure statuses remembered with their counts; more are counted
// under one line.
constexpr size_t kMaxDistinctErrors = 16;
constexpr absl::Duration kMinBackoff = absl::Milliseconds(1);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(100);
// Verify mismatches printed in detail; the rest are only counted.
constexpr uint64_t kVerifyDetails = 3;
// The READ reference pattern is written in requests of at most this size.
constexpr size_t kPrepareChunk = 4 << 20;
constexpr size_t kPrepareBatch = 16;

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

// Failed requests by status: the first of each status is printed at once,
// the counts at the end, so a failing peer gives a few lines, not a storm.
// Statuses that differ only in numbers (a back-off delay, a port, a
// request index) count as one; the first one seen is what gets printed.
class ErrorLog {
 public:
  void Add(const absl::Status& status, uint64_t count) {
    std::string text = status.ToString();
    std::string key = WithoutNumbers(text);
    MutexLock lock(&mu_);
    for (Entry& e : entries_) {
      if (e.key == key) {
        e.count += count;
        return;
      }
    }
    if (entries_.size() >= kMaxDistinctErrors) {
      other_ += count;
      return;
    }
    std::fprintf(stderr, "transfer failed: %s\n", text.c_str());
    entries_.push_back({std::move(key), std::move(text), count});
  }

  void PrintSummary() {
    MutexLock lock(&mu_);
    for (const Entry& e : entries_) {
      std::fprintf(stderr, "%llu requests failed: %s\n",
                   static_cast<unsigned long long>(e.count), e.text.c_str());
    }
    if (other_ > 0) {
      std::fprintf(stderr, "%llu requests failed with other statuses\n",
                   static_cast<unsigned long long>(other_));
    }
  }

 private:
  struct Entry {
    std::string key;
    std::string text;
    uint64_t count;
  };

  static std::string WithoutNumbers(const std::string& text) {
    std::string out;
    for (size_t i = 0; i < text.size(); ++i) {
      const bool digit = text[i] >= '0' && text[i] <= '9';
      const bool in_number =
          digit || (text[i] == '.' && !out.empty() && out.back() == '#');
      if (!in_number) {
        out.push_back(text[i]);
      } else if (out.empty() || out.back() != '#') {
        out.push_back('#');
      }
    }
    return out;
  }

  Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t other_ ABSL_GUARDED_BY(mu_) = 0;
};

struct Totals {
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> transfers{0};
  // Failed requests (transfer errors), and requests whose bytes differed.
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> verify_failures{0};
  // Failed requests since the last completed one, over all threads.
  std::atomic<uint64_t> consecutive_errors{0};
  std::atomic<bool> gave_up{false};
  ErrorLog error_log;
};

// The buffer of one side: host memory, or with --use_vram device memory.
std::unique_ptr<BenchMemory> AllocBuffer(size_t size) {
  const int gpu =
      absl::GetFlag(FLAGS_use_vram) ? absl::GetFlag(FLAGS_gpu_id) : -1;
  if (absl::GetFlag(FLAGS_use_vram) && gpu < 0) {
    Die(absl::InvalidArgumentError(
            absl::StrCat("--gpu_id=", gpu, " is not a GPU ordinal")),
        "flags");
  }
  auto mem = BenchMemory::Allocate(gpu, size);
  if (!mem.ok()) Die(mem.status(), "allocating buffer");
  return *std::move(mem);
}

void MustOk(const absl::Status& s, const char* what) {
  if (!s.ok()) Die(s, what);
}

// Bytes per --report_unit, Mooncake's units (b: bits); 0 if unknown.
double ReportUnitBytes(const std::string& unit) {
  static constexpr struct {
    const char* name;
    double bytes;
  } kUnits[] = {{"GB", 1e9},      {"MB", 1e6},      {"KB", 1e3},
                {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
                {"Gb", 1e9 / 8},  {"Mb", 1e6 / 8},  {"Kb", 1e3 / 8}};
  for (const auto& u : kUnits) {
    if (unit == u.name) return u.bytes;
  }
  return 0;
}

// A throughput as --report_unit/s with --report_precision decimals.
std::string Rate(double bytes_per_second) {
  const std::string unit = absl::GetFlag(FLAGS_report_unit);
  return absl::StrFormat("%.*f %s/s", absl::GetFlag(FLAGS_report_precision),
                         bytes_per_second / ReportUnitBytes(unit), unit);
}

uint16_t PortFlag(const char* flag, int port) {
  if (port < 0 || port > 65535) {
    Die(absl::InvalidArgumentError(absl::StrCat(
            "--", flag, "=", port, " is not a port (0..65535; 0: any)")),
        "flags");
  }
  return static_cast<uint16_t>(port);
}

// `name` is the segment name; as with Mooncake's --local_server_name, a
// name of the form host:port also gives the address to advertise and the
// RPC port, unless flags set them.
EngineOptions BaseOptions(const std::string& name, const std::string& md) {
  EngineOptions o;
  o.local_segment_name = name;
  o.metadata_endpoint = md;
  o.metadata_namespace = absl::GetFlag(FLAGS_metadata_namespace);
  if (const std::string f = absl::GetFlag(FLAGS_auth_token_file); !f.empty()) {
    auto token = metadata::ReadAuthTokenFile(f);
    if (!token.ok()) Die(token.status(), "--auth_token_file");
    o.auth_token = *token;
  }
  o.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  o.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  o.listen_host = absl::GetFlag(FLAGS_listen_host);
  o.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  o.log_level = absl::GetFlag(FLAGS_log_level);
  o.rpc_port = PortFlag("rpc_port", absl::GetFlag(FLAGS_rpc_port));
  o.metadata_lease_ttl =
      absl::Seconds(absl::GetFlag(FLAGS_metadata_lease_seconds));
  o.tcp.port = PortFlag("tcp_port", absl::GetFlag(FLAGS_tcp_port));
  if (auto hp = ParseHostPort(name); hp.ok() && hp->port != 0) {
    if (o.advertise_host.empty()) o.advertise_host = hp->host;
    if (o.rpc_port == 0) o.rpc_port = hp->port;
  }
  o.transports =
      absl::StrSplit(absl::GetFlag(FLAGS_protocol), ',', absl::SkipEmpty());
  o.tcp.connections_per_peer = absl::GetFlag(FLAGS_tcp_connections);
  o.tcp.max_slice_bytes = absl::GetFlag(FLAGS_tcp_slice_bytes);
  if (!absl::GetFlag(FLAGS_auto_discovery)) {
    if (const std::string d = absl::GetFlag(FLAGS_device_name); !d.empty()) {
      o.rdma.devices = absl::StrSplit(d, ',', absl::SkipEmpty());
    }
    if (const std::string m = absl::GetFlag(FLAGS_nic_priority_matrix);
        !m.empty()) {
      auto json = ReadFileBounded("--nic_priority_matrix", m, 1 << 20);
      if (!json.ok()) Die(json.status(), "flags");
      o.rdma.topology_json = *std::move(json);
    }
  }
  o.rdma.slice_bytes = absl::GetFlag(FLAGS_rdma_slice_bytes);
  o.rdma.qps_per_endpoint = absl::GetFlag(FLAGS_qps_per_endpoint);
  o.rdma.signal_every = absl::GetFlag(FLAGS_rdma_signal_every);
  o.rdma.inline_bytes = absl::GetFlag(FLAGS_rdma_inline_bytes);
  return o;
}

// Registers a target buffer filled with the pattern that
// --noverify_prepare READs are checked with.
std::unique_ptr<BenchMemory> SetUpTarget(TransferEngine& engine, size_t size) {
  std::unique_ptr<BenchMemory> buf = AllocBuffer(size);
  MustOk(buf->Fill(buf->data(), size, 0, absl::GetFlag(FLAGS_pattern_seed)),
         "filling target buffer");
  if (absl::Status s =
          engine.RegisterLocalMemory(buf->data(), size, buf->location(), true);
      !s.ok()) {
    Die(s, "registering target buffer");
  }
  return buf;
}

// Counts the batch's failed requests by status, and stops the run once
// --max_consecutive_errors requests failed with no completion between.
// `batch` is null when the batch was refused as a whole.
void RecordFailures(TransferEngine& engine, const BatchId* batch, size_t n,
                    const BatchStatus& st, Totals* totals) {
  if (st.completed > 0) totals->consecutive_errors.store(0);
  if (st.failed == 0) return;
  totals->errors.fetch_add(st.failed);
  size_t attributed = 0;
  for (size_t i = 0; batch != nullptr && i < n; ++i) {
    auto ts = engine.GetTransferStatus(*batch, i);
    if (ts.ok() && (ts->state == TransferState::kFailed ||
                    ts->state == TransferState::kTimeout)) {
      totals->error_log.Add(ts->error, 1);
      ++attributed;
    }
  }
  if (attributed < st.failed) {
    totals->error_log.Add(st.first_error, st.failed - attributed);
  }
  if (st.completed > 0) return;
  const uint64_t consecutive =
      totals->consecutive_errors.fetch_add(st.failed) + st.failed;
  const int limit = absl::GetFlag(FLAGS_max_consecutive_errors);
  if (limit > 0 && consecutive >= static_cast<uint64_t>(limit) &&
      !totals->gave_up.exchange(true)) {
    std::fprintf(stderr,
                 "transfer_bench: stopping: %llu requests failed in a row "
                 "(--max_consecutive_errors=%d)\n",
                 static_cast<unsigned long long>(consecutive), limit);
    g_stop.store(true);
  }
}

// Submits `reqs` as one batch and waits for it. A submit error counts as
// every request failing with that status.
BatchStatus RunBatch(TransferEngine& engine,
                     const std::vector<TransferRequest>& reqs, Totals* totals) {
  auto batch = engine.AllocateBatch(reqs.size());
  if (!batch.ok()) Die(batch.status(), "AllocateBatch");
  BatchStatus st;
  if (absl::Status s = engine.SubmitTransfer(*batch, reqs); !s.ok()) {
    st.total = reqs.size();
    st.failed = reqs.size();
    st.first_error = s;
    st.state = TransferState::kFailed;
    RecordFailures(engine, nullptr, reqs.size(), st, totals);
    engine.FreeBatch(*batch).IgnoreError();
    return st;
  }
  auto waited = engine.WaitBatch(*batch, absl::Seconds(60));
  if (!waited.ok()) Die(waited.status(), "WaitBatch");
  st = *waited;
  RecordFailures(engine, &*batch, reqs.size(), st, totals);
  if (absl::Status s = engine.FreeBatch(*batch); !s.ok()) Die(s, "FreeBatch");
  return st;
}

// Checks each request's bytes (now in local memory at its source) against
// the pattern; counts and describes mismatching requests.
void CheckRequests(const std::vector<TransferRequest>& reqs,
                   const BenchMemory& local, uint64_t seed, Totals* totals) {
  for (const TransferRequest& r : reqs) {
    const auto* p = static_cast<const uint8_t*>(r.source);
    const size_t off = static_cast<size_t>(p - local.data());
    auto m = local.Check(p, r.length, off, seed);
    MustOk(m.status(), "reading back the local buffer");
    const size_t bad = m->index;
    if (bad == r.length) continue;
    if (totals->verify_failures.fetch_add(1) < kVerifyDetails) {
      std::fprintf(stderr,
                   "verify failed: %s of %zu bytes at buffer offset %zu: byte "
                   "%zu is 0x%02x, expected 0x%02x\n",
                   r.opcode == OpCode::kWrite ? "WRITE" : "READ", r.length, off,
                   bad, m->found, PatternByte(off + bad, seed));
    }
  }
}

void Backoff(absl::Duration* backoff, absl::Time end) {
  absl::SleepFor(std::min(*backoff, end - absl::Now()));
  *backoff = std::min(*backoff * 2, kMaxBackoff);
}

// Fills each request's source with the pattern CheckRequests expects, or
// zeroes it: only the requests' bytes, never the gaps --block_stride
// leaves between them (most of the span when it is large).
void FillRequests(const std::vector<TransferRequest>& reqs,
                  const BenchMemory& local, uint64_t seed) {
  for (const TransferRequest& r : reqs) {
    auto* p = static_cast<uint8_t*>(r.source);
    MustOk(local.Fill(p, r.length, static_cast<size_t>(p - local.data()), seed),
           "filling the local buffer");
  }
}
void ClearRequests(const std::vector<TransferRequest>& reqs,
                   const BenchMemory& local) {
  for (const TransferRequest& r : reqs) {
    MustOk(local.Clear(static_cast<uint8_t*>(r.source), r.length),
           "clearing the local buffer");
  }
}

// Where consecutive requests of a batch start (flags validated).
size_t BlockStride() {
  const size_t stride = absl::GetFlag(FLAGS_block_stride);
  return stride != 0 ? stride : absl::GetFlag(FLAGS_block_size);
}

void InitiatorThread(TransferEngine& engine, SegmentHandle seg,
                     const BenchMemory* local_mem, uint64_t remote_base,
                     size_t region, int tid, absl::Time measure_from,
                     absl::Time end, Totals* totals, ThreadStats* stats) {
  uint8_t* const local = local_mem->data();
  const bool write = absl::GetFlag(FLAGS_operation) == "write";
  const bool verify = absl::GetFlag(FLAGS_verify);
  const uint64_t read_seed = absl::GetFlag(FLAGS_pattern_seed);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  const size_t batch_size = absl::GetFlag(FLAGS_batch_size);
  const size_t stride = BlockStride();
  const size_t per_batch = stride * batch_size;
  const size_t batches_in_region = std::max<size_t>(1, region / per_batch);
  const size_t base = static_cast<size_t>(tid) * region;
  std::vector<TransferRequest> reqs(batch_size);
  absl::Duration backoff = kMinBackoff;
  uint64_t iter = 0;
  // At least one batch, however late this thread starts: on a loaded
  // machine a short --duration could otherwise end before the first
  // batch, and a run that moved nothing fails for the machine's speed.
  while ((iter == 0 || absl::Now() < end) && !g_stop.load()) {
    const size_t off = base + (iter % batches_in_region) * per_batch;
    const uint64_t seed = Mix64((static_cast<uint64_t>(tid) << 40) ^ iter);
    for (size_t i = 0; i < batch_size; ++i) {
      reqs[i].opcode = write ? OpCode::kWrite : OpCode::kRead;
      reqs[i].source = local + off + i * stride;
      reqs[i].target_id = seg;
      reqs[i].target_offset = remote_base + off + i * stride;
      reqs[i].length = block;
    }
    if (verify && write) FillRequests(reqs, *local_mem, seed);
    // A READ that silently moved nothing must not pass on stale bytes.
    if (verify && !write) ClearRequests(reqs, *local_mem);
    absl::Time start = absl::Now();
    const BatchStatus st = RunBatch(engine, reqs, totals);
    double us = absl::ToDoubleMicroseconds(absl::Now() - start);
    const bool measured = start >= measure_from;
    if (measured) totals->bytes.fetch_add(st.transferred_bytes);
    if (measured) totals->transfers.fetch_add(st.completed);
    if (measured) {
      MutexLock lock(&stats->mu);
      stats->batch_us.push_back(us);
    }
    ++iter;
    if (st.completed == 0) {
      Backoff(&backoff, end);
      continue;
    }
    backoff = kMinBackoff;
    // A batch with failures is not checked: its requests are counted as
    // errors already, and which bytes arrived is undefined.
    if (!verify || st.failed > 0) continue;
    if (!write) {
      CheckRequests(reqs, *local_mem, read_seed, totals);
      continue;
    }
    // Read the range back into zeroed memory and compare.
    for (TransferRequest& r : reqs) r.opcode = OpCode::kRead;
    ClearRequests(reqs, *local_mem);
    const BatchStatus back = RunBatch(engine, reqs, totals);
    if (back.failed > 0) continue;
    for (TransferRequest& r : reqs) r.opcode = OpCode::kWrite;
    CheckRequests(reqs, *local_mem, seed, totals);
  }
}

// Writes the READ reference pattern over [0, len) of the target buffer
// (offsets relative to its start), so a verified READ is checked against
// what the target really holds. False if any write failed.
bool PrepareTarget(TransferEngine& engine, SegmentHandle seg,
                   const BenchMemory& local_mem, uint64_t remote_base,
                   size_t len, Totals* totals) {
  const uint64_t seed = absl::GetFlag(FLAGS_pattern_seed);
  std::fprintf(stderr,
               "preparing: writing the reference pattern over %zu bytes of "
               "the target (not measured)\n",
               len);
  uint8_t* const local = local_mem.data();
  MustOk(local_mem.Fill(local, len, 0, seed), "filling the local buffer");
  std::vector<TransferRequest> reqs;
  for (size_t off = 0; off < len && !g_stop.load();) {
    reqs.clear();
    while (off < len && reqs.size() < kPrepareBatch) {
      TransferRequest r;
      r.opcode = OpCode::kWrite;
      r.source = local + off;
      r.target_id = seg;
      r.target_offset = remote_base + off;
      r.length = std::min(kPrepareChunk, len - off);
      off += r.length;
      reqs.push_back(r);
    }
    if (RunBatch(engine, reqs, totals).failed > 0) return false;
  }
  return !g_stop.load();
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  size_t k = static_cast<size_t>(p * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

std::string DefaultInitiatorName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::string h = host;
  for (char& c : h) {
    if (c <= ' ' || c > '~') c = '_';
  }
  return absl::StrCat("initiator-", h.empty() ? "host" : h, "-", getpid());
}

// The initiator's flags, checked before any engine starts: a bad flag is
// an error at once, not after the target's buffer has been filled.
void CheckInitiatorFlags() {
  const size_t buffer = absl::GetFlag(FLAGS_buffer_size);
  const int threads = absl::GetFlag(FLAGS_threads);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  const int batch_size = absl::GetFlag(FLAGS_batch_size);
  if (threads < 1 || batch_size < 1 || block == 0) {
    Die(absl::InvalidArgumentError("threads, batch_size and block_size must "
                                   "be positive"),
        "flags");
  }
  const double duration = absl::GetFlag(FLAGS_duration);
  const double warmup = absl::GetFlag(FLAGS_warmup);
  if (!(duration > 0) || !(warmup >= 0) || !std::isfinite(duration) ||
      !std::isfinite(warmup)) {
    Die(absl::InvalidArgumentError(absl::StrCat("--duration (", duration,
                                                ") must be > 0 and --warmup (",
                                                warmup, ") >= 0, both finite")),
        "flags");
  }
  const size_t stride = BlockStride();
  if (stride < block) {
    Die(absl::InvalidArgumentError(
            absl::StrCat("--block_stride (", stride,
                         ") must be 0 or at least --block_size (", block,
                         "): requests of a batch must not overlap")),
        "flags");
  }
  const size_t region = buffer / static_cast<size_t>(threads);
  // Divided, not multiplied: stride x batch_size may overflow.
  if (stride > region / static_cast<size_t>(batch_size)) {
    Die(absl::InvalidArgumentError(
            absl::StrCat("buffer_size ", buffer, " is too small for ", threads,
                         " thread(s) x batch_size x block_size (or "
                         "block_stride)")),
        "flags");
  }
}

// The flags were checked by CheckInitiatorFlags.
int RunInitiator(TransferEngine& engine) {
  const size_t buffer = absl::GetFlag(FLAGS_buffer_size);
  const int threads = absl::GetFlag(FLAGS_threads);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  const int batch_size = absl::GetFlag(FLAGS_batch_size);
  const double duration = absl::GetFlag(FLAGS_duration);
  const double warmup = absl::GetFlag(FLAGS_warmup);
  const size_t stride = BlockStride();
  const size_t region = buffer / static_cast<size_t>(threads);
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
  std::unique_ptr<BenchMemory> local_mem = AllocBuffer(buffer);
  MustOk(local_mem->Clear(local_mem->data(), buffer),
         "clearing the local buffer");
  if (absl::Status s = engine.RegisterLocalMemory(local_mem->data(), buffer,
                                                  local_mem->location(), false);
      !s.ok()) {
    Die(s, "registering local buffer");
  }
  const bool verify = absl::GetFlag(FLAGS_verify);
  const bool write = absl::GetFlag(FLAGS_operation) == "write";
  Totals totals;
  if (verify && !write && absl::GetFlag(FLAGS_verify_prepare)) {
    // What the threads read: batches_in_region whole batches per region.
    const size_t per_batch = stride * static_cast<size_t>(batch_size);
    const size_t used = (static_cast<size_t>(threads) - 1) * region +
                        std::max<size_t>(1, region / per_batch) * per_batch;
    if (!PrepareTarget(engine, *seg, *local_mem, bufs->front().addr, used,
                       &totals)) {
      totals.error_log.PrintSummary();
      std::fprintf(stderr,
                   "transfer_bench: could not write the reference pattern "
                   "to the target; no READ was verified\n");
      return 1;
    }
  }
  std::vector<ThreadStats> stats(static_cast<size_t>(threads));
  const absl::Time start = absl::Now() + absl::Seconds(warmup);
  const absl::Time end = start + absl::Seconds(duration);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    try {
      workers.emplace_back(InitiatorThread, std::ref(engine), *seg,
                           local_mem.get(), bufs->front().addr, region, t,
                           start, end, &totals, &stats[static_cast<size_t>(t)]);
    } catch (const std::system_error& e) {
      // A thread or pids limit: stop the workers already running and say
      // so, rather than abort with the exception.
      g_stop = true;
      for (std::thread& w : workers) w.join();
      std::fprintf(stderr,
                   "transfer_bench: cannot start initiator thread %d of %d: "
                   "%s (a thread or pids limit?); try fewer --threads\n",
                   t + 1, threads, e.what());
      return 1;
    }
  }
  const bool json = absl::GetFlag(FLAGS_report) == "json";
  FILE* progress = json ? stderr : stdout;
  while (absl::Now() < start && !g_stop.load()) {
    absl::SleepFor(std::min(absl::Milliseconds(100), start - absl::Now()));
  }
  uint64_t last_bytes = totals.bytes.load();
  absl::Time last = absl::Now();
  while (absl::Now() < end && !g_stop.load()) {
    absl::SleepFor(std::min(absl::Milliseconds(100), end - absl::Now()));
    absl::Time now = absl::Now();
    if (now - last < absl::Seconds(1) && now < end && !g_stop.load()) continue;
    uint64_t bytes = totals.bytes.load();
    std::fprintf(progress,
                 "[%5.1fs, %5.1fs left] %s  %llu transfers  %llu errors",
                 absl::ToDoubleSeconds(now - start),
                 std::max(0.0, absl::ToDoubleSeconds(end - now)),
                 Rate(static_cast<double>(bytes - last_bytes) /
                      absl::ToDoubleSeconds(now - last))
                     .c_str(),
                 static_cast<unsigned long long>(totals.transfers.load()),
                 static_cast<unsigned long long>(totals.errors.load()));
    if (verify) {
      std::fprintf(
          progress, "  %llu verify failures",
          static_cast<unsigned long long>(totals.verify_failures.load()));
    }
    std::fprintf(progress, "\n");
    std::fflush(progress);
    last_bytes = bytes;
    last = now;
  }
  for (auto& w : workers) w.join();
  const double secs =
      std::max(1e-9, absl::ToDoubleSeconds(absl::Now() - start));
  std::vector<double> lat;
  for (auto& s : stats) {
    MutexLock lock(&s.mu);
    lat.insert(lat.end(), s.batch_us.begin(), s.batch_us.end());
  }
  const double p50 = Percentile(lat, 0.50), p99 = Percentile(lat, 0.99);
  const double gbps = static_cast<double>(totals.bytes.load()) / secs / 1e9;
  const double tps = static_cast<double>(totals.transfers.load()) / secs;
  engine.UnregisterLocalMemory(local_mem->data()).IgnoreError();
  local_mem.reset();
  const uint64_t transfer_errors = totals.errors.load();
  const uint64_t verify_failures = totals.verify_failures.load();
  const uint64_t errors = transfer_errors + verify_failures;
  const bool ok = errors == 0 && totals.bytes.load() > 0;
  totals.error_log.PrintSummary();
  // The transport's counters: which NIC carried what, retries.
  std::string nics;
  uint64_t retries = 0;
  for (const TransportStats& t : engine.GetTransportStats()) {
    retries += t.retries;
    for (const NicStats& n : t.nics) {
      absl::StrAppend(&nics, nics.empty() ? "" : ",", "{\"name\":\"", n.name,
                      "\",\"port_active\":", n.port_active ? "true" : "false",
                      ",\"slices\":", n.slices, ",\"bytes\":", n.bytes,
                      ",\"errors\":", n.errors,
                      ",\"work_requests\":", n.work_requests,
                      ",\"completions\":", n.completions, "}");
    }
  }
  if (json) {
    // "errors" counts every failure (transfer errors + verify failures), so
    // `"errors":0` alone still means a clean run.
    std::printf(
        "{\"protocol\":\"%s\",\"operation\":\"%s\",\"block_size\":%zu,"
        "\"block_stride\":%zu,\"batch_size\":%d,\"threads\":%d,"
        "\"rdma_signal_every\":%d,\"rdma_inline_bytes\":%d,\"seconds\":%.3f,"
        "\"throughput_gbps\":%.4f,\"transfers_per_sec\":%.1f,"
        "\"p50_us\":%.1f,\"p99_us\":%.1f,\"bytes\":%llu,\"errors\":%llu,"
        "\"transfer_errors\":%llu,\"verify\":%s,\"verified\":%s,"
        "\"verify_failures\":%llu,\"stopped_on_errors\":%s,"
        "\"retries\":%llu,\"nics\":[%s]}\n",
        absl::GetFlag(FLAGS_protocol).c_str(),
        absl::GetFlag(FLAGS_operation).c_str(), block, BlockStride(),
        batch_size, threads, absl::GetFlag(FLAGS_rdma_signal_every),
        absl::GetFlag(FLAGS_rdma_inline_bytes), secs, gbps, tps, p50, p99,
        static_cast<unsigned long long>(totals.bytes.load()),
        static_cast<unsigned long long>(errors),
        static_cast<unsigned long long>(transfer_errors),
        verify ? "true" : "false", verify && ok ? "true" : "false",
        static_cast<unsigned long long>(verify_failures),
        totals.gave_up.load() ? "true" : "false",
        static_cast<unsigned long long>(retries), nics.c_str());
  } else {
    std::string verdict;
    if (verify) {
      verdict = ok ? ", every byte verified"
                   : absl::StrCat(", ", verify_failures,
                                  " verify failures (verify FAILED)");
    }
    std::printf(
        "%s %s: %s, %.0f transfers/s, batch latency p50 %.1f us p99 "
        "%.1f us, %llu bytes, %llu errors%s\n",
        absl::GetFlag(FLAGS_protocol).c_str(),
        absl::GetFlag(FLAGS_operation).c_str(), Rate(gbps * 1e9).c_str(), tps,
        p50, p99, static_cast<unsigned long long>(totals.bytes.load()),
        static_cast<unsigned long long>(transfer_errors), verdict.c_str());
  }
  std::fflush(stdout);
  return ok ? 0 : 1;
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
  if (ReportUnitBytes(absl::GetFlag(FLAGS_report_unit)) == 0) {
    Die(absl::InvalidArgumentError(absl::StrCat(
            "--report_unit=", absl::GetFlag(FLAGS_report_unit),
            " is not one of GB, MB, KB, GiB, MiB, KiB, Gb, Mb, Kb")),
        "flags");
  }
  if (const int p = absl::GetFlag(FLAGS_report_precision); p < 0 || p > 9) {
    Die(absl::InvalidArgumentError(
            absl::StrCat("--report_precision=", p, " is not in 0..9")),
        "flags");
  }
  const size_t buffer = absl::GetFlag(FLAGS_buffer_size);
  std::string name = absl::GetFlag(FLAGS_local_server_name);
  const std::string md = absl::GetFlag(FLAGS_metadata_server);
  if (mode == "target") {
    if (name.empty()) name = absl::GetFlag(FLAGS_segment_id);
    TransferEngine engine;
    if (absl::Status s = engine.Init(BaseOptions(name, md)); !s.ok()) {
      Die(s, "Init");
    }
    std::unique_ptr<BenchMemory> target_buf = SetUpTarget(engine, buffer);
    // Scripts parse the ready line to its end: what the engine advertises
    // goes on a line of its own, before it.
    std::printf("target address: advertised=%s (%s)\n",
                engine.advertised_host().c_str(),
                engine.advertised_host_reason().c_str());
    // In P2PHANDSHAKE mode the segment is named by the engine's address:
    // initiators pass this as --segment_id.
    std::printf("target ready: segment=%s metadata=%s\n",
                engine.local_segment_name().c_str(),
                engine.metadata_address().c_str());
    std::fflush(stdout);
    const double life = absl::GetFlag(FLAGS_target_seconds);
    const absl::Time end =
        life > 0 ? absl::Now() + absl::Seconds(life) : absl::InfiniteFuture();
    while (!g_stop.load() && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    engine.Shutdown();
    target_buf.reset();
    return 0;
  }
  if (mode == "initiator") {
    // A segment name belongs to one engine run at a time: a fixed default
    // would make a second initiator wait for the first one's name.
    if (name.empty()) name = DefaultInitiatorName();
    if (md == "embedded") {
      Die(absl::InvalidArgumentError(
              "initiator needs --metadata_server=host:port (the target's)"),
          "flags");
    }
    CheckInitiatorFlags();
    TransferEngine engine;
    if (absl::Status s = engine.Init(BaseOptions(name, md)); !s.ok()) {
      Die(s, "Init");
    }
    return RunInitiator(engine);
  }
  if (mode == "local") {
    // Two engines in one process: the target embeds the metadata service.
    // Only the initiator takes the port flags (two engines cannot share).
    CheckInitiatorFlags();
    EngineOptions to = BaseOptions(absl::GetFlag(FLAGS_segment_id), md);
    to.rpc_port = 0;
    to.tcp.port = 0;
    TransferEngine target;
    if (absl::Status s = target.Init(to); !s.ok()) {
      Die(s, "Init target");
    }
    std::unique_ptr<BenchMemory> target_buf = SetUpTarget(target, buffer);
    TransferEngine initiator;
    if (absl::Status s = initiator.Init(
            BaseOptions(name.empty() ? DefaultInitiatorName() : name,
                        md == "embedded" ? target.metadata_address() : md));
        !s.ok()) {
      Die(s, "Init initiator");
    }
    int rc = RunInitiator(initiator);
    initiator.Shutdown();
    target.Shutdown();
    target_buf.reset();
    return rc;
  }
  Die(absl::InvalidArgumentError("--mode must be target, initiator or local"),
      "flags");
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Measures Ferry transfers between two engines.\n"
      "  transfer_bench --mode=target --local_server_name=10.0.0.1:12345\n"
      "  transfer_bench --mode=initiator --metadata_server=10.0.0.1:12345 "
      "--segment_id=10.0.0.1:12345 --local_server_name=10.0.0.2:12346 "
      "--operation=read --verify\n"
      "  transfer_bench --mode=local   (both engines in one process)\n"
      "--verify checks every byte, whatever ran against the target before: "
      "a WRITE is read back and compared; a READ run first writes a "
      "reference pattern over the range it reads (not measured; "
      "--noverify_prepare checks the target's initial fill instead).\n"
      "Exit status: 0 if bytes moved and no request failed and no byte "
      "differed, 1 otherwise. Failing requests back off and stop the run "
      "after --max_consecutive_errors in a row.");
  absl::ParseCommandLine(argc, argv);
  return ferry::Main();
}
