// Helpers for the TCP transport's tests: raw client sockets that speak (or
// abuse) the wire protocol, a peer that never answers a connect, and a
// sink that records completions.
#ifndef FERRY_TRANSPORT_TCP_TCP_TEST_UTIL_H_
#define FERRY_TRANSPORT_TCP_TCP_TEST_UTIL_H_

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "transport/tcp/server_session.h"
#include "transport/tcp/wire.h"
#include "transport/transport.h"

namespace ferry::tcp::testing {

// The key tests register their servers' buffers under (as registry handle
// 0), and the incarnation those servers run as: what raw test clients put
// in their frames.
inline const BufferKey kTestKey{0x6b65790000000001ull};
constexpr uint64_t kTestIncarnation = 0x1ca4;

// Records each completion's status and time, and how often each slice
// completed (exactly once is the contract); Wait blocks for a count.
class RecordingSink final : public SliceSink {
 public:
  void OnSliceDone(Slice* slice, const absl::Status& status) override {
    MutexLock lock(&mu_);
    statuses_.push_back(status);
    times_.push_back(absl::Now());
    ++done_[slice];
    cv_.SignalAll();
  }
  // Waits up to `timeout` for `n` completions in all; returns the statuses
  // seen, in completion order.
  std::vector<absl::Status> Wait(size_t n,
                                 absl::Duration timeout = absl::Seconds(20)) {
    MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + timeout;
    while (statuses_.size() < n && !cv_.WaitWithDeadline(&mu_, deadline)) {
    }
    return statuses_;
  }
  std::vector<absl::Time> times() {
    MutexLock lock(&mu_);
    return times_;
  }
  // Completions of `slice` so far.
  int count(Slice* slice) {
    MutexLock lock(&mu_);
    auto it = done_.find(slice);
    return it == done_.end() ? 0 : it->second;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> times_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Slice*, int> done_ ABSL_GUARDED_BY(mu_);
};

// A listener on 127.0.0.1 whose accept queue is full, so that the kernel
// drops further SYNs as a black-holed link would: connects to `port` are
// never answered while it lives.
struct BlackHole {
  UniqueFd listener;
  std::vector<UniqueFd> fillers;
  uint16_t port = 0;
};

inline absl::StatusOr<BlackHole> StartBlackHole() {
  BlackHole h;
  auto listener = ListenTcp("127.0.0.1", 0, &h.port, /*backlog=*/0);
  if (!listener.ok()) return listener.status();
  h.listener = std::move(*listener);
  auto sa = ParseNumericEndpoint(absl::StrCat("127.0.0.1:", h.port));
  if (!sa.ok()) return sa.status();
  for (int i = 0; i < 2; ++i) {  // Backlog 0 holds one connection.
    auto fd = StartConnect(*sa);
    if (!fd.ok()) return fd.status();
    h.fillers.push_back(std::move(*fd));
  }
  return h;
}

// Connects to `to` ("a.b.c.d:port") from the loopback address `from`
// (blocking).
inline absl::StatusOr<UniqueFd> ConnectFrom(const std::string& from,
                                            const std::string& to) {
  auto dst = ParseNumericEndpoint(to);
  if (!dst.ok()) return dst.status();
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, from.c_str(), &src.sin_addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0) {
    return absl::InternalError(absl::StrCat("bind: ", std::strerror(errno)));
  }
  if (::connect(fd.get(), dst->get(), dst->len) != 0) {
    return absl::UnavailableError(std::strerror(errno));
  }
  return fd;
}

// Sends one READ of 8 bytes at `remote` with `key` and `incarnation` on a
// raw connection; true if it was answered with OK and the data.
inline bool Served(int fd, uint64_t remote, uint64_t key = kTestKey.value,
                   uint64_t incarnation = kTestIncarnation) {
  uint8_t hdr[kRequestHeaderBytes];
  EncodeRequest({WireOp::kRead, 1, remote, 8, key, incarnation}, hdr);
  if (!WriteFull(fd, hdr, sizeof(hdr)).ok()) return false;
  SetRecvTimeout(fd, absl::Seconds(5));
  uint8_t resp[kResponseHeaderBytes];
  ResponseHeader h;
  if (!ReadFull(fd, resp, sizeof(resp)).ok() ||
      !DecodeResponse(resp, &h).ok() || h.status != WireStatus::kOk) {
    return false;  // A refusal carries no data.
  }
  uint8_t data[8];
  return ReadFull(fd, data, sizeof(data)).ok();
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

}  // namespace ferry::tcp::testing

#endif  // FERRY_TRANSPORT_TCP_TCP_TEST_UTIL_H_
