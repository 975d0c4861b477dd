// storm_bench: a handshake storm. N engines open one target at once and
// each moves one request; or M engines open each other all at once. It
// reports the time from the common start to each engine's first completed
// transfer (all-to-all: to one completed transfer with every peer), as
// p50/p99/max, with failures, handshakes sent and QPs created.
//
//   storm_bench --initiators=1024 --protocol=tcp
//   tools/softrnic-run storm_bench --initiators=256 --protocol=rdma
//   storm_bench --all_to_all=64
//
// Engines share this process (each its own segment, gRPC server, NICs and
// connections), so a thousand fit one small machine. In one process
// (--mode=local, the default) each engine listens on, and its TCP
// transport connects from, a loopback address of its own (127.1.x.y), as
// if it were a host: targets cap connections per address. Across
// network-namespace hosts (bench/bench_storm.sh): `--mode=target` in one,
// `--mode=initiators --metadata_server=H:P --listen_host=A` in others.
//
// Each engine holds about 15 fds (its gRPC server, NIC, listeners and
// connections): a thousand engines in one process need that many under
// the hard RLIMIT_NOFILE (the engines' RpcServer raises the soft limit to
// it).
//
// --report=json prints one JSON line: p50_s, p99_s, max_s, failures,
// handshake_rpcs (handshakes the engines of this process started: RDMA
// Exchange calls, TCP connections), qps (QPs created by the engines of
// this process, both sides: RDMA), init_s, late_s (how late this process
// was for --start_at), max_rss_mib. Failed engines are left out of the
// quantiles (and counted in failures). Exit status 0 only with no failure
// and not late.
#include <signal.h>
#include <sys/resource.h>  // getrusage
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/percentile.h"
#include "ferry/transfer_engine.h"

ABSL_FLAG(std::string, mode, "local", "local | target | initiators");
ABSL_FLAG(int, initiators, 64, "engines that open the target at once");
ABSL_FLAG(int, all_to_all, 0,
          "instead: this many engines, each opening every other (local)");
ABSL_FLAG(std::string, protocol, "tcp", "tcp | rdma");
ABSL_FLAG(std::string, report, "text", "text | json (one line)");
ABSL_FLAG(uint64_t, block_size, 4096, "bytes each transfer writes");
ABSL_FLAG(std::string, metadata_server, "embedded",
          "embedded (in the target) | host:port | etcd://host:port");
ABSL_FLAG(std::string, segment_id, "storm-target",
          "the target's segment name (target, initiators)");
ABSL_FLAG(std::string, listen_host, "",
          "address the engines of this process listen on (target, "
          "initiators; local gives each its own loopback address)");
ABSL_FLAG(double, timeout_s, 60, "how long a transfer may take");
ABSL_FLAG(double, rpc_timeout_s, 3,
          "the engines' rpc_timeout (metadata calls, handshakes)");
ABSL_FLAG(double, start_at, 0,
          "initiators: release the storm at this Unix time (seconds), so "
          "that several hosts' engines start it together; 0: when up");
ABSL_FLAG(int, slot_base, 0,
          "initiators: engine i writes the target's block slot_base + i");
ABSL_FLAG(std::string, times_out, "",
          "write each engine's seconds to its first transfer here, one a "
          "line (-1: failed)");
ABSL_FLAG(double, hold_s, 0,
          "seconds to keep the engines up after the report (to study them)");

namespace ferry {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

struct Engine {
  TransferEngine engine;
  std::unique_ptr<char[]> buffer;
  double first_s = -1;  // Seconds from the start to its goal; -1: failed.
  std::string error;
};

// Engine i's own loopback address in local mode, as if each were a host.
std::string LocalHostOf(int i) {
  return absl::StrCat("127.1.", i / 250, ".", i % 250 + 1);
}

absl::Status InitEngine(Engine* e, const std::string& name,
                        const std::string& metadata, size_t bytes,
                        const std::string& host) {
  EngineOptions o;
  o.local_segment_name = name;
  o.metadata_endpoint = metadata;
  o.transports = {absl::GetFlag(FLAGS_protocol)};
  o.listen_host = host;
  o.transfer_timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  o.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  e->buffer.reset(new char[bytes]());
  absl::Status s = e->engine.Init(o);
  if (!s.ok()) return s;
  return e->engine.RegisterLocalMemory(e->buffer.get(), bytes);
}

// Opens each of `targets` and writes one block to each, at `slot` blocks
// into its first buffer; records when the last one completed.
absl::Status Storm(Engine* e, const std::vector<std::string>& targets,
                   size_t slot, size_t block, absl::Time start) {
  std::vector<TransferRequest> reqs;
  for (const std::string& t : targets) {
    auto seg = e->engine.OpenSegment(t);
    if (!seg.ok()) return seg.status();
    auto bufs = e->engine.GetSegmentBuffers(*seg);
    if (!bufs.ok()) return bufs.status();
    if (bufs->empty() || (*bufs)[0].length < (slot + 1) * block) {
      return absl::FailedPreconditionError(
          absl::StrCat("segment ", t, " has no room for slot ", slot));
    }
    TransferRequest r;
    r.opcode = OpCode::kWrite;
    r.source = e->buffer.get();
    r.target_id = *seg;
    r.target_offset = (*bufs)[0].addr + slot * block;
    r.length = block;
    reqs.push_back(r);
  }
  auto batch = e->engine.AllocateBatch(reqs.size());
  if (!batch.ok()) return batch.status();
  absl::Status s = e->engine.SubmitTransfer(*batch, reqs);
  if (s.ok()) {
    auto st = e->engine.WaitBatch(
        *batch, absl::Seconds(absl::GetFlag(FLAGS_timeout_s) + 5));
    if (!st.ok()) {
      s = st.status();
    } else if (st->state != TransferState::kCompleted) {
      s = absl::InternalError("a transfer did not complete");
      for (size_t k = 0; k < reqs.size(); ++k) {
        auto ts = e->engine.GetTransferStatus(*batch, k);
        if (ts.ok() && ts->state != TransferState::kCompleted) {
          s = absl::InternalError(
              absl::StrCat("to ", targets[k], ": ", ts->error.ToString()));
          break;
        }
      }
    }
  }
  e->first_s = absl::ToDoubleSeconds(absl::Now() - start);
  (void)e->engine.FreeBatch(*batch);
  return s;
}

double MaxRssMib() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

struct Totals {
  uint64_t handshakes = 0, qps = 0;
};
void AddStats(TransferEngine& e, Totals* t) {
  for (const auto& ts : e.GetTransportStats()) {
    t->handshakes += ts.connects_started;
    t->qps += ts.qps_created;
  }
}

// Serves the target until SIGINT/SIGTERM.
int RunTarget(size_t slots, size_t block) {
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  Engine target;
  absl::Status s = InitEngine(&target, absl::GetFlag(FLAGS_segment_id),
                              absl::GetFlag(FLAGS_metadata_server),
                              slots * block, absl::GetFlag(FLAGS_listen_host));
  if (!s.ok()) {
    std::fprintf(stderr, "storm_bench: target: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("storm target ready: metadata %s\n",
              target.engine.metadata_address().c_str());
  std::fflush(stdout);
  while (!g_stop.load()) absl::SleepFor(absl::Milliseconds(100));
  Totals t;
  AddStats(target.engine, &t);
  std::printf("{\"target_qps\":%llu}\n",
              static_cast<unsigned long long>(t.qps));
  return 0;
}

int Run() {
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const int a2a = absl::GetFlag(FLAGS_all_to_all);
  const int n = a2a > 0 ? a2a : absl::GetFlag(FLAGS_initiators);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  if (n < 1 || n > 4096 || block == 0 || block > (64 << 20) ||
      absl::GetFlag(FLAGS_slot_base) < 0) {
    std::fprintf(stderr,
                 "storm_bench: --initiators/--all_to_all must be 1..4096 and "
                 "--block_size 1..64 MiB\n");
    return 2;
  }
  if (mode == "target") return RunTarget(static_cast<size_t>(n), block);
  if (mode != "local" && mode != "initiators") {
    std::fprintf(stderr, "storm_bench: unknown --mode=%s\n", mode.c_str());
    return 2;
  }
  const bool local = mode == "local";
  if (!local && a2a > 0) {
    std::fprintf(stderr, "storm_bench: --all_to_all runs in --mode=local\n");
    return 2;
  }
  if (!local && absl::GetFlag(FLAGS_metadata_server) == "embedded") {
    std::fprintf(stderr,
                 "storm_bench: --mode=initiators needs --metadata_server, "
                 "the one the target's engine serves or uses\n");
    return 2;
  }
  const std::string tag = absl::StrCat("storm-", getpid());
  const std::string target_name =
      local ? tag + "-target" : absl::GetFlag(FLAGS_segment_id);

  // Local: a target (N to 1) in this process runs the metadata service;
  // all-to-all: engine 0's embedded one, or the given server.
  std::unique_ptr<Engine> target;
  std::string metadata = absl::GetFlag(FLAGS_metadata_server);
  if (local && a2a == 0) {
    target = std::make_unique<Engine>();
    absl::Status s = InitEngine(target.get(), target_name, metadata,
                                static_cast<size_t>(n) * block, "127.0.0.1");
    if (!s.ok()) {
      std::fprintf(stderr, "storm_bench: target: %s\n", s.ToString().c_str());
      return 1;
    }
    metadata = target->engine.metadata_address();
  }
  std::vector<std::unique_ptr<Engine>> engines(n);
  const absl::Time t0 = absl::Now();
  if (a2a > 0 && metadata == "embedded") {
    engines[0] = std::make_unique<Engine>();
    absl::Status s = InitEngine(engines[0].get(), tag + "-0", metadata,
                                static_cast<size_t>(n) * block, LocalHostOf(0));
    if (!s.ok()) {
      std::fprintf(stderr, "storm_bench: engine 0: %s\n", s.ToString().c_str());
      return 1;
    }
    metadata = engines[0]->engine.metadata_address();
  }
  // Engines come up a few at a time (start-up is not what is measured).
  constexpr int kInitThreads = 8;
  std::vector<std::thread> init;
  std::atomic<int> init_failures{0};
  for (int t = 0; t < kInitThreads; ++t) {
    init.emplace_back([&, t] {
      for (int i = t; i < n; i += kInitThreads) {
        if (engines[i] != nullptr) continue;
        engines[i] = std::make_unique<Engine>();
        const std::string host =
            local ? LocalHostOf(i) : absl::GetFlag(FLAGS_listen_host);
        absl::Status st =
            InitEngine(engines[i].get(), absl::StrCat(tag, "-", i), metadata,
                       static_cast<size_t>(a2a > 0 ? n : 1) * block, host);
        if (!st.ok()) {
          engines[i]->error = st.ToString();
          init_failures.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : init) t.join();
  const double init_s = absl::ToDoubleSeconds(absl::Now() - t0);
  if (init_failures.load() > 0) {
    for (auto& e : engines) {
      if (!e->error.empty()) {
        std::fprintf(stderr, "storm_bench: %d engines failed to start: %s\n",
                     init_failures.load(), e->error.c_str());
        break;
      }
    }
    return 1;
  }

  // The storm: every engine on its own thread, all released at once.
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  // Blocking, not spinning: other hosts of a shared machine are still
  // starting their engines meanwhile.
  absl::Notification go;
  absl::Time start;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      std::vector<std::string> targets;
      if (a2a > 0) {
        for (int j = 0; j < n; ++j) {
          if (j != i) targets.push_back(absl::StrCat(tag, "-", j));
        }
      } else {
        targets.push_back(target_name);
      }
      ready.fetch_add(1);
      go.WaitForNotification();
      absl::Status st =
          Storm(engines[i].get(), targets,
                static_cast<size_t>(absl::GetFlag(FLAGS_slot_base) + i), block,
                start);
      if (!st.ok()) {
        engines[i]->first_s = -1;
        engines[i]->error = st.ToString();
      }
    });
  }
  while (ready.load() < n) absl::SleepFor(absl::Milliseconds(1));
  // A host up after --start_at joins a storm already under way: its times
  // would look better than they are, so its run fails (late_s says).
  double late_s = 0;
  if (const double at = absl::GetFlag(FLAGS_start_at); at > 0) {
    const absl::Time when =
        absl::FromUnixMicros(static_cast<int64_t>(at * 1e6));
    late_s = std::max(0.0, absl::ToDoubleSeconds(absl::Now() - when));
    if (late_s > 0) {
      std::fprintf(stderr, "storm_bench: up %.2f s after --start_at\n", late_s);
    }
    absl::SleepFor(when - absl::Now());
  }
  start = absl::Now();
  go.Notify();
  for (auto& t : threads) t.join();

  std::vector<double> times;
  int failures = 0;
  std::string first_error;
  Totals totals;
  for (auto& e : engines) {
    if (e->first_s < 0) {
      ++failures;
      if (first_error.empty()) first_error = e->error;
    } else {
      times.push_back(e->first_s);
    }
    AddStats(e->engine, &totals);
  }
  if (target != nullptr) {
    Totals t;
    AddStats(target->engine, &t);
    totals.qps += t.qps;
  }
  if (const std::string path = absl::GetFlag(FLAGS_times_out); !path.empty()) {
    if (FILE* f = std::fopen(path.c_str(), "w")) {
      for (auto& e : engines) std::fprintf(f, "%.6f\n", e->first_s);
      std::fclose(f);
    }
  }
  const double p50 = Percentile(times, 0.5), p99 = Percentile(times, 0.99),
               mx = Percentile(times, 1.0);
  if (!first_error.empty()) {
    std::fprintf(stderr, "storm_bench: %d failed; the first: %s\n", failures,
                 first_error.c_str());
  }
  if (absl::GetFlag(FLAGS_report) == "json") {
    std::printf(
        "{\"protocol\":\"%s\",\"engines\":%d,\"all_to_all\":%s,"
        "\"init_s\":%.3f,\"p50_s\":%.4f,\"p99_s\":%.4f,\"max_s\":%.4f,"
        "\"failures\":%d,\"handshake_rpcs\":%llu,\"qps\":%llu,"
        "\"late_s\":%.3f,\"max_rss_mib\":%.1f}\n",
        absl::GetFlag(FLAGS_protocol).c_str(), n, a2a > 0 ? "true" : "false",
        init_s, p50, p99, mx, failures,
        static_cast<unsigned long long>(totals.handshakes),
        static_cast<unsigned long long>(totals.qps), late_s, MaxRssMib());
  } else {
    std::printf(
        "%s %s: %d engines (up in %.2f s); first transfer done p50 %.3f s, "
        "p99 %.3f s, max %.3f s; %d failed; %llu handshakes, %llu QPs; "
        "max RSS %.0f MiB\n",
        absl::GetFlag(FLAGS_protocol).c_str(), a2a > 0 ? "all-to-all" : "storm",
        n, init_s, p50, p99, mx, failures,
        static_cast<unsigned long long>(totals.handshakes),
        static_cast<unsigned long long>(totals.qps), MaxRssMib());
  }
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_hold_s)));
  // Initiators go before the target they may still be talking to.
  engines.clear();
  target.reset();
  return failures == 0 && late_s == 0 ? 0 : 1;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "handshake storm: N engines open one target at once (or M engines "
      "each other); time to each one's first completed transfer");
  absl::ParseCommandLine(argc, argv);
  return ferry::Run();
}
