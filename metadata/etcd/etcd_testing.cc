#include "metadata/etcd/etcd_testing.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "metadata/etcd/etcd_store.h"
#include "rpc.grpc.pb.h"

namespace ferry::metadata {
namespace {

constexpr char kEtcd[] = "/usr/bin/etcd";

// A port nothing listens on right now (bound, read, released).
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = -1;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

bool Listening(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok =
      fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (fd >= 0) close(fd);
  return ok;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(
    int members, const std::vector<std::string>& extra_flags) {
  if (access(kEtcd, X_OK) != 0) {
    return absl::FailedPreconditionError(
        "etcd is not installed (apt-get install etcd-server; tools/dev.sh "
        "setup)");
  }
  static std::atomic<int> n{0};
  std::unique_ptr<EtcdCluster> c(new EtcdCluster);
  const char* tmp = std::getenv("TEST_TMPDIR");
  const int id = n.fetch_add(1);
  c->dir_ =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/etcd-", getpid(), "-", id);
  std::vector<int> client(members), peer(members);
  std::vector<std::string> initial;
  for (int i = 0; i < members; ++i) {
    client[i] = FreePort();
    peer[i] = FreePort();
    if (client[i] < 0 || peer[i] < 0 || client[i] == peer[i]) {
      return absl::UnavailableError("no free loopback port for etcd");
    }
    initial.push_back(absl::StrCat("m", i, "=http://127.0.0.1:", peer[i]));
    c->endpoints_.push_back(absl::StrCat("127.0.0.1:", client[i]));
  }
  for (int i = 0; i < members; ++i) {
    const std::string curl = absl::StrCat("http://127.0.0.1:", client[i]);
    const std::string purl = absl::StrCat("http://127.0.0.1:", peer[i]);
    std::vector<std::string> argv = {
        std::string(kEtcd),
        absl::StrCat("--name=m", i),
        absl::StrCat("--data-dir=", c->dir_, "/m", i),
        "--listen-client-urls=" + curl,
        "--advertise-client-urls=" + curl,
        "--listen-peer-urls=" + purl,
        "--initial-advertise-peer-urls=" + purl,
        "--initial-cluster=" + absl::StrJoin(initial, ","),
        "--initial-cluster-state=new",
        absl::StrCat("--initial-cluster-token=ferry-test-", getpid(), "-", id),
        "--heartbeat-interval=50",
        "--election-timeout=500",
        "--logger=zap",
        "--log-level=error",
    };
    argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
    auto p = testing::Subprocess::Start(argv);
    if (!p.ok()) return p.status();
    c->members_.push_back(std::move(*p));
  }
  // Listening first: a gRPC channel that found the port closed backs off
  // for seconds before it tries again.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  for (int port : client) {
    while (!Listening(port)) {
      if (absl::Now() > until) {
        return absl::DeadlineExceededError(
            absl::StrCat("etcd did not listen on port ", port, " in 20 s"));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  // Ready when a read goes through (a leader is elected).
  EtcdOptions o;
  o.endpoints = c->endpoints_;
  o.rpc_timeout = absl::Seconds(1);
  auto store = EtcdStore::Create(o);
  if (!store.ok()) return store.status();
  absl::Status last;
  while (absl::Now() < until) {
    last = (*store)->List().status();
    if (last.ok()) return c;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("etcd cluster of ", members,
                   " did not answer within 20 s: ", last.message()));
}

EtcdCluster::~EtcdCluster() {
  members_.clear();  // SIGKILLs and reaps them.
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string EtcdCluster::address() const {
  return absl::StrCat("etcd://", absl::StrJoin(endpoints_, ","));
}

void EtcdCluster::Kill(int i) { members_[i]->Kill(); }

absl::StatusOr<int> EtcdCluster::LeaderIndex() const {
  // Each member's own id (its Status header), and the leader's id as any
  // member reports it.
  std::vector<uint64_t> ids(endpoints_.size(), 0);
  uint64_t leader = 0;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    auto channel = grpc::CreateChannel("ipv4:" + endpoints_[i],
                                       grpc::InsecureChannelCredentials());
    auto stub = etcdserverpb::Maintenance::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    etcdserverpb::StatusRequest req;
    etcdserverpb::StatusResponse resp;
    if (!stub->Status(&ctx, req, &resp).ok()) continue;
    ids[i] = resp.header().member_id();
    if (resp.leader() != 0) leader = resp.leader();
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (leader != 0 && ids[i] == leader) return static_cast<int>(i);
  }
  return absl::UnavailableError("no etcd member names a leader");
}

absl::StatusOr<int64_t> EtcdCluster::Compact() {
  auto channel = grpc::CreateChannel("ipv4:" + endpoints_[0],
                                     grpc::InsecureChannelCredentials());
  auto kv = etcdserverpb::KV::NewStub(channel);
  etcdserverpb::RangeResponse range;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    etcdserverpb::RangeRequest req;
    req.set_key("compact-probe");
    grpc::Status s = kv->Range(&ctx, req, &range);
    if (!s.ok()) return absl::UnavailableError(s.error_message());
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  etcdserverpb::CompactionRequest req;
  req.set_revision(range.header().revision());
  req.set_physical(true);
  etcdserverpb::CompactionResponse resp;
  grpc::Status s = kv->Compact(&ctx, req, &resp);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return range.header().revision();
}

}  // namespace ferry::metadata
