#include "transport/softrnic/connection.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_map>

#include "common/send_all.h"

namespace softrnic {
namespace {

struct DeviceConns {
  std::vector<std::weak_ptr<Connection>> conns;
  size_t prune_at = 64;  // Expired entries are dropped when size reaches it.
  int admitted = 0;
  std::unordered_map<uint32_t, int> admitted_per_address;
};

struct Registry {
  ferry::Mutex mu;
  std::unordered_map<Device*, DeviceConns> devs ABSL_GUARDED_BY(mu);
};

Registry& Conns() {
  static auto* r = new Registry();
  return *r;
}

}  // namespace

Connection::~Connection() {
  ::close(fd_);
  if (admitted_from_ != 0) ReleaseConnection(dev_, admitted_from_);
}

void Connection::Close() {
  if (!closed_.exchange(true, std::memory_order_acq_rel)) {
    ::shutdown(fd_, SHUT_RDWR);
  }
}

bool Connection::Holds(const Mr* mr) const {
  for (const auto& p : pins_) {
    if (p.load(std::memory_order_acquire) == mr) return true;
  }
  return false;
}

void Connection::Delay(uint32_t us) {
  // As a frame on a slow link: a QP flushed meanwhile shuts the socket,
  // which wakes this at once (POLLHUP) -- its poster must not sit out a
  // delay for a frame that will never be sent.
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (!closed()) {
    const auto left = until - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds(0)) return;
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000),
                static_cast<long>(ns % 1000000000)};
    pollfd p{fd_, 0, 0};  // Only POLLHUP and POLLERR, which need no ask.
    if (::ppoll(&p, 1, &ts, nullptr) > 0) return;
  }
}

bool Connection::WriteAll(iovec* iov, int iovcnt, Mr* const* pins, int npins) {
  if (closed()) return false;
  if (uint32_t us = dev_->delay_us.load(std::memory_order_relaxed); us > 0) {
    Delay(us);
  }
  for (int i = 0; i < npins; ++i) {
    pins_[1 + i].store(pins[i], std::memory_order_release);
  }
  // A Close() meanwhile shuts the socket, so sendmsg fails at once.
  bool ok = !closed();
  if (ok) {
    DmaScope dma;
    // Counted per sendmsg, not once at the end: while a large frame is
    // being written, the part the socket took already counts (SIOCOUTQ
    // counts it too), and a write that fails half-way counts what went.
    ok = ferry::SendAll(fd_, iov, iovcnt, [this](size_t n) {
           bytes_written_.fetch_add(n, std::memory_order_release);
         }) == 0;
  }
  for (int i = 0; i < npins; ++i) {
    pins_[1 + i].store(nullptr, std::memory_order_relaxed);
  }
  if (!ok) Close();
  return ok;
}

uint64_t Connection::NextId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

int64_t Connection::BytesAcked() const {
  const uint64_t written = bytes_written();
  int unacked = 0;  // Written but not acknowledged by the peer's TCP.
  if (::ioctl(fd_, SIOCOUTQ, &unacked) != 0 || unacked < 0) return -1;
  const auto u = static_cast<uint64_t>(unacked);
  return static_cast<int64_t>(written > u ? written - u : 0);
}

bool Connection::Read(void* dst, size_t n, Mr* pin) {
  if (pin != nullptr) pins_[0].store(pin, std::memory_order_release);
  auto* p = static_cast<uint8_t*>(dst);
  bool ok = true;
  while (n > 0) {
    // After Close() a socket still returns bytes already queued, and a
    // peer may keep sending: check before every read, so that at most one
    // more read lands in memory.
    if (closed()) {
      ok = false;
      break;
    }
    ssize_t r;
    {
      DmaScope dma;
      r = ::recv(fd_, p, n, 0);
    }
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      bytes_read_.fetch_add(static_cast<uint64_t>(r),
                            std::memory_order_relaxed);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    ok = false;
    break;
  }
  if (pin != nullptr) pins_[0].store(nullptr, std::memory_order_relaxed);
  return ok;
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
  // An idle connection to a host that vanished without a FIN (power loss,
  // a partition) would hold its descriptor until the QP is used again:
  // keepalive finds it within about a minute and a half.
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 60, interval = 10, count = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

void Track(Device* dev, const std::shared_ptr<Connection>& conn) {
  Registry& r = Conns();
  ferry::MutexLock lock(&r.mu);
  DeviceConns& d = r.devs[dev];
  if (d.conns.size() >= d.prune_at) {
    d.conns.erase(std::remove_if(d.conns.begin(), d.conns.end(),
                                 [](const std::weak_ptr<Connection>& w) {
                                   return w.expired();
                                 }),
                  d.conns.end());
    d.prune_at = std::max<size_t>(64, 2 * d.conns.size());
  }
  d.conns.push_back(conn);
}

void CutDeviceConnections(Device* dev) {
  std::vector<std::shared_ptr<Connection>> live;
  {
    Registry& r = Conns();
    ferry::MutexLock lock(&r.mu);
    DeviceConns& d = r.devs[dev];
    for (auto& w : d.conns) {
      if (auto c = w.lock()) live.push_back(std::move(c));
    }
    d.conns.clear();
  }
  for (auto& c : live) c->Close();
}

void AbortConnectionsHolding(const Mr* mr) {
  std::vector<std::shared_ptr<Connection>> holding;
  {
    Registry& r = Conns();
    ferry::MutexLock lock(&r.mu);
    for (auto& [dev, d] : r.devs) {
      for (auto& w : d.conns) {
        auto c = w.lock();
        if (c != nullptr && c->Holds(mr)) holding.push_back(std::move(c));
      }
    }
  }
  for (auto& c : holding) c->Close();
}

bool AdmitConnection(Device* dev, uint32_t addr) {
  const Limits& limits = GetLimits();
  Registry& r = Conns();
  ferry::MutexLock lock(&r.mu);
  DeviceConns& d = r.devs[dev];
  int& from = d.admitted_per_address[addr];
  if (d.admitted >= limits.max_connections ||
      from >= limits.max_connections_per_address) {
    if (from == 0) d.admitted_per_address.erase(addr);
    return false;
  }
  ++d.admitted;
  ++from;
  return true;
}

void ReleaseConnection(Device* dev, uint32_t addr) {
  Registry& r = Conns();
  ferry::MutexLock lock(&r.mu);
  DeviceConns& d = r.devs[dev];
  --d.admitted;
  auto it = d.admitted_per_address.find(addr);
  if (it != d.admitted_per_address.end() && --it->second == 0) {
    d.admitted_per_address.erase(it);
  }
}

namespace {

// Reads the `n` bytes the listener sends first, within `timeout_ms`, from
// non-blocking `fd`.
bool ReadFirst(int fd, uint8_t* out, size_t n, int timeout_ms) {
  const Clock::time_point end =
      Clock::now() + std::chrono::milliseconds(timeout_ms);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, out + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0 || (errno != EAGAIN && errno != EINTR)) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          end - Clock::now())
                          .count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left) + 1) < 0) {
      if (errno != EINTR || left <= 0) return false;
    }
  }
  return true;
}

}  // namespace

std::shared_ptr<Connection> Dial(Device* dev, in_addr ip, uint16_t port,
                                 int timeout_ms, uint8_t* first,
                                 size_t first_bytes) {
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
  if (first != nullptr && !ReadFirst(fd, first, first_bytes, timeout_ms)) {
    ::close(fd);
    return nullptr;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  TuneSocket(fd);
  auto conn = std::make_shared<Connection>(dev, fd);
  Track(dev, conn);
  return conn;
}

bool SocketSource::Read(uint8_t* dst, size_t n, Mr* pin) {
  if (dst != nullptr) return conn_->Read(dst, n, pin);
  uint8_t scratch[16384];
  while (n > 0) {
    size_t k = std::min(n, sizeof(scratch));
    if (!conn_->Read(scratch, k)) return false;
    n -= k;
  }
  return true;
}

bool GatherSource::Read(uint8_t* dst, size_t n, Mr*) {
  while (n > 0) {
    if (seg_ >= segs_.size()) return false;
    size_t k = std::min(n, segs_[seg_].n - off_);
    if (dst != nullptr) {
      DmaScope dma;
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
