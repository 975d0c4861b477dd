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
//
// This file holds the flags, the engines they configure, target mode and
// main; the initiator's run is in transfer_bench_initiator.cc, what it
// counts and prints in transfer_bench_report.cc.
#include "tools/transfer_bench.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_memory.h"
#include "common/file_util.h"
#include "common/socket_util.h"
#include "ferry/transfer_engine.h"
#include "metadata/auth.h"
#include "tools/transfer_bench_report.h"

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
          "tcp | rdma | shm, or a comma-separated list in order of "
          "preference (a target with rdma,tcp serves initiators of either; "
          "shm,rdma copies directly to a target on this host)");
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
ABSL_FLAG(uint64_t, rdma_stripe_bytes, 1 << 20,
          "RDMA: a request's consecutive slices ride one rail up to this "
          "many bytes (0: spread slice by slice)");
ABSL_FLAG(int, qps_per_endpoint, 2, "RDMA QPs per (local, remote NIC) pair");
ABSL_FLAG(int, rdma_signal_every, 16,
          "RDMA selective signaling: every Nth WR asks for a completion "
          "(1..32; the last WR of each chain always does)");
ABSL_FLAG(int, rdma_inline_bytes, 64,
          "RDMA WRITE WRs up to this many bytes go inline (0: none)");
ABSL_FLAG(double, target_seconds, 0,
          "target mode: exit after this long (0: run until SIGINT/SIGTERM)");

namespace ferry::transfer_bench {

std::atomic<bool> g_stop{false};

[[noreturn]] void Die(const absl::Status& s, const std::string& what) {
  std::fprintf(stderr, "transfer_bench: %s: %s\n", what.c_str(),
               s.ToString().c_str());
  std::exit(1);
}

void MustOk(const absl::Status& s, const char* what) {
  if (!s.ok()) Die(s, what);
}

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

// Where consecutive requests of a batch start (flags validated).
size_t BlockStride() {
  const size_t stride = absl::GetFlag(FLAGS_block_stride);
  return stride != 0 ? stride : absl::GetFlag(FLAGS_block_size);
}

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

namespace {

void OnSignal(int) { g_stop.store(true); }

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
  o.rdma.stripe_bytes = absl::GetFlag(FLAGS_rdma_stripe_bytes);
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

std::string DefaultInitiatorName() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::string h = host;
  for (char& c : h) {
    if (c <= ' ' || c > '~') c = '_';
  }
  return absl::StrCat("initiator-", h.empty() ? "host" : h, "-", getpid());
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
}  // namespace ferry::transfer_bench

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
  return ferry::transfer_bench::Main();
}
