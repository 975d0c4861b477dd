#include "metadata/rpc_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "absl/container/flat_hash_map.h"
#include "absl/numeric/int128.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/happens_before.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/server_posix.h"
#include "metadata/connection_peers.h"
#include "metadata/grpc_deadline.h"
#include "metadata/validation.h"

namespace ferry::metadata {
namespace {

constexpr absl::Duration kMinBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
// Finding the connections gRPC has closed costs an fstat per connection,
// so a full server does it at most this often and refuses in between.
constexpr absl::Duration kPruneInterval = absl::Milliseconds(10);
constexpr absl::Duration kLogInterval = absl::Seconds(10);
// Accepts per wake-up, so pending handshakes are looked at during a flood.
constexpr int kAcceptsPerWakeup = 64;
// Fewer threads than this and the sync server cannot poll its queues.
constexpr int kMinThreads = 8;
constexpr int kKeepaliveMs = 60 * 1000;
constexpr int kKeepaliveTimeoutMs = 20 * 1000;
// poll(2) waits on the system clock: on another clock it cannot know when
// that clock reaches a deadline, so it looks at the clock this often.
constexpr int kOtherClockPollMs = 2;

int OpenSpareFd() { return ::open("/dev/null", O_RDONLY | O_CLOEXEC); }

int ToMs(absl::Duration d) {
  return static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, int64_t{1} << 30));
}

}  // namespace

absl::StatusOr<uint64_t> RaiseFdLimitToHard() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return absl::InternalError(
        absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  if (lim.rlim_cur >= lim.rlim_max) return lim.rlim_cur;
  const rlim_t old = lim.rlim_cur;
  lim.rlim_cur = lim.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return absl::InternalError(
        absl::StrCat("setrlimit(RLIMIT_NOFILE, ", lim.rlim_max,
                     "): ", std::strerror(errno), "; staying at ", old));
  }
  return lim.rlim_cur;
}

namespace {

// A timeout the server can act on: a zero one would close every client
// before it spoke, an infinite one would never free its connection.
absl::Status CheckTimeout(const char* name, absl::Duration d) {
  if (d <= absl::ZeroDuration() || d == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("RpcServerOptions.", name, " must be > 0 and finite, not ",
                     absl::FormatDuration(d)));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const RpcServerOptions& o) {
  if (o.max_connections < 0 || o.max_connections_per_peer < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RpcServerOptions.max_connections (", o.max_connections,
        ") and max_connections_per_peer (", o.max_connections_per_peer,
        ") must be >= 0 (0: derived from the fd limit)"));
  }
  if (o.max_threads < 1 || o.max_streams_per_connection < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("RpcServerOptions.max_threads (", o.max_threads,
                     ") and max_streams_per_connection (",
                     o.max_streams_per_connection, ") must be >= 1"));
  }
  if (absl::Status s = CheckTimeout("handshake_timeout", o.handshake_timeout);
      !s.ok()) {
    return s;
  }
  return CheckTimeout("idle_timeout", o.idle_timeout);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(
    const std::string& listen_address,
    const std::vector<grpc::Service*>& services,
    const RpcServerOptions& options) {
  auto hp = ParseHostPort(listen_address);
  if (!hp.ok()) return hp.status();
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  auto fd_limit = RaiseFdLimitToHard();
  if (!fd_limit.ok()) {
    std::fprintf(stderr, "ferry rpc server: %s\n",
                 fd_limit.status().ToString().c_str());
  }
  std::unique_ptr<RpcServer> server(new RpcServer());
  server->options_ = options;
  server->clock_ = ClockOrReal(options.clock);
  RpcServerOptions& o = server->options_;
  if (o.max_connections <= 0) {
    const uint64_t limit = fd_limit.ok() ? *fd_limit : 1024;
    o.max_connections =
        static_cast<int>(std::clamp<uint64_t>(limit / 4, 16, 4096));
  }
  if (o.max_connections_per_peer <= 0) {
    o.max_connections_per_peer = std::max(1, o.max_connections / 2);
  }
  o.max_threads = std::max(o.max_threads, kMinThreads);

  if (o.tls != nullptr) return StartTls(listen_address, services, o);
  uint16_t bound_port = 0;
  auto listen_fd = ListenTcp(hp->host, hp->port, &bound_port);
  if (!listen_fd.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot start gRPC server on ",
                                               listen_address, ": ",
                                               listen_fd.status().message()));
  }
  server->listen_fd_ = std::move(*listen_fd);
  if (::fcntl(server->listen_fd_.get(), F_SETFL, O_NONBLOCK) != 0) {
    return absl::InternalError(
        absl::StrCat("fcntl(O_NONBLOCK): ", std::strerror(errno)));
  }
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  server->wake_read_.Reset(wake[0]);
  server->wake_write_.Reset(wake[1]);

  grpc::ServerBuilder builder;
  Configure(services, o, &builder);
  // No listening port: connections come from AcceptLoop.
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot start gRPC server for ", listen_address));
  }
  server->address_ = JoinHostPort(hp->host, bound_port);
  server->port_ = bound_port;
  try {
    server->accept_thread_ =
        std::thread([s = server.get()] { s->AcceptLoop(); });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot start the accept thread of ", listen_address, ": ", e.what()));
  }
  return server;
}

void RpcServer::Configure(const std::vector<grpc::Service*>& services,
                          const RpcServerOptions& o,
                          grpc::ServerBuilder* builder) {
  builder->SetMaxReceiveMessageSize(kMaxRpcMessageBytes);
  builder->SetMaxSendMessageSize(kMaxRpcMessageBytes);
  grpc::ResourceQuota quota("ferry-rpc-server");
  quota.SetMaxThreads(o.max_threads);
  builder->SetResourceQuota(quota);
  builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                              o.max_streams_per_connection);
  builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                              ToMs(o.idle_timeout));
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                              kKeepaliveTimeoutMs);
  // Bounds a TLS handshake (gRPC's own listener; without TLS the accept
  // loop bounds the first bytes).
  builder->AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                              ToMs(o.handshake_timeout));
  for (grpc::Service* s : services) {
    // What the service's constructor wrote is ordered before its calls by
    // gRPC's own (uninstrumented) synchronization: tell TSan
    // (common/happens_before.h); handlers mark HappensAfter(service).
    HappensBefore(s);
    builder->RegisterService(s);
  }
}

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::StartTls(
    const std::string& listen_address,
    const std::vector<grpc::Service*>& services, const RpcServerOptions& o) {
  auto hp = ParseHostPort(listen_address);
  if (!hp.ok()) return hp.status();
  std::unique_ptr<RpcServer> server(new RpcServer());
  server->options_ = o;
  grpc::ServerBuilder builder;
  Configure(services, o, &builder);
  int bound_port = 0;
  builder.AddListeningPort(JoinHostPort(hp->host, hp->port),
                           o.tls->ServerCredentials(), &bound_port);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || bound_port <= 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    return absl::UnavailableError(absl::StrCat(
        "cannot start gRPC server with TLS on ", listen_address,
        " (port taken, or the certificate and key do not match; gRPC "
        "logs say which)"));
  }
  server->address_ = JoinHostPort(hp->host, bound_port);
  server->port_ = static_cast<uint16_t>(bound_port);
  return server;
}

RpcServer::~RpcServer() { Shutdown(); }

RpcServerStats RpcServer::stats() const {
  RpcServerStats s;
  s.accepted = accepted_.load();
  s.refused = refused_.load();
  s.handshake_timeouts = handshake_timeouts_.load();
  s.fd_exhausted = fd_exhausted_.load();
  s.max_connections = options_.max_connections;
  return s;
}

void RpcServer::Shutdown() {
  if (server_ == nullptr) return;
  stopping_.store(true);
  const char byte = 0;
  if (wake_write_.valid() && ::write(wake_write_.get(), &byte, 1) < 0) {
    // The pipe is non-blocking and the loop also polls stopping_ after
    // every wake-up; a full pipe already means a pending wake-up.
  }
  if (accept_thread_.joinable()) accept_thread_.join();  // None with TLS.
  listen_fd_.Reset();
  server_->Shutdown(GrpcDeadline(absl::Milliseconds(500)));
  server_->Wait();
  server_.reset();
}

namespace {

// "ipv4:10.0.0.7" or "ipv6:[fd00::7]"; an IPv4-mapped IPv6 address (a dual
// stack listener) as the IPv4 one it is.
std::string AddressName(const SockAddr& sa) {
  std::string host = sa.Host();
  if (sa.family() == AF_INET6 && absl::StartsWithIgnoreCase(host, "::ffff:") &&
      host.find('.') != std::string::npos) {
    return absl::StrCat("ipv4:", host.substr(7));
  }
  return sa.family() == AF_INET6 ? absl::StrCat("ipv6:[", host, "]")
                                 : absl::StrCat("ipv4:", host);
}

}  // namespace

void RpcServer::AcceptLoop() {
  struct Pending {
    int fd;
    absl::uint128 peer;
    absl::Time deadline;
    std::string address;  // "ipv4:a.b.c.d", for CallerAddress.
  };
  // A connection gRPC owns. gRPC closes it without telling us, and its fd
  // number may be reused at once, so it is alive while fstat(fd) still
  // shows the same socket inode.
  struct Live {
    int fd;
    ino_t ino;
    absl::uint128 peer;
  };
  const size_t max_total = static_cast<size_t>(options_.max_connections);
  const int max_peer = options_.max_connections_per_peer;
  std::vector<Pending> pending;
  std::vector<Live> live;
  absl::flat_hash_map<absl::uint128, int> per_peer;
  std::vector<pollfd> pfds;
  int spare = OpenSpareFd();
  absl::Duration backoff = kMinBackoff;
  absl::Time accept_after = absl::InfinitePast();
  absl::Time last_prune = absl::InfinitePast();
  absl::Time last_log = absl::InfinitePast();

  auto release = [&](absl::uint128 peer) {
    auto it = per_peer.find(peer);
    if (it != per_peer.end() && --it->second <= 0) per_peer.erase(it);
  };
  auto peer_count = [&](absl::uint128 peer) {
    auto it = per_peer.find(peer);
    return it == per_peer.end() ? 0 : it->second;
  };
  auto prune = [&](absl::Time now) {
    last_prune = now;
    size_t out = 0;
    for (const Live& c : live) {
      struct stat st {};
      if (::fstat(c.fd, &st) == 0 && st.st_ino == c.ino) {
        live[out++] = c;
      } else {
        release(c.peer);
      }
    }
    live.resize(out);
  };
  auto log = [&](absl::Time now, const std::string& what) {
    if (now - last_log < kLogInterval) return;
    last_log = now;
    std::fprintf(stderr, "ferry rpc server %s: %s\n", address_.c_str(),
                 what.c_str());
  };
  auto hand_to_grpc = [&](const Pending& p) {
    int one = 1;
    ::setsockopt(p.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct stat st {};
    if (::fstat(p.fd, &st) != 0) {
      ::close(p.fd);
      release(p.peer);
      return;
    }
    SetConnectionPeer(p.fd, p.address);
    grpc::AddInsecureChannelFromFd(server_.get(), p.fd);
    live.push_back({p.fd, st.st_ino, p.peer});
    accepted_.fetch_add(1);
  };

  while (!stopping_.load()) {
    absl::Time now = clock_->Now();
    if (spare < 0) spare = OpenSpareFd();
    const bool accepting = now >= accept_after;
    pfds.clear();
    pfds.push_back({wake_read_.get(), POLLIN, 0});
    // poll ignores negative fds: the listener rests while backing off.
    pfds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});
    absl::Time wake_at = accepting ? absl::InfiniteFuture() : accept_after;
    for (const Pending& p : pending) {
      pfds.push_back({p.fd, POLLIN, 0});
      wake_at = std::min(wake_at, p.deadline);
    }
    int timeout_ms = wake_at == absl::InfiniteFuture()
                         ? -1
                         : static_cast<int>(std::max<int64_t>(
                               0, absl::ToInt64Milliseconds(absl::Ceil(
                                      wake_at - now, absl::Milliseconds(1)))));
    if (timeout_ms > kOtherClockPollMs && clock_ != RealClock()) {
      timeout_ms = kOtherClockPollMs;
    }
    const int n = ::poll(pfds.data(), pfds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      // Out of memory for the poll table: wait instead of spinning.
      log(clock_->Now(), absl::StrCat("poll: ", std::strerror(errno)));
      accept_after = clock_->Now() + kMaxBackoff;
      continue;
    }
    if (stopping_.load()) break;
    now = clock_->Now();

    // Connections that spoke go to gRPC; silent ones past their deadline
    // and ones already closed by their client are dropped.
    size_t out = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      const Pending p = pending[i];
      const short re = n > 0 ? pfds[2 + i].revents : 0;
      // What the client did: sent its first bytes, went away, or nothing.
      bool spoke = false;
      bool gone = (re & (POLLHUP | POLLERR | POLLNVAL)) != 0;
      if (re & POLLIN) {
        char first;
        const ssize_t r = ::recv(p.fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
        spoke = r > 0;
        gone = r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK &&
                          errno != EINTR);
      }
      if (spoke) {
        hand_to_grpc(p);
      } else if (gone) {
        ::close(p.fd);
        release(p.peer);
      } else if (now >= p.deadline) {
        // Counted before the close, so a client that sees the close also
        // sees the count.
        handshake_timeouts_.fetch_add(1);
        ::close(p.fd);
        release(p.peer);
      } else {
        pending[out++] = p;
      }
    }
    pending.resize(out);

    if (!accepting || n <= 0 || (pfds[1].revents & POLLIN) == 0) continue;
    for (int k = 0; k < kAcceptsPerWakeup; ++k) {
      SockAddr sa;
      sa.len = sizeof(sa.storage);
      const int fd = ::accept4(listen_fd_.get(), sa.mutable_get(), &sa.len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EINTR || err == ECONNABORTED) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) {
          backoff = kMinBackoff;
          break;
        }
        const bool exhausted = err == EMFILE || err == ENFILE;
        if (exhausted) {
          // Shed the queued connections, through the one fd the spare
          // frees, so their clients see a close rather than silence.
          if (spare >= 0) {
            ::close(spare);
            spare = -1;
            for (int s = 0; s < kAcceptsPerWakeup; ++s) {
              const int shed =
                  ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
              if (shed < 0) break;
              refused_.fetch_add(1);
              ::close(shed);
            }
            spare = OpenSpareFd();
          }
        }
        log(now,
            absl::StrCat("accept: ", std::strerror(err), "; not accepting for ",
                         absl::FormatDuration(backoff)));
        accept_after = now + backoff;
        backoff = std::min(backoff * 2, kMaxBackoff);
        // Counted once the back-off is set: whoever sees the count sees
        // the listener resting.
        if (exhausted) fd_exhausted_.fetch_add(1);
        break;
      }
      const absl::uint128 peer = sa.IpKey();
      auto full = [&] {
        return live.size() + pending.size() >= max_total ||
               peer_count(peer) >= max_peer;
      };
      if (full() && now - last_prune >= kPruneInterval) prune(now);
      if (full()) {
        refused_.fetch_add(1);
        ::close(fd);
        continue;
      }
      ++per_peer[peer];
      pending.push_back(
          {fd, peer, now + options_.handshake_timeout, AddressName(sa)});
    }
  }
  for (const Pending& p : pending) ::close(p.fd);
  if (spare >= 0) ::close(spare);
}

}  // namespace ferry::metadata
