// metadata_scale_bench: the metadata plane at scale (issue 29). Many
// segments of many buffers are published in one metadata service, read
// back, and watched, through the APIs engines use:
//   - put: PutSegment of each whole descriptor (what SegmentPublisher
//     sends when it publishes or republishes a segment), MetadataClient;
//   - get: GetSegment of segments picked across the table (what an engine
//     does when it opens a segment), the descriptor validated by the
//     client and its buffer count checked;
//   - watch: WatchSegment streams (what SegmentCache opens for every
//     segment it holds), each on its own segment; then one UpdateBuffers
//     adding one buffer (a registration) to each watched segment, timed
//     from the start of that call to the watcher's callback.
// The service is the standalone tools/metadata_server, a child process,
// so that its memory (VmRSS, VmHWM) is its own; with --backend=etcd it
// serves an etcd started here (or the one at --etcd), whose memory is
// reported too. One process stands for every engine, so the server's
// per-client quotas are raised to hold the whole table; the watchers'
// connections leave from several loopback addresses (127.0.0.2, ...) so
// that no address passes the service's cap of 256 watches per caller,
// as engines on several hosts would not.
//   bazel build -c opt //bench:metadata_scale_bench //tools:metadata_server
//   bazel-bin/bench/metadata_scale_bench --segments=10000 --buffers=1000
//       --watchers=1000 --backend=memory|durable|etcd --report=json
// Every wait is bounded; the children (metadata_server, etcd) are killed
// and the temporary directories removed on exit, on SIGINT and SIGTERM
// too (the run stops at the next step).
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/percentile.h"
#include "metadata/etcd/etcd_testing.h"
#include "metadata/metadata_client.h"
#include "metadata/proto/metadata.pb.h"
#include "metadata/store.h"
#include "testing/process_usage.h"
#include "testing/subprocess.h"

ABSL_FLAG(int, segments, 10000, "segments published");
ABSL_FLAG(int, buffers, 1000, "buffers per segment (two NIC keys each)");
ABSL_FLAG(int, watchers, 1000,
          "WatchSegment streams, each on its own segment (spread across "
          "the table; several per segment once there are more watchers "
          "than segments)");
ABSL_FLAG(std::string, backend, "memory",
          "the metadata_server's store: memory, durable (--data_dir in a "
          "temporary directory) or etcd");
ABSL_FLAG(std::string, etcd, "",
          "with --backend=etcd: etcd://host:port of a running etcd; empty: "
          "start /usr/bin/etcd on loopback in a temporary directory");
ABSL_FLAG(std::string, report, "text", "text, or json: one JSON line");
ABSL_FLAG(int, threads, 2,
          "client threads putting, getting and updating, each with its own "
          "MetadataClient (connection)");
ABSL_FLAG(int, gets, 2000, "GetSegment calls, spread across the segments");
ABSL_FLAG(int, watchers_per_client, 250,
          "watch streams per MetadataClient (which puts 16 on a connection)");
ABSL_FLAG(int, watches_per_source, 128,
          "watch streams per loopback source address at most (the service "
          "refuses a caller's 257th)");
ABSL_FLAG(std::string, metadata_server, "",
          "the metadata_server binary; empty: ../tools/metadata_server "
          "beside this one (bazel-bin)");
ABSL_FLAG(uint64_t, etcd_quota_bytes, uint64_t{8} << 30,
          "--quota-backend-bytes of the etcd started here (etcd's default, "
          "2 GiB, is less than 10,000 x 1,000 buffers take)");
ABSL_FLAG(absl::Duration, rpc_timeout, absl::Seconds(30),
          "deadline of each metadata call");
ABSL_FLAG(absl::Duration, watch_wait, absl::Seconds(60),
          "how long after the last update the watchers' events are awaited");

namespace ferry {
namespace {

namespace md = metadata;

// Set by SIGINT/SIGTERM: every loop stops at its next step, and the
// children and directories are cleaned up as on a normal exit.
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

// --- Loopback source addresses -------------------------------------------
// The service caps one caller address at 256 watch streams
// (MetadataServiceImpl::kMaxWatchesPerCaller), and every connection from
// this process would come from 127.0.0.1. gRPC has no public way to bind
// a channel's source address, so connect() is interposed: a connection to
// the metadata server's port is bound first to the next of `g_sources`
// addresses 127.0.0.2, 127.0.0.3, ... in turn (all of 127/8 is the
// loopback interface's; no root needed). MetadataClient opens one
// connection per 16 watches, so these spread evenly.
std::atomic<int> g_server_port{0};
std::atomic<int> g_sources{0};  // 0: connections as they are.
std::atomic<uint32_t> g_next_source{0};

void BindSource(int fd, const sockaddr* to) {
  const int sources = g_sources.load();
  const int port = g_server_port.load();
  if (sources <= 0 || port == 0 || to == nullptr) return;
  const uint32_t host =
      INADDR_LOOPBACK + 1 + g_next_source.fetch_add(1) % sources;
  if (to->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(to);
    if (ntohs(in->sin_port) != port) return;
    sockaddr_in from{};
    from.sin_family = AF_INET;
    from.sin_addr.s_addr = htonl(host);
    bind(fd, reinterpret_cast<const sockaddr*>(&from), sizeof(from));
  } else if (to->sa_family == AF_INET6) {
    // gRPC's dual-stack sockets reach IPv4 as ::ffff:a.b.c.d.
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(to);
    if (ntohs(in6->sin6_port) != port ||
        !IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      return;
    }
    sockaddr_in6 from{};
    from.sin6_family = AF_INET6;
    from.sin6_addr.s6_addr[10] = 0xff;
    from.sin6_addr.s6_addr[11] = 0xff;
    const uint32_t be = htonl(host);
    std::memcpy(&from.sin6_addr.s6_addr[12], &be, 4);
    bind(fd, reinterpret_cast<const sockaddr*>(&from), sizeof(from));
  }
}

}  // namespace
}  // namespace ferry

// The interposed connect (see BindSource): gRPC's calls resolve to it
// before libc's.
extern "C" int connect(int fd, const struct sockaddr* addr, socklen_t len) {
  using ConnectFn = int (*)(int, const sockaddr*, socklen_t);
  static const ConnectFn real =
      reinterpret_cast<ConnectFn>(dlsym(RTLD_NEXT, "connect"));
  ferry::BindSource(fd, addr);
  return real(fd, addr, len);
}

namespace ferry {
namespace {

constexpr int kNics = 2;
constexpr uint64_t kBase = 0x10000000;
constexpr uint64_t kStride = 0x100000;  // Each buffer 1 MiB, 1 MiB apart.
// Quotas that hold any table this benchmark builds: one process stands
// for every engine, and the service's per-client limits are for a real
// client address.
constexpr uint64_t kUnlimitedBytes = uint64_t{1} << 50;
constexpr uint64_t kUnlimitedSegments = uint64_t{1} << 30;
// Lease of every segment: the longest a service grants; the run is
// shorter, so nothing is renewed.
constexpr int64_t kLeaseMs = 3600 * 1000;

std::string SegmentName(int s) { return absl::StrFormat("seg-%06d", s); }

descriptor::Buffer MakeBuffer(int i) {
  descriptor::Buffer b;
  b.set_addr(kBase + uint64_t(i) * kStride);
  b.set_length(kStride);
  b.set_location("cpu:0");
  for (int n = 0; n < kNics; ++n) {
    descriptor::NicKey* k = b.add_keys();
    k->set_nic(absl::StrCat("mlx5_", n));
    k->set_rkey(static_cast<uint32_t>(1000 + i));
  }
  return b;
}

// A segment as an RDMA engine with two NICs publishes it.
descriptor::SegmentDescriptor MakeSegment(int s, int buffers) {
  descriptor::SegmentDescriptor d;
  d.set_name(SegmentName(s));
  d.set_incarnation(1);
  d.set_rpc_address("127.0.0.1:1");
  descriptor::TransportEndpoint* t = d.add_transports();
  t->set_transport("rdma");
  for (int n = 0; n < kNics; ++n) {
    descriptor::Device* dev = t->add_devices();
    dev->set_name(absl::StrCat("mlx5_", n));
    dev->set_gid(std::string(16, '\1'));
  }
  for (int i = 0; i < buffers; ++i) *d.add_buffers() = MakeBuffer(i);
  return d;
}

// Latencies of one kind of call, and its failures (the first few said).
class Samples {
 public:
  void Add(absl::Duration d) {
    MutexLock lock(&mu_);
    ms_.push_back(absl::ToDoubleMilliseconds(d));
  }
  void Fail(const std::string& what, const absl::Status& s) {
    MutexLock lock(&mu_);
    if (++failures_ <= 3) {
      std::fprintf(stderr, "metadata_scale_bench: %s: %s\n", what.c_str(),
                   s.ToString().c_str());
    }
  }
  int failures() const {
    MutexLock lock(&mu_);
    return failures_;
  }
  size_t count() const {
    MutexLock lock(&mu_);
    return ms_.size();
  }
  double Quantile(double q) {
    MutexLock lock(&mu_);
    return Percentile(ms_, q);
  }
  std::string Json(const std::string& name) {
    return absl::StrFormat(
        "\"%s_count\":%d,\"%s_failures\":%d,\"%s_p50_ms\":%.3f,"
        "\"%s_p99_ms\":%.3f,\"%s_max_ms\":%.3f",
        name, count(), name, failures(), name, Quantile(0.5), name,
        Quantile(0.99), name, Quantile(1.0));
  }
  std::string Text(const std::string& name) {
    return absl::StrFormat(
        "%-7s %8d calls, %d failed: p50 %.2f ms, p99 %.2f ms, max %.2f ms",
        name, count(), failures(), Quantile(0.5), Quantile(0.99),
        Quantile(1.0));
  }

 private:
  mutable Mutex mu_;
  std::vector<double> ms_ ABSL_GUARDED_BY(mu_);
  int failures_ ABSL_GUARDED_BY(mu_) = 0;
};

// Runs fn(i) for i in [0, n) on `threads` threads, each with its own
// client; stops early on a signal.
template <typename Fn>
void ParallelFor(int n, int threads, const std::string& address, Fn fn) {
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      md::MetadataClient client(address, absl::GetFlag(FLAGS_rpc_timeout));
      for (int i = next.fetch_add(1); i < n && !g_stop.load();
           i = next.fetch_add(1)) {
        fn(client, i);
      }
    });
  }
  for (std::thread& t : pool) t.join();
}

struct Memory {
  int64_t rss_kb = -1;
  int64_t hwm_kb = -1;
};

// VmRSS and VmHWM of `pid` (-1 if unreadable).
Memory ReadMemory(pid_t pid) {
  Memory m;
  if (auto u = testing::ReadProcessUsage(pid); u.ok()) {
    m.rss_kb = u->rss_kb;
    m.hwm_kb = u->hwm_kb;
  }
  return m;
}

double Mib(int64_t kb) { return kb < 0 ? -1 : kb / 1024.0; }

// Bytes of the files under `dir` (the durable store's snapshot and log).
uint64_t DiskBytes(const std::string& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file(ec)) total += it->file_size(ec);
  }
  return total;
}

std::string DefaultServerPath() {
  std::error_code ec;
  const std::filesystem::path self =
      std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "tools/metadata_server";
  return (self.parent_path().parent_path() / "tools" / "metadata_server")
      .string();
}

// What the run starts, stopped and removed however it ends.
struct Children {
  std::string tmp;  // Temporary directory (durable store), or empty.
  std::unique_ptr<md::EtcdCluster> etcd;
  std::unique_ptr<testing::Subprocess> server;
  ~Children() {
    server.reset();  // SIGKILLs and reaps it.
    etcd.reset();    // Likewise, and removes its data directory.
    if (!tmp.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(tmp, ec);
    }
  }
};

// Starts metadata_server on a loopback port and returns its address.
absl::StatusOr<std::string> StartServer(Children* c, const std::string& backend,
                                        const std::string& etcd) {
  std::string path = absl::GetFlag(FLAGS_metadata_server);
  if (path.empty()) path = DefaultServerPath();
  if (access(path.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no metadata_server at ", path,
        " (bazel build //tools:metadata_server, or --metadata_server)"));
  }
  std::vector<std::string> argv = {
      path,
      "--listen=127.0.0.1:0",
      absl::StrCat("--max_bytes=", kUnlimitedBytes),
      absl::StrCat("--max_client_bytes=", kUnlimitedBytes),
      absl::StrCat("--max_client_segments=", kUnlimitedSegments),
  };
  if (backend == "durable") {
    argv.push_back(absl::StrCat("--data_dir=", c->tmp, "/store"));
  } else if (backend == "etcd") {
    argv.push_back("--etcd=" + etcd);
    argv.push_back(absl::StrCat("--etcd_max_bytes=", kUnlimitedBytes));
    argv.push_back(absl::StrCat("--etcd_max_client_bytes=", kUnlimitedBytes));
  }
  auto p = testing::Subprocess::Start(argv);
  if (!p.ok()) return p.status();
  c->server = std::move(*p);
  // The durable store says what it recovered first; then the address.
  constexpr char kListening[] = "metadata_server listening on ";
  for (int line = 0; line < 5; ++line) {
    auto l = c->server->ReadLine(absl::Seconds(60));
    if (!l.ok()) {
      return absl::UnavailableError(
          absl::StrCat("metadata_server did not say where it listens: ",
                       l.status().ToString()));
    }
    if (absl::StartsWith(*l, kListening)) {
      std::string addr = l->substr(sizeof(kListening) - 1);
      const size_t space = addr.find(' ');
      if (space != std::string::npos) addr.resize(space);
      return addr;
    }
  }
  return absl::UnavailableError("metadata_server did not start");
}

int Run() {
  const int segments = absl::GetFlag(FLAGS_segments);
  const int buffers = absl::GetFlag(FLAGS_buffers);
  const int watchers = absl::GetFlag(FLAGS_watchers);
  const int threads = absl::GetFlag(FLAGS_threads);
  const int gets = absl::GetFlag(FLAGS_gets);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const std::string report = absl::GetFlag(FLAGS_report);
  if (segments < 1 || buffers < 0 || watchers < 0 || threads < 1 || gets < 0 ||
      absl::GetFlag(FLAGS_watchers_per_client) < 1 ||
      absl::GetFlag(FLAGS_watches_per_source) < 1) {
    std::fprintf(stderr,
                 "metadata_scale_bench: --segments and --threads must be at "
                 "least 1, the other counts at least 0 (per-client and "
                 "per-source counts at least 1)\n");
    return 2;
  }
  if (backend != "memory" && backend != "durable" && backend != "etcd") {
    std::fprintf(stderr,
                 "metadata_scale_bench: --backend must be memory, durable or "
                 "etcd, not '%s'\n",
                 backend.c_str());
    return 2;
  }
  if (report != "text" && report != "json") {
    std::fprintf(stderr,
                 "metadata_scale_bench: --report must be text or json\n");
    return 2;
  }
  if (!absl::GetFlag(FLAGS_etcd).empty() && backend != "etcd") {
    std::fprintf(stderr, "metadata_scale_bench: --etcd needs --backend=etcd\n");
    return 2;
  }
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);

  Children children;
  if (backend == "durable") {
    const char* t = std::getenv("TMPDIR");
    std::string dir =
        absl::StrCat(t != nullptr ? t : "/tmp", "/metadata_scale_bench-XXXXXX");
    if (mkdtemp(dir.data()) == nullptr) {
      std::perror("metadata_scale_bench: mkdtemp");
      return 1;
    }
    children.tmp = dir;
  }
  std::string etcd = absl::GetFlag(FLAGS_etcd);
  if (backend == "etcd" && etcd.empty()) {
    auto e = md::EtcdCluster::Start(
        1, {absl::StrCat("--quota-backend-bytes=",
                         absl::GetFlag(FLAGS_etcd_quota_bytes))});
    if (!e.ok()) {
      std::fprintf(stderr, "metadata_scale_bench: etcd: %s\n",
                   e.status().ToString().c_str());
      return 1;
    }
    children.etcd = std::move(*e);
    etcd = children.etcd->address();
  }
  auto address = StartServer(&children, backend, etcd);
  if (!address.ok()) {
    std::fprintf(stderr, "metadata_scale_bench: %s\n",
                 address.status().ToString().c_str());
    return 1;
  }
  {
    const size_t colon = address->rfind(':');
    int port = 0;
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(address->substr(colon + 1), &port)) {
      std::fprintf(stderr, "metadata_scale_bench: odd address %s\n",
                   address->c_str());
      return 1;
    }
    g_server_port.store(port);
  }
  const pid_t server_pid = children.server->pid();
  const pid_t etcd_pid = children.etcd ? children.etcd->pid(0) : -1;

  // Put: every segment whole, with its lease.
  std::vector<std::string> owners(segments);
  for (std::string& k : owners) k = md::NewOwnerKey();
  std::vector<uint64_t> versions(segments, 0);
  Samples put;
  uint64_t descriptor_bytes = 0;
  const absl::Time put_start = absl::Now();
  ParallelFor(segments, threads, *address,
              [&](md::MetadataClient& client, int s) {
                md::PutSegmentRequest req;
                *req.mutable_segment() = MakeSegment(s, buffers);
                req.set_owner_key(owners[s]);
                req.set_lease_ttl_ms(kLeaseMs);
                if (s == 0) descriptor_bytes = req.segment().ByteSizeLong();
                const absl::Time t0 = absl::Now();
                auto v = client.Put(req);
                if (!v.ok()) return put.Fail(SegmentName(s), v.status());
                put.Add(absl::Now() - t0);
                versions[s] = *v;
              });
  const double put_seconds = absl::ToDoubleSeconds(absl::Now() - put_start);
  const Memory after_put = ReadMemory(server_pid);
  const Memory etcd_after_put = etcd_pid > 0 ? ReadMemory(etcd_pid) : Memory{};

  // Get: segments across the table (a prime stride), each checked whole.
  Samples get;
  ParallelFor(gets, threads, *address, [&](md::MetadataClient& client, int k) {
    const int s = static_cast<int>((int64_t{k} * 7919) % segments);
    const absl::Time t0 = absl::Now();
    auto d = client.Get(SegmentName(s));
    if (!d.ok()) return get.Fail(SegmentName(s), d.status());
    const absl::Duration took = absl::Now() - t0;
    if (d->buffers_size() != buffers || d->name() != SegmentName(s)) {
      return get.Fail(SegmentName(s),
                      absl::DataLossError(absl::StrCat(
                          "read back ", d->buffers_size(), " buffers of ",
                          buffers, " (", d->name(), ")")));
    }
    get.Add(took);
  });
  const Memory after_get = ReadMemory(server_pid);

  // Watch: each watcher on a segment of its own (spread across the
  // table), from its segment's current version.
  struct Watcher {
    int segment = 0;
    Mutex mu;
    // (version, arrival) of each event, in arrival order.
    std::vector<std::pair<uint64_t, absl::Time>> events ABSL_GUARDED_BY(mu);
    bool gone ABSL_GUARDED_BY(mu) = false;
    // Refused, ended, or missed the first round's event: a failed
    // stream, left out of the measured round. Main thread only.
    bool failed = false;
    std::unique_ptr<md::Watch> watch;
  };
  std::vector<std::unique_ptr<Watcher>> ws;
  std::vector<std::vector<Watcher*>> watchers_of(segments);
  const int per_client = absl::GetFlag(FLAGS_watchers_per_client);
  const int per_source = absl::GetFlag(FLAGS_watches_per_source);
  g_sources.store((watchers + per_source - 1) / per_source);
  std::vector<std::unique_ptr<md::MetadataClient>> watch_clients;
  Samples update, delivery;
  int watch_refused = 0;
  for (int w = 0; w < watchers && !g_stop.load(); ++w) {
    if (w % per_client == 0) {
      watch_clients.push_back(std::make_unique<md::MetadataClient>(
          *address, absl::GetFlag(FLAGS_rpc_timeout)));
    }
    auto watcher = std::make_unique<Watcher>();
    Watcher* raw = watcher.get();
    raw->segment = static_cast<int>((int64_t{w} * segments) / watchers);
    if (watchers > segments) raw->segment = w % segments;
    auto watch = watch_clients.back()->WatchSegment(
        SegmentName(raw->segment), versions[raw->segment],
        [raw](const md::SegmentEvent& ev) {
          const absl::Time now = absl::Now();
          MutexLock lock(&raw->mu);
          if (ev.gone()) raw->gone = true;
          raw->events.emplace_back(ev.version(), now);
        });
    if (!watch.ok()) {
      if (++watch_refused <= 3) {
        std::fprintf(stderr, "metadata_scale_bench: watch %d: %s\n", w,
                     watch.status().ToString().c_str());
      }
      continue;
    }
    raw->watch = std::move(*watch);
    watchers_of[raw->segment].push_back(raw);
    ws.push_back(std::move(watcher));
  }
  std::vector<int> watched;
  for (int s = 0; s < segments; ++s) {
    if (!watchers_of[s].empty()) watched.push_back(s);
  }
  // Two rounds of one registration per watched segment: the first opens
  // the streams (a stream the service refused never sees its event: it
  // counts as a failed delivery), the second is measured.
  for (int round = 0; round < 2 && !g_stop.load(); ++round) {
    std::vector<uint64_t> want(watched.size(), 0);
    std::vector<absl::Time> started(watched.size());
    ParallelFor(static_cast<int>(watched.size()), threads, *address,
                [&](md::MetadataClient& client, int k) {
                  const int s = watched[k];
                  md::UpdateBuffersRequest req;
                  req.set_name(SegmentName(s));
                  req.set_owner_key(owners[s]);
                  *req.add_add() = MakeBuffer(buffers + round);
                  const absl::Time t0 = absl::Now();
                  auto v = client.UpdateBuffers(req);
                  if (!v.ok()) {
                    if (round == 1) update.Fail(SegmentName(s), v.status());
                    return;
                  }
                  if (round == 1) update.Add(absl::Now() - t0);
                  want[k] = *v;
                  started[k] = t0;
                });
    // Each watcher's first event at or past its segment's new version.
    const absl::Time until = absl::Now() + absl::GetFlag(FLAGS_watch_wait);
    for (size_t k = 0; k < watched.size(); ++k) {
      if (want[k] == 0) continue;  // The update failed (counted).
      for (Watcher* w : watchers_of[watched[k]]) {
        if (w->failed) continue;
        std::optional<absl::Time> seen;
        bool gone = false;
        while (!seen && !gone && !g_stop.load()) {
          {
            MutexLock lock(&w->mu);
            gone = w->gone;
            for (const auto& [v, at] : w->events) {
              if (v >= want[k]) {
                seen = at;
                break;
              }
            }
          }
          if (seen || absl::Now() > until) break;
          absl::SleepFor(absl::Milliseconds(1));
        }
        if (round == 0) {
          if (!seen) w->failed = true;
          continue;
        }
        if (seen) {
          delivery.Add(*seen - started[k]);
        } else {
          delivery.Fail(SegmentName(watched[k]),
                        absl::DeadlineExceededError("no event in time"));
        }
      }
    }
  }
  const Memory end = ReadMemory(server_pid);
  const Memory etcd_end = etcd_pid > 0 ? ReadMemory(etcd_pid) : Memory{};
  int failed_streams = watch_refused;
  for (auto& w : ws) {
    MutexLock lock(&w->mu);
    if (w->failed || w->gone) ++failed_streams;
  }
  for (auto& w : ws) w->watch.reset();
  watch_clients.clear();
  const uint64_t disk = children.tmp.empty() ? 0 : DiskBytes(children.tmp);
  const int watch_failures = failed_streams;
  const int failures = put.failures() + get.failures() + update.failures() +
                       delivery.failures() + watch_failures +
                       (g_stop.load() ? 1 : 0);

  if (report == "json") {
    absl::PrintF(
        "{\"backend\":\"%s\",\"segments\":%d,\"buffers\":%d,\"watchers\":%d,"
        "\"threads\":%d,\"descriptor_bytes\":%llu,\"put_seconds\":%.3f,%s,%s,"
        "%s,%s,\"watch_streams\":%zu,\"watch_sources\":%d,"
        "\"watch_stream_failures\":%d,\"server_rss_after_put_mib\":%.1f,"
        "\"server_rss_after_get_mib\":%.1f,\"server_rss_mib\":%.1f,"
        "\"server_hwm_mib\":%.1f,\"etcd_rss_after_put_mib\":%.1f,"
        "\"etcd_rss_mib\":%.1f,\"etcd_hwm_mib\":%.1f,\"disk_mib\":%.1f,"
        "\"failures\":%d}\n",
        backend, segments, buffers, watchers, threads, descriptor_bytes,
        put_seconds, put.Json("put"), get.Json("get"), update.Json("update"),
        delivery.Json("watch"), ws.size(), g_sources.load(), watch_failures,
        Mib(after_put.rss_kb), Mib(after_get.rss_kb), Mib(end.rss_kb),
        Mib(end.hwm_kb), Mib(etcd_after_put.rss_kb), Mib(etcd_end.rss_kb),
        Mib(etcd_end.hwm_kb), disk / 1048576.0, failures);
  } else {
    std::printf(
        "%s: %d segments x %d buffers (%llu bytes encoded each), %d "
        "watchers, %d threads\n",
        backend.c_str(), segments, buffers,
        static_cast<unsigned long long>(descriptor_bytes), watchers, threads);
    std::printf("%s (%.1f s in all)\n%s\n%s\n%s\n", put.Text("put").c_str(),
                put_seconds, get.Text("get").c_str(),
                update.Text("update").c_str(), delivery.Text("watch").c_str());
    std::printf("watch streams %zu from %d source addresses, %d failed\n",
                ws.size(), g_sources.load(), watch_failures);
    std::printf(
        "metadata_server RSS %.0f MiB after put, %.0f after get, %.0f at "
        "end, peak %.0f\n",
        Mib(after_put.rss_kb), Mib(after_get.rss_kb), Mib(end.rss_kb),
        Mib(end.hwm_kb));
    if (etcd_pid > 0) {
      std::printf("etcd RSS %.0f MiB after put, %.0f at end, peak %.0f\n",
                  Mib(etcd_after_put.rss_kb), Mib(etcd_end.rss_kb),
                  Mib(etcd_end.hwm_kb));
    }
    if (!children.tmp.empty()) {
      std::printf("durable store on disk: %.1f MiB\n", disk / 1048576.0);
    }
    std::printf("%d failures\n", failures);
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return ferry::Run();
}
