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

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/send_all.h"

namespace ferry {
namespace {

// 4 MiB socket buffers let one stream keep a 100 Gbps-class pipe full; the
// kernel clamps them to net.core.[rw]mem_max anyway.
constexpr int kSocketBufferBytes = 4 << 20;

absl::Status ErrnoStatus(absl::string_view what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

absl::StatusOr<sockaddr_in> Resolve(const HostPort& addr) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(addr.port);
  if (inet_pton(AF_INET, addr.host.c_str(), &sa.sin_addr) == 1) return sa;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(addr.host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot resolve host '", addr.host, "': ", gai_strerror(rc)));
  }
  sa.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return sa;
}

}  // namespace

std::string HostPort::ToString() const { return absl::StrCat(host, ":", port); }

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text) {
  size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 ||
      colon + 1 == text.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected host:port, got '", text, "'"));
  }
  uint32_t port = 0;
  if (!absl::SimpleAtoi(text.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in '", text, "'"));
  }
  HostPort hp;
  hp.host = std::string(text.substr(0, colon));
  hp.port = static_cast<uint16_t>(port);
  return hp;
}

absl::StatusOr<sockaddr_in> ParseIpv4Endpoint(absl::string_view text) {
  constexpr size_t kMaxShown = 64;
  auto bad = [&](absl::string_view why) {
    const bool cut = text.size() > kMaxShown;
    return absl::InvalidArgumentError(
        absl::StrCat("endpoint '", text.substr(0, kMaxShown), cut ? "..." : "",
                     "' is not a numeric IPv4 address:port (", why, ")"));
  };
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 ||
      colon + 1 == text.size()) {
    return bad("expected address:port");
  }
  uint32_t port = 0;
  if (!absl::SimpleAtoi(text.substr(colon + 1), &port) || port == 0 ||
      port > 65535) {
    return bad("port must be 1..65535");
  }
  const absl::string_view host = text.substr(0, colon);
  if (host.size() > 15) return bad("not a dotted quad");
  char buf[16];
  std::memcpy(buf, host.data(), host.size());
  buf[host.size()] = 0;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, buf, &sa.sin_addr) != 1) {
    return bad("not a dotted quad; names are not resolved");
  }
  return sa;
}

std::string FormatSockaddr(const sockaddr_in& addr) {
  char buf[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf));
  return absl::StrCat(buf, ":", ntohs(addr.sin_port));
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
  HostPort hp{host, port};
  auto sa = Resolve(hp);
  if (!sa.ok()) return sa.status();
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoStatus("socket", errno);
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&*sa), sizeof(*sa)) != 0) {
    return ErrnoStatus(absl::StrCat("bind ", hp.ToString()), errno);
  }
  if (::listen(fd.get(), backlog) != 0) return ErrnoStatus("listen", errno);
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  if (bound_port != nullptr) *bound_port = ntohs(bound.sin_port);
  return fd;
}

absl::StatusOr<UniqueFd> ConnectTcp(const HostPort& addr,
                                    absl::Duration timeout) {
  auto sa = Resolve(addr);
  if (!sa.ok()) return sa.status();
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus("socket", errno);
  int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&*sa), sizeof(*sa));
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

absl::StatusOr<sockaddr_in> LocalAddress(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    return ErrnoStatus("getsockname", errno);
  }
  return sa;
}

absl::StatusOr<UniqueFd> StartConnect(const sockaddr_in& addr) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus("socket", errno);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr),
                sizeof(addr)) != 0 &&
      errno != EINPROGRESS) {
    return ErrnoStatus(absl::StrCat("connect ", FormatSockaddr(addr)), errno);
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
