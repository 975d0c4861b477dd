#include "common/socket_util.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/send_all.h"

namespace ferry {
namespace {

// 4 MiB socket buffers let one stream keep a 100 Gbps-class pipe full; the
// kernel clamps them to net.core.[rw]mem_max anyway.
constexpr int kSocketBufferBytes = 4 << 20;

absl::Status ErrnoStatus(absl::string_view what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

// Normalizes an IPv4-mapped IPv6 address (from a dual-stack socket) to
// IPv4, so peers and caps see one form of each address.
void Unmap(SockAddr* sa) {
  if (sa->family() != AF_INET6) return;
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&sa->storage);
  if (!IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) return;
  sockaddr_in in4{};
  in4.sin_family = AF_INET;
  in4.sin_port = in6->sin6_port;
  std::memcpy(&in4.sin_addr, &in6->sin6_addr.s6_addr[12], 4);
  sa->storage = {};
  std::memcpy(&sa->storage, &in4, sizeof(in4));
  sa->len = sizeof(in4);
}

// A literal address (no lookup), or nullopt.
std::optional<SockAddr> ParseLiteral(const std::string& host, uint16_t port) {
  SockAddr sa;
  auto* in4 = reinterpret_cast<sockaddr_in*>(&sa.storage);
  if (inet_pton(AF_INET, host.c_str(), &in4->sin_addr) == 1) {
    in4->sin_family = AF_INET;
    in4->sin_port = htons(port);
    sa.len = sizeof(sockaddr_in);
    return sa;
  }
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&sa.storage);
  if (inet_pton(AF_INET6, host.c_str(), &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    sa.len = sizeof(sockaddr_in6);
    return sa;
  }
  return std::nullopt;
}

absl::StatusOr<SockAddr> Resolve(const HostPort& addr) {
  if (auto sa = ParseLiteral(addr.host, addr.port)) return *sa;
  auto host = ResolveHost(addr.host);
  if (!host.ok()) return host.status();
  return *ParseLiteral(*host, addr.port);
}

absl::StatusOr<SockAddr> SocketName(int fd, bool peer) {
  SockAddr sa;
  sa.len = sizeof(sa.storage);
  const int rc = peer ? ::getpeername(fd, sa.mutable_get(), &sa.len)
                      : ::getsockname(fd, sa.mutable_get(), &sa.len);
  if (rc != 0) return ErrnoStatus(peer ? "getpeername" : "getsockname", errno);
  Unmap(&sa);
  return sa;
}

}  // namespace

std::string JoinHostPort(absl::string_view host, uint16_t port) {
  if (absl::StrContains(host, ':')) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

std::string HostPort::ToString() const { return JoinHostPort(host, port); }

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(why, ", got '", text.substr(0, 128), "'"));
  };
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 ||
      colon + 1 == text.size()) {
    return bad("expected host:port");
  }
  absl::string_view host = text.substr(0, colon);
  if (absl::ConsumePrefix(&host, "[")) {
    if (!absl::ConsumeSuffix(&host, "]") || host.empty() ||
        !absl::StrContains(host, ':')) {
      return bad("expected [ipv6]:port");
    }
  } else if (absl::StrContains(host, ':')) {
    return bad("an IPv6 address needs brackets: [ipv6]:port");
  } else if (absl::StrContains(host, ']') || absl::StrContains(host, '[')) {
    return bad("expected host:port");
  }
  uint32_t port = 0;
  if (!absl::SimpleAtoi(text.substr(colon + 1), &port) || port > 65535) {
    return bad("bad port");
  }
  HostPort hp;
  hp.host = std::string(host);
  hp.port = static_cast<uint16_t>(port);
  return hp;
}

uint16_t SockAddr::port() const {
  if (family() == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  }
  if (family() == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  }
  return 0;
}

std::string SockAddr::Host() const {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (family() == AF_INET) {
    inet_ntop(AF_INET,
              &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf,
              sizeof(buf));
  } else if (family() == AF_INET6) {
    inet_ntop(AF_INET6,
              &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf,
              sizeof(buf));
  }
  return buf;
}

std::string SockAddr::ToString() const { return JoinHostPort(Host(), port()); }

bool SockAddr::IsLoopback() const {
  if (family() == AF_INET) {
    const uint32_t ip =
        ntohl(reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr.s_addr);
    return (ip >> 24) == 127;
  }
  if (family() == AF_INET6) {
    const in6_addr& a =
        reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(&a) ||
           (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
  }
  return false;
}

bool SockAddr::IsWildcard() const {
  if (family() == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr.s_addr ==
           htonl(INADDR_ANY);
  }
  if (family() == AF_INET6) {
    const in6_addr& a =
        reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr;
    // ::ffff:0.0.0.0 reaches this host as 0.0.0.0 does.
    return IN6_IS_ADDR_UNSPECIFIED(&a) ||
           (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 0 &&
            a.s6_addr[13] == 0 && a.s6_addr[14] == 0 && a.s6_addr[15] == 0);
  }
  return false;
}

absl::uint128 SockAddr::IpKey() const {
  if (family() == AF_INET) {
    const uint32_t ip =
        ntohl(reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr.s_addr);
    return absl::MakeUint128(0, (uint64_t{0xffff} << 32) | ip);
  }
  if (family() == AF_INET6) {
    const uint8_t* b =
        reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr.s6_addr;
    uint64_t hi = 0, lo = 0;
    for (int i = 0; i < 8; ++i) hi = (hi << 8) | b[i];
    for (int i = 8; i < 16; ++i) lo = (lo << 8) | b[i];
    return absl::MakeUint128(hi, lo);
  }
  return 0;
}

absl::uint128 SockAddr::AddressGroupKey() const {
  const absl::uint128 key = IpKey();
  if (family() != AF_INET6) return key;
  const in6_addr& a =
      reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr;
  if (IN6_IS_ADDR_V4MAPPED(&a)) return key;
  return absl::MakeUint128(absl::Uint128High64(key), 0);
}

absl::StatusOr<SockAddr> ParseNumericEndpoint(absl::string_view text) {
  constexpr size_t kMaxShown = 64;
  auto bad = [&](absl::string_view why) {
    const bool cut = text.size() > kMaxShown;
    return absl::InvalidArgumentError(
        absl::StrCat("endpoint '", text.substr(0, kMaxShown), cut ? "..." : "",
                     "' is not a numeric address:port (", why, ")"));
  };
  if (text.size() > kMaxShown) return bad("too long");
  auto hp = ParseHostPort(text);
  if (!hp.ok()) return bad(hp.status().message());
  if (hp->port == 0) return bad("port must be 1..65535");
  auto sa = ParseLiteral(hp->host, hp->port);
  if (!sa) return bad("not an IP literal; names are not resolved");
  return *sa;
}

absl::StatusOr<std::string> ResolveHost(absl::string_view host) {
  const std::string h(host);
  if (auto sa = ParseLiteral(h, 0)) return h;
  if (h.empty()) return absl::InvalidArgumentError("empty host name");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(h.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve host '", h, "': ", gai_strerror(rc)));
  }
  // IPv4 first: most RoCE fabrics and every softrnic NIC use it.
  const addrinfo* pick = res;
  for (const addrinfo* p = res; p != nullptr; p = p->ai_next) {
    if (p->ai_family == AF_INET) {
      pick = p;
      break;
    }
  }
  SockAddr sa;
  std::memcpy(&sa.storage, pick->ai_addr,
              std::min<size_t>(pick->ai_addrlen, sizeof(sa.storage)));
  sa.len = static_cast<socklen_t>(pick->ai_addrlen);
  freeaddrinfo(res);
  Unmap(&sa);
  return sa.Host();
}

bool IsLoopbackHost(absl::string_view host) {
  auto sa = ParseLiteral(std::string(host), 0);
  return sa && sa->IsLoopback();
}

bool IsWildcardHost(absl::string_view host) {
  if (host.empty()) return true;
  auto sa = ParseLiteral(std::string(host), 0);
  return sa && sa->IsWildcard();
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) Reset(other.Release());
  return *this;
}

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::StatusOr<UniqueFd> ListenTcp(const std::string& host, uint16_t port,
                                   uint16_t* bound_port, int backlog) {
  HostPort hp{host.empty() ? "::" : host, port};
  auto sa = Resolve(hp);
  if (!sa.ok()) return sa.status();
  UniqueFd fd(::socket(sa->family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid() && errno == EAFNOSUPPORT && sa->family() == AF_INET6 &&
      sa->IsWildcard()) {
    // IPv6 is disabled on this host: every IPv4 interface instead.
    return ListenTcp("0.0.0.0", port, bound_port, backlog);
  }
  if (!fd.valid()) return ErrnoStatus("socket", errno);
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (sa->family() == AF_INET6 && sa->IsWildcard()) {
    int zero = 0;  // Dual stack: IPv4 peers too, whatever bindv6only says.
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  }
  if (::bind(fd.get(), sa->get(), sa->len) != 0) {
    return ErrnoStatus(absl::StrCat("bind ", hp.ToString()), errno);
  }
  if (::listen(fd.get(), backlog) != 0) return ErrnoStatus("listen", errno);
  auto bound = LocalAddress(fd.get());
  if (!bound.ok()) return bound.status();
  if (bound_port != nullptr) *bound_port = bound->port();
  return fd;
}

absl::StatusOr<UniqueFd> ConnectTcp(const HostPort& addr,
                                    absl::Duration timeout) {
  auto sa = Resolve(addr);
  if (!sa.ok()) return sa.status();
  UniqueFd fd(
      ::socket(sa->family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus("socket", errno);
  int rc = ::connect(fd.get(), sa->get(), sa->len);
  if (rc != 0 && errno != EINPROGRESS) {
    return ErrnoStatus(absl::StrCat("connect ", addr.ToString()), errno);
  }
  if (rc != 0) {
    pollfd pfd{fd.get(), POLLOUT, 0};
    int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
    int n;
    do {
      n = ::poll(&pfd, 1, ms);
    } while (n < 0 && errno == EINTR);
    if (n == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("connect ", addr.ToString(), ": no answer within ",
                       absl::FormatDuration(timeout)));
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (n < 0) err = errno;
    if (err != 0) {
      return ErrnoStatus(absl::StrCat("connect ", addr.ToString()), err);
    }
  }
  int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

absl::StatusOr<SockAddr> LocalAddress(int fd) { return SocketName(fd, false); }

absl::StatusOr<SockAddr> PeerAddress(int fd) { return SocketName(fd, true); }

absl::StatusOr<UniqueFd> StartConnect(const SockAddr& addr,
                                      const SockAddr* source) {
  UniqueFd fd(
      ::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus("socket", errno);
  // Loopback to loopback only: a loopback source cannot reach another
  // host (connect fails EINVAL), and a source the route to `addr` would not
  // choose (another interface of a multi-homed host) may get no reply.
  if (source != nullptr && source->family() == addr.family() &&
      source->IsLoopback() && addr.IsLoopback()) {
    // Any port: IP_BIND_ADDRESS_NO_PORT leaves its choice to connect(), so
    // bound connections do not use up the ephemeral ports of bind().
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one,
                 sizeof(one));
    SockAddr local = *source;
    if (local.family() == AF_INET) {
      reinterpret_cast<sockaddr_in*>(&local.storage)->sin_port = 0;
    } else {
      reinterpret_cast<sockaddr_in6*>(&local.storage)->sin6_port = 0;
    }
    (void)::bind(fd.get(), local.get(), local.len);  // Failed: unbound.
  }
  if (::connect(fd.get(), addr.get(), addr.len) != 0 && errno != EINPROGRESS) {
    return ErrnoStatus(absl::StrCat("connect ", addr.ToString()), errno);
  }
  return fd;
}

int SocketError(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

void SetResetOnClose(int fd) {
  linger lg{};
  lg.l_onoff = 1;
  lg.l_linger = 0;
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
}

void TuneDataSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = kSocketBufferBytes;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

absl::Status WriteFullv(int fd, struct iovec* iov, int iovcnt) {
  if (int err = SendAll(fd, iov, iovcnt); err != 0) {
    return ErrnoStatus("send", err);
  }
  return absl::OkStatus();
}

absl::Status WriteFull(int fd, const void* data, size_t len) {
  iovec iov{const_cast<void*>(data), len};
  return WriteFullv(fd, &iov, 1);
}

absl::Status ReadFull(int fd, void* data, size_t len) {
  static const std::atomic<bool> kNeverStop{false};
  return ReadFullPatient(fd, data, len, kNeverStop, /*max_stalls=*/1);
}

absl::Status ReadFullPatient(int fd, void* dst, size_t len,
                             const std::atomic<bool>& stop, int max_stalls,
                             bool idle_ok) {
  constexpr size_t kDrainChunk = 64 << 10;
  char scratch[kDrainChunk];
  size_t done = 0;
  int stalls = 0;
  while (done < len) {
    if (stop.load(std::memory_order_relaxed)) {
      return absl::CancelledError("connection is shutting down");
    }
    char* p = dst != nullptr ? static_cast<char*>(dst) + done : scratch;
    size_t want =
        dst != nullptr ? len - done : std::min(len - done, kDrainChunk);
    ssize_t n = ::recv(fd, p, want, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
      stalls = 0;
      continue;
    }
    if (n == 0) {
      if (done == 0) return absl::OutOfRangeError("connection closed");
      return absl::DataLossError(absl::StrCat("connection closed after ", done,
                                              " of ", len, " bytes"));
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (idle_ok && done == 0) continue;
      if (++stalls < max_stalls) continue;
      return absl::DeadlineExceededError(
          absl::StrCat("peer stalled after ", done, " of ", len, " bytes"));
    }
    return ErrnoStatus("recv", errno);
  }
  return absl::OkStatus();
}

void SetRecvTimeout(int fd, absl::Duration timeout) {
  timeval tv = absl::ToTimeval(timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

}  // namespace ferry
