// metadata_server: a standalone Ferry metadata service, for deployments
// where no engine should own the segment table.
//   metadata_server                      (every interface, port 12050)
//   metadata_server --listen=10.0.0.1:12050
//   metadata_server --data_dir=/var/lib/ferry-metadata   (survives restarts)
//   metadata_server --etcd=etcd://10.0.0.5:2379,10.0.0.6:2379  (several
//       servers share one etcd cluster's table)
// It raises its soft fd limit to the hard limit at start-up and caps its
// connections (see metadata/rpc_server.h): a flood of clients is refused,
// not allowed to make it deaf, and it answers again once they leave.
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/socket_util.h"
#include "ferry/etcd_limits.h"
#include "metadata/address/metadata_address.h"
#include "metadata/auth.h"
#include "metadata/durable_store.h"
#include "metadata/metadata_service.h"
#include "metadata/rpc_server.h"
#include "metadata/segment_store.h"
#include "metadata/tls.h"

// 12050 is below every Linux ephemeral range (32768-60999 by default), so
// a restart never finds it taken by an outgoing connection.
ABSL_FLAG(std::string, listen, "[::]:12050",
          "host:port or [ipv6]:port to serve on; [::] or 0.0.0.0 is every "
          "interface (port 0 picks one)");
ABSL_FLAG(int, max_connections, 0,
          "connections served at once; more are closed at once (0: a quarter "
          "of the fd limit, 16..4096)");
ABSL_FLAG(int, max_connections_per_peer, 0,
          "connections served at once per client address (0: half of "
          "--max_connections)");
ABSL_FLAG(absl::Duration, idle_timeout, absl::Minutes(2),
          "close a connection with no call for this long");
ABSL_FLAG(absl::Duration, handshake_timeout, absl::Seconds(5),
          "close a new connection that sends nothing for this long");
ABSL_FLAG(int, max_threads, 16,
          "threads running the handlers of calls (a slow reader holds none)");
ABSL_FLAG(std::string, data_dir, "",
          "keep the segment table in this directory (a snapshot and an "
          "fsync'd log), so that a restart, even after kill -9, keeps every "
          "segment; empty: in memory only");
ABSL_FLAG(std::string, auth_token_file, "",
          "answer only calls carrying the token in this file's first line "
          "(metadata/auth.h); give engines the same token. Empty: "
          "$FERRY_AUTH_TOKEN_FILE or $FERRY_AUTH_TOKEN, if set");
ABSL_FLAG(std::string, tls_ca_file, "",
          "serve mutual TLS (metadata/tls.h): the cluster CA's PEM "
          "certificate; clients must present a certificate it signed");
ABSL_FLAG(std::string, tls_cert_file, "",
          "this server's PEM certificate, signed by --tls_ca_file");
ABSL_FLAG(std::string, tls_key_file, "", "this server's PEM private key");
ABSL_FLAG(uint64_t, max_bytes, uint64_t{2} << 30,
          "bytes of memory segment descriptors may take in all (memory and "
          "durable stores; about 25 times their encoded size; with --etcd, "
          "see --etcd_max_bytes)");
ABSL_FLAG(uint64_t, max_client_bytes, uint64_t{256} << 20,
          "bytes of memory the segment descriptors of one client address "
          "may take");
ABSL_FLAG(uint64_t, max_client_segments, 4096,
          "segments one client address may hold (every store, etcd too)");
ABSL_FLAG(uint64_t, etcd_max_bytes, ferry::metadata::EtcdLimits{}.max_bytes,
          "with --etcd: bytes of keys and values (as etcd holds them) all "
          "segments under the prefix may take, so that etcd never reaches "
          "its NOSPACE alarm (its default quota is 2 GiB, history included)");
ABSL_FLAG(uint64_t, etcd_max_client_bytes,
          ferry::metadata::EtcdLimits{}.max_client_bytes,
          "with --etcd: bytes of keys and values the segments of one client "
          "address may take (--max_client_segments bounds their count)");
ABSL_FLAG(absl::Duration, etcd_compact_after,
          ferry::metadata::EtcdLimits{}.compact_after,
          "with --etcd: compact etcd's history older than this, and all of "
          "it once this server has written a quarter of --etcd_max_bytes "
          "since the last compaction (etcd-wide; "
          "0: never, where other applications share the etcd cluster and "
          "leave it to etcd's --auto-compaction-retention)");
ABSL_FLAG(absl::Duration, etcd_timeout, absl::Seconds(3),
          "with --etcd: the deadline of each etcd request this server makes "
          "(a put, a read, a lease renewal; retried within it while etcd is "
          "unavailable): raise it for a large or slow etcd cluster "
          "(100ms..5m)");
ABSL_FLAG(std::string, etcd, "",
          "keep the segment table in this etcd v3 cluster, "
          "etcd://host:port[,host:port...]: several metadata_servers (and "
          "engines with metadata etcd://) then share it");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }
}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  std::unique_ptr<ferry::metadata::Store> store;
  const std::string data_dir = absl::GetFlag(FLAGS_data_dir);
  ferry::metadata::SegmentStore::Limits limits;
  limits.max_bytes = absl::GetFlag(FLAGS_max_bytes);
  limits.max_client_bytes = absl::GetFlag(FLAGS_max_client_bytes);
  limits.max_client_segments = absl::GetFlag(FLAGS_max_client_segments);
  const std::string etcd = absl::GetFlag(FLAGS_etcd);
  if (!etcd.empty() && !data_dir.empty()) {
    std::fprintf(stderr,
                 "metadata_server: --etcd and --data_dir exclude "
                 "each other\n");
    return 1;
  }
  if (!etcd.empty()) {
    namespace md = ferry::metadata;
    auto a = md::ParseMetadataAddress(etcd);
    if (a.ok() && a->kind != md::MetadataAddress::Kind::kEtcd) {
      a = absl::InvalidArgumentError(
          "expected etcd://host:port[,host:port...]");
    }
    md::EtcdLimits etcd_limits;
    etcd_limits.max_bytes = absl::GetFlag(FLAGS_etcd_max_bytes);
    etcd_limits.max_client_bytes = absl::GetFlag(FLAGS_etcd_max_client_bytes);
    etcd_limits.max_client_segments = limits.max_client_segments;
    etcd_limits.compact_after = absl::GetFlag(FLAGS_etcd_compact_after);
    const absl::Duration etcd_timeout = absl::GetFlag(FLAGS_etcd_timeout);
    if (a.ok() && (etcd_timeout < absl::Milliseconds(100) ||
                   etcd_timeout > absl::Minutes(5))) {
      a = absl::InvalidArgumentError(
          absl::StrCat("--etcd_timeout must be 100ms..5m (",
                       absl::FormatDuration(etcd_timeout), ")"));
    }
    auto s = a.ok() ? md::ConnectStore(*a, etcd_timeout, "", nullptr, nullptr,
                                       etcd_limits)
                    : a.status();
    if (!s.ok()) {
      std::fprintf(stderr, "metadata_server: --etcd: %s\n",
                   s.status().ToString().c_str());
      return 1;
    }
    store = std::move(*s);
  } else if (data_dir.empty()) {
    auto mem = std::make_unique<ferry::metadata::SegmentStore>();
    mem->SetLimits(limits);
    store = std::move(mem);
  } else {
    auto durable = ferry::metadata::DurableStore::Open(data_dir);
    if (!durable.ok()) {
      std::fprintf(stderr, "metadata_server: %s\n",
                   durable.status().ToString().c_str());
      return 1;
    }
    const auto& r = (*durable)->recovery();
    std::printf(
        "metadata_server: store %s: %llu segments recovered (%llu log "
        "records replayed%s, %llu bytes of torn tail dropped, %llu records "
        "that did not apply again)\n",
        data_dir.c_str(), static_cast<unsigned long long>(r.segments),
        static_cast<unsigned long long>(r.log_records),
        r.had_snapshot ? " after the snapshot" : "",
        static_cast<unsigned long long>(r.torn_bytes),
        static_cast<unsigned long long>(r.replay_errors));
    (*durable)->SetLimits(limits);
    store = std::move(*durable);
  }
  ferry::metadata::CallPoolOptions pool;
  pool.max_threads = absl::GetFlag(FLAGS_max_threads);
  if (pool.max_threads < 1) {
    std::fprintf(stderr,
                 "metadata_server: --max_threads must be >= 1, not %d\n",
                 pool.max_threads);
    return 1;
  }
  ferry::metadata::MetadataServiceImpl service(store.get(), pool);
  std::string token;
  if (const std::string f = absl::GetFlag(FLAGS_auth_token_file); !f.empty()) {
    auto read = ferry::metadata::ReadAuthTokenFile(f);
    if (!read.ok()) {
      std::fprintf(stderr, "metadata_server: --auth_token_file: %s\n",
                   read.status().ToString().c_str());
      return 1;
    }
    token = *read;
  } else {
    auto from_env = ferry::metadata::AuthTokenFromEnv();
    if (!from_env.ok()) {
      std::fprintf(stderr, "metadata_server: %s\n",
                   from_env.status().ToString().c_str());
      return 1;
    }
    token = *from_env;
  }
  service.SetAuthToken(token);
  ferry::metadata::RpcServerOptions options;
  options.max_connections = absl::GetFlag(FLAGS_max_connections);
  options.max_connections_per_peer =
      absl::GetFlag(FLAGS_max_connections_per_peer);
  options.idle_timeout = absl::GetFlag(FLAGS_idle_timeout);
  options.handshake_timeout = absl::GetFlag(FLAGS_handshake_timeout);
  auto tls = ferry::metadata::Tls::Load({absl::GetFlag(FLAGS_tls_ca_file),
                                         absl::GetFlag(FLAGS_tls_cert_file),
                                         absl::GetFlag(FLAGS_tls_key_file)});
  if (!tls.ok()) {
    std::fprintf(stderr, "metadata_server: %s\n",
                 tls.status().ToString().c_str());
    return 1;
  }
  options.tls = *tls;
  auto server = ferry::metadata::RpcServer::Start(absl::GetFlag(FLAGS_listen),
                                                  {&service}, options);
  if (!server.ok()) {
    std::fprintf(stderr, "metadata_server: %s\n",
                 server.status().ToString().c_str());
    return 1;
  }
  if (token.empty() && options.tls == nullptr) {
    auto hp = ferry::ParseHostPort(absl::GetFlag(FLAGS_listen));
    if (hp.ok() && ferry::metadata::ListensBeyondLoopback(hp->host)) {
      ferry::metadata::WarnOpenServer("metadata_server", (*server)->address());
    }
  }
  std::printf("metadata_server listening on %s%s\n",
              (*server)->address().c_str(),
              options.tls != nullptr ? " (mutual TLS)" : "");
  std::fflush(stdout);
  while (!g_stop.load()) absl::SleepFor(absl::Milliseconds(100));
  const ferry::metadata::RpcServerStats st = (*server)->stats();
  (*server)->Shutdown();
  std::fprintf(stderr,
               "metadata_server: %llu connections served, %llu refused over "
               "the cap of %d, %llu silent ones dropped, %llu accepts out of "
               "fds\n",
               static_cast<unsigned long long>(st.accepted),
               static_cast<unsigned long long>(st.refused), st.max_connections,
               static_cast<unsigned long long>(st.handshake_timeouts),
               static_cast<unsigned long long>(st.fd_exhausted));
  return 0;
}
