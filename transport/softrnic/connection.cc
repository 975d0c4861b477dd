#include "transport/softrnic/connection.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "common/send_all.h"

namespace softrnic {
namespace {

struct Registry {
  ferry::Mutex mu;
  std::unordered_map<Device*, std::vector<std::weak_ptr<Connection>>> conns
      ABSL_GUARDED_BY(mu);
};

Registry& Conns() {
  static auto* r = new Registry();
  return *r;
}

}  // namespace

Connection::~Connection() { ::close(fd_); }

void Connection::Close() {
  if (!closed_.exchange(true)) ::shutdown(fd_, SHUT_RDWR);
}

bool Connection::WriteAll(iovec* iov, int iovcnt) {
  if (closed()) return false;
  if (uint32_t us = dev_->delay_us.load(std::memory_order_relaxed); us > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
  if (ferry::SendAll(fd_, iov, iovcnt) != 0) {
    Close();
    return false;
  }
  return true;
}

void TuneSocket(int fd) {
  // A write that makes no progress for this long means the path is dead (a
  // link down under TCP): fail it so the QP's ack timeout and retry logic
  // run, instead of blocking the poster (and the QP's send lock) for TCP's
  // minutes-long retransmission timeout.
  timeval send_timeout{0, 500000};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout,
               sizeof(send_timeout));
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

void Track(Device* dev, const std::shared_ptr<Connection>& conn) {
  Registry& r = Conns();
  ferry::MutexLock lock(&r.mu);
  auto& v = r.conns[dev];
  v.erase(std::remove_if(
              v.begin(), v.end(),
              [](const std::weak_ptr<Connection>& w) { return w.expired(); }),
          v.end());
  v.push_back(conn);
}

void CutDeviceConnections(Device* dev) {
  std::vector<std::shared_ptr<Connection>> live;
  {
    Registry& r = Conns();
    ferry::MutexLock lock(&r.mu);
    for (auto& w : r.conns[dev]) {
      if (auto c = w.lock()) live.push_back(std::move(c));
    }
    r.conns[dev].clear();
  }
  for (auto& c : live) c->Close();
}

std::shared_ptr<Connection> Dial(Device* dev, in_addr ip, uint16_t port,
                                 int timeout_ms) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return nullptr;
  // Originate from the device's own address, as a NIC would.
  sockaddr_in local{};
  local.sin_family = AF_INET;
  local.sin_addr = dev->ip;
  ::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr = ip;
  sa.sin_port = htons(port);
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  if (rc != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return nullptr;
  }
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (::poll(&p, 1, timeout_ms) != 1 ||
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      ::close(fd);
      return nullptr;
    }
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  TuneSocket(fd);
  auto conn = std::make_shared<Connection>(dev, fd);
  Track(dev, conn);
  return conn;
}

bool ReadFully(int fd, void* buf, size_t n) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    return false;
  }
  return true;
}

bool SocketSource::Read(uint8_t* dst, size_t n) {
  if (dst != nullptr) return ReadFully(fd_, dst, n);
  uint8_t scratch[16384];
  while (n > 0) {
    size_t k = std::min(n, sizeof(scratch));
    if (!ReadFully(fd_, scratch, k)) return false;
    n -= k;
  }
  return true;
}

bool GatherSource::Read(uint8_t* dst, size_t n) {
  while (n > 0) {
    if (seg_ >= segs_.size()) return false;
    size_t k = std::min(n, segs_[seg_].n - off_);
    if (dst != nullptr) {
      std::memcpy(dst, segs_[seg_].p + off_, k);
      dst += k;
    }
    n -= k;
    off_ += k;
    if (off_ == segs_[seg_].n) {
      ++seg_;
      off_ = 0;
    }
  }
  return true;
}

}  // namespace softrnic
