// Helpers for the TCP transport's tests: raw client sockets that speak (or
// abuse) the wire protocol, and process gauges.
#ifndef FERRY_TRANSPORT_TCP_TCP_TEST_UTIL_H_
#define FERRY_TRANSPORT_TCP_TCP_TEST_UTIL_H_

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/socket_util.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp::testing {

// Connects to `to` ("a.b.c.d:port") from the loopback address `from`
// (blocking).
inline absl::StatusOr<UniqueFd> ConnectFrom(const std::string& from,
                                            const std::string& to) {
  auto dst = ParseIpv4Endpoint(to);
  if (!dst.ok()) return dst.status();
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, from.c_str(), &src.sin_addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0) {
    return absl::InternalError(absl::StrCat("bind: ", std::strerror(errno)));
  }
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&*dst), sizeof(*dst)) !=
      0) {
    return absl::UnavailableError(std::strerror(errno));
  }
  return fd;
}

// Sends one READ of 8 bytes at `remote` on a raw connection; true if it was
// answered with OK and the data.
inline bool Served(int fd, uint64_t remote) {
  uint8_t hdr[kRequestHeaderBytes];
  EncodeRequest({WireOp::kRead, 1, remote, 8}, hdr);
  if (!WriteFull(fd, hdr, sizeof(hdr)).ok()) return false;
  SetRecvTimeout(fd, absl::Seconds(5));
  uint8_t resp[kResponseHeaderBytes + 8];
  if (!ReadFull(fd, resp, sizeof(resp)).ok()) return false;
  ResponseHeader h;
  return DecodeResponse(resp, &h).ok() && h.status == WireStatus::kOk;
}

// Waits up to `timeout` for the peer to close `fd` (EOF or reset),
// discarding data. Returns how long that took, or DeadlineExceeded.
inline absl::StatusOr<absl::Duration> WaitForClose(int fd,
                                                   absl::Duration timeout) {
  const absl::Time start = absl::Now();
  const absl::Time end = start + timeout;
  char buf[65536];
  while (true) {
    const absl::Duration left = end - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1,
               static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) {
      continue;
    }
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
      return absl::Now() - start;
    }
  }
  return absl::DeadlineExceededError("the peer kept the connection open");
}

// Threads of this process.
inline int ThreadCount() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "Threads:")) {
      return std::atoi(line.c_str() + 8);
    }
  }
  return -1;
}

// Open descriptors of this process.
inline int FdCount() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;  // The directory's own.
}

}  // namespace ferry::tcp::testing

#endif  // FERRY_TRANSPORT_TCP_TCP_TEST_UTIL_H_
