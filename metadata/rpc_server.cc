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
#include "common/status_macros.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/server_posix.h"
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
// A connection that carried no accepted call for this long since it was
// admitted is the first to go when the server is full: clients make their
// first call as soon as they connect.
constexpr absl::Duration kShedGrace = absl::Seconds(1);

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
  FERRY_RETURN_IF_ERROR(CheckTimeout("handshake_timeout", o.handshake_timeout));
  return CheckTimeout("idle_timeout", o.idle_timeout);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(
    const std::string& listen_address,
    const std::vector<grpc::Service*>& services,
    const RpcServerOptions& options) {
  auto hp = ParseHostPort(listen_address);
  if (!hp.ok()) return hp.status();
  FERRY_RETURN_IF_ERROR(ValidateOptions(options));
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
  builder.SetMaxReceiveMessageSize(kMaxRpcMessageBytes);
  builder.SetMaxSendMessageSize(kMaxRpcMessageBytes);
  grpc::ResourceQuota quota("ferry-rpc-server");
  quota.SetMaxThreads(o.max_threads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             o.max_streams_per_connection);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             ToMs(o.idle_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             kKeepaliveTimeoutMs);
  // The accept loop bounds the first bytes; this bounds the rest of a TLS
  // handshake.
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             ToMs(o.handshake_timeout));
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(
      ConnectionActivity::InterceptorFactory(&server->activity_));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  for (grpc::Service* s : services) {
    // What the service's constructor wrote is ordered before its calls by
    // gRPC's own (uninstrumented) synchronization: tell TSan
    // (common/happens_before.h); handlers mark HappensAfter(service).
    HappensBefore(s);
    builder.RegisterService(s);
  }
  // No listening port: connections come from AcceptLoop, through the
  // acceptor, with these credentials.
  server->acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
      o.tls != nullptr ? o.tls->ServerCredentials()
                       : grpc::InsecureServerCredentials());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::InternalError(absl::StrCat(
        "cannot start gRPC server for ", listen_address,
        o.tls != nullptr ? " (do the TLS certificate and key match? gRPC's "
                           "log says)"
                         : ""));
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

RpcServer::~RpcServer() { Shutdown(); }

RpcServerStats RpcServer::stats() const {
  RpcServerStats s;
  s.accepted = accepted_.load();
  s.refused = refused_.load();
  s.handshake_timeouts = handshake_timeouts_.load();
  s.fd_exhausted = fd_exhausted_.load();
  s.shed = shed_.load();
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
  if (accept_thread_.joinable()) accept_thread_.join();
  listen_fd_.Reset();
  {
    // gRPC allocates, on this thread, state that its own threads read
    // once it is down, ordered inside libgrpc: under TSan that was a
    // "race" between two of gRPC's accesses (docs/developer-notes.md,
    // "the cold CI at dec788e").
    IgnoreAccessesInScope unseen;
    server_->Shutdown(GrpcDeadline(absl::Milliseconds(500)));
    server_->Wait();
    server_.reset();
  }
}

void RpcServer::AcceptLoop() {
  // A connection the loop admitted: pending (polled here) until it speaks,
  // then gRPC's. gRPC closes its connections without telling us, and the
  // fd number may be reused at once, so a handed-over connection is alive
  // while fstat(fd) still shows the same socket inode.
  struct Conn {
    int fd;
    absl::uint128 peer;
    std::string name;  // ConnectionName: what gRPC calls its peer.
    absl::Time since;  // Admitted.
    absl::Time deadline;
    ino_t ino = 0;        // Once handed over.
    uint64_t ticket = 0;  // ConnectionActivity's, once handed over.
  };
  const size_t max_total = static_cast<size_t>(options_.max_connections);
  const int max_peer = options_.max_connections_per_peer;
  std::vector<Conn> pending;
  std::vector<Conn> live;
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
  auto forget = [&](const Conn& c) {
    activity_.Forget(c.name, c.ticket);
    release(c.peer);
  };
  auto prune = [&](absl::Time now) {
    last_prune = now;
    size_t out = 0;
    for (const Conn& c : live) {
      struct stat st {};
      if (::fstat(c.fd, &st) == 0 && st.st_ino == c.ino) {
        live[out++] = c;
      } else {
        forget(c);
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
  auto hand_to_grpc = [&](Conn c) {
    int one = 1;
    ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct stat st {};
    if (::fstat(c.fd, &st) != 0) {
      ::close(c.fd);
      release(c.peer);
      return;
    }
    c.ino = st.st_ino;
    c.ticket = activity_.Track(c.name);
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
    p.listener_fd = listen_fd_.get();
    p.fd = c.fd;
    acceptor_->HandleNewConnection(&p);
    live.push_back(std::move(c));
    accepted_.fetch_add(1);
  };
  // Not worth its slot: silent or refused for a second
  // (connection_activity.h); `useful` is the connection's Useful().
  auto useless = [&](const Conn& c, bool useful, absl::Time now) {
    return now - c.since >= kShedGrace && !useful;
  };
  // Closes `c` for a newcomer. A handed-over connection is shut down
  // through a duplicate checked to be the same socket (its number alone
  // may name another file by now); gRPC then sees it end and closes it.
  auto shed = [&](std::vector<Conn>* from, size_t i, bool handed) {
    const Conn c = (*from)[i];
    bool closed = true;
    if (handed) {
      const int dup = ::fcntl(c.fd, F_DUPFD_CLOEXEC, 0);
      // Out of fds: nothing safe to do. (EBADF: gRPC closed it already.)
      if (dup < 0 && errno != EBADF) {
        log(clock_->Now(), absl::StrCat("cannot shed a connection from ",
                                        c.name, ": ", std::strerror(errno)));
        return false;
      }
      struct stat st {};
      closed = dup >= 0 && ::fstat(dup, &st) == 0 && st.st_ino == c.ino;
      if (closed) ::shutdown(dup, SHUT_RDWR);
      if (dup >= 0) ::close(dup);
    } else {
      ::close(c.fd);
    }
    // Gone either way: one that gRPC had closed made room too.
    from->erase(from->begin() + static_cast<ptrdiff_t>(i));
    forget(c);
    if (closed) shed_.fetch_add(1);
    return true;
  };
  // Makes room for a newcomer from `peer`: a useless connection from the
  // address holding the most of them, else (max-min) one from the address
  // holding the most connections, if that is two more than `peer` would.
  auto make_room = [&](absl::uint128 peer, absl::Time now) {
    struct Candidate {
      int useless = 0;
      std::vector<Conn>* from = nullptr;
      size_t index = 0;
      bool handed = false;
    };
    // One lock of the activity table for every live connection, used by
    // both passes below (a pending connection has carried nothing).
    std::vector<const std::string*> names;
    names.reserve(live.size());
    for (const Conn& c : live) names.push_back(&c.name);
    const std::vector<bool> useful = activity_.UsefulAll(names);
    absl::flat_hash_map<absl::uint128, Candidate> by_peer;
    for (bool handed : {true, false}) {
      std::vector<Conn>& list = handed ? live : pending;
      for (size_t i = 0; i < list.size(); ++i) {
        if (!useless(list[i], handed && useful[i], now)) continue;
        Candidate& c = by_peer[list[i].peer];
        if (c.useless++ == 0) c = {1, &list, i, handed};
      }
    }
    const Candidate* best = nullptr;
    for (const auto& [addr, c] : by_peer) {
      if (best == nullptr || c.useless > best->useless) best = &c;
    }
    if (best != nullptr) return shed(best->from, best->index, best->handed);
    absl::uint128 most = 0;
    int most_held = 0;
    for (const auto& [addr, held] : per_peer) {
      if (addr != peer && held > most_held) {
        most = addr;
        most_held = held;
      }
    }
    if (most_held < peer_count(peer) + 2) return false;
    // Its oldest connection that carried no accepted call, else its oldest.
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i].peer == most && !useful[i]) {
        return shed(&live, i, true);
      }
    }
    for (size_t i = 0; i < pending.size(); ++i) {
      if (pending[i].peer == most) return shed(&pending, i, false);
    }
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i].peer == most) return shed(&live, i, true);
    }
    return false;
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
    for (const Conn& p : pending) {
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
    size_t out = 0;  // Kept in place: no allocation per wake-up.
    for (size_t i = 0; i < pending.size(); ++i) {
      Conn& p = pending[i];
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
        hand_to_grpc(std::move(p));
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
        if (out != i) pending[out] = std::move(p);
        ++out;
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
              const int shed_fd =
                  ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
              if (shed_fd < 0) break;
              refused_.fetch_add(1);
              ::close(shed_fd);
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
      // The time of this accept, not of the wake-up: a connection that came
      // in while this batch ran is judged (grace, deadline) by its own.
      now = clock_->Now();
      const absl::uint128 peer = sa.AddressGroupKey();
      auto full = [&] { return live.size() + pending.size() >= max_total; };
      if ((full() || peer_count(peer) >= max_peer) &&
          now - last_prune >= kPruneInterval) {
        prune(now);
      }
      if (peer_count(peer) >= max_peer || (full() && !make_room(peer, now))) {
        refused_.fetch_add(1);
        ::close(fd);
        log(now, absl::StrCat("refused a connection from ", sa.Host(),
                              ": at the cap of ", max_total, " connections (",
                              max_peer, " per address)"));
        continue;
      }
      ++per_peer[peer];
      pending.push_back({fd, peer, ConnectionName(sa), now,
                         now + options_.handshake_timeout});
    }
  }
  for (const Conn& p : pending) ::close(p.fd);
  if (spare >= 0) ::close(spare);
}

}  // namespace ferry::metadata
