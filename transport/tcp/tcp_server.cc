#include "transport/tcp/tcp_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

// How often blocked threads wake to check for Stop().
constexpr absl::Duration kWakeInterval = absl::Milliseconds(200);
// A peer that stops sending in the middle of a payload for this long is
// dropped, so a stalled initiator cannot pin a buffer's lease forever.
constexpr int kMaxStalledWakeups = 50;  // 10 s.

absl::Status SendResponse(int fd, WireOp op, WireStatus status, uint64_t id,
                          uint64_t len, const void* data) {
  uint8_t hdr[kResponseHeaderBytes];
  EncodeResponse({op, status, id, len}, hdr);
  iovec iov[2] = {{hdr, sizeof(hdr)}, {const_cast<void*>(data), len}};
  return WriteFullv(fd, iov, data != nullptr ? 2 : 1);
}

}  // namespace

absl::Status TcpServer::Start(const std::string& host, uint16_t port) {
  auto fd = ListenTcp(host, port, &port_);
  if (!fd.ok()) return fd.status();
  listener_ = std::move(*fd);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void TcpServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
  if (accept_thread_.joinable()) accept_thread_.join();
  std::list<std::unique_ptr<Conn>> conns;
  {
    MutexLock lock(&mu_);
    conns.swap(conns_);
  }
  for (auto& c : conns) ::shutdown(c->fd.get(), SHUT_RDWR);
  for (auto& c : conns) {
    if (c->thread.joinable()) c->thread.join();
  }
  listener_.Reset();
}

void TcpServer::ReapFinishedLocked() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void TcpServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd pfd{listener_.get(), POLLIN, 0};
    int n = ::poll(&pfd, 1, absl::ToInt64Milliseconds(kWakeInterval));
    if (n <= 0) continue;
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    TuneDataSocket(fd);
    SetRecvTimeout(fd, kWakeInterval);
    // An initiator that stops reading READ data is dropped after this long
    // rather than pinning this thread and the buffer's lease.
    timeval send_timeout = absl::ToTimeval(kWakeInterval * kMaxStalledWakeups);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout,
                 sizeof(send_timeout));
    accepted_.fetch_add(1);
    MutexLock lock(&mu_);
    ReapFinishedLocked();
    if (stopping_.load()) {
      ::close(fd);
      break;
    }
    auto conn = std::make_unique<Conn>();
    conn->fd.Reset(fd);
    Conn* raw = conn.get();
    conns_.push_back(std::move(conn));
    raw->thread = std::thread([this, raw] { Serve(raw); });
  }
}

void TcpServer::Serve(Conn* conn) {
  const int fd = conn->fd.get();
  while (!stopping_.load()) {
    uint8_t hdr[kRequestHeaderBytes];
    absl::Status s = ReadFullPatient(fd, hdr, sizeof(hdr), stopping_,
                                     kMaxStalledWakeups, /*idle_ok=*/true);
    if (!s.ok()) break;
    RequestHeader req;
    if (!DecodeRequest(hdr, &req).ok()) break;  // Garbage: drop connection.
    if (req.op == WireOp::kWrite) {
      s = HandleWrite(fd, req.request_id, req.remote_addr, req.length);
    } else {
      s = HandleRead(fd, req.request_id, req.remote_addr, req.length);
    }
    if (!s.ok()) break;
  }
  ::shutdown(fd, SHUT_RDWR);
  conn->done.store(true);
}

absl::Status TcpServer::HandleWrite(int fd, uint64_t id, uint64_t addr,
                                    uint64_t len) {
  auto lease = registry_->Acquire(addr, len, /*need_remote=*/true);
  if (!lease.ok()) {
    // Consume the payload so the stream stays in sync, write nothing.
    if (absl::Status s =
            ReadFullPatient(fd, nullptr, len, stopping_, kMaxStalledWakeups);
        !s.ok()) {
      return s;
    }
    return SendResponse(fd, WireOp::kWriteAck, WireStatus::kOutOfBounds, id, 0,
                        nullptr);
  }
  if (absl::Status s = ReadFullPatient(fd, reinterpret_cast<void*>(addr), len,
                                       stopping_, kMaxStalledWakeups);
      !s.ok()) {
    return s;
  }
  lease->Release();
  // Acknowledged only now: a WRITE completes after the target applied it.
  return SendResponse(fd, WireOp::kWriteAck, WireStatus::kOk, id, 0, nullptr);
}

absl::Status TcpServer::HandleRead(int fd, uint64_t id, uint64_t addr,
                                   uint64_t len) {
  auto lease = registry_->Acquire(addr, len, /*need_remote=*/true);
  if (!lease.ok()) {
    return SendResponse(fd, WireOp::kReadData, WireStatus::kOutOfBounds, id, 0,
                        nullptr);
  }
  return SendResponse(fd, WireOp::kReadData, WireStatus::kOk, id, len,
                      reinterpret_cast<const void*>(addr));
}

}  // namespace ferry::tcp
