// The responder's connections: the device's listener, which admits
// connections and reads their HELLOs without a thread each, and the thread
// that serves each identified connection's requests (executed by
// responder.cc).
#include <errno.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/softrnic/datapath.h"
#include "transport/softrnic/hello_auth.h"

namespace softrnic {
namespace {

void SendFrame(Connection* conn, const Frame& f) {
  uint8_t out[kHeaderBytes];
  EncodeFrame(f, out);
  iovec iov{out, sizeof(out)};
  ferry::MutexLock lock(&conn->mu);
  conn->WriteAll(&iov, 1);
}

// Serves the requests of one accepted connection whose HELLO named `qp`,
// on the connection's own thread, until either side closes it.
void ServeConnection(Device* dev, std::shared_ptr<Connection> conn,
                     std::shared_ptr<Qp> qp, Frame hello) {
  std::shared_ptr<Connection> old;
  {
    ferry::MutexLock lock(&qp->mu);
    // Checked again where it is attached: the QP may have been reset and
    // connected to another peer since the listener checked the HELLO.
    if (CheckHelloLocked(*qp, hello, conn->admitted_from()) !=
        HelloCheck::kTake) {
      conn->Close();
      return;
    }
    old = std::move(qp->accepted);
    qp->accepted = conn;
  }
  // The QP talks to one peer QP: an older connection for it is dead (the
  // requester reconnected) and must not hold its descriptor any longer.
  if (old != nullptr) old->Close();
  SendFrame(conn.get(), ReplyTo(FrameType::kHelloAck, hello));
  SocketSource src(conn.get());
  uint8_t hdr[kHeaderBytes];
  while (!conn->closed()) {
    Frame f;
    if (!conn->Read(hdr, sizeof(hdr)) || !DecodeFrame(hdr, kMaxMsgSize, &f) ||
        !IsRequestFor(f, hello.qpn)) {
      break;
    }
    if (!dev->LinkUp()) break;
    Response r = ProcessRequest(qp, f, &src);
    if (r.io_error) {
      if (r.mr != nullptr) ReleaseMr(r.mr);
      break;
    }
    if (!r.send) {
      DeliverRecvCompletion(qp, r);
      continue;
    }
    uint8_t out[kHeaderBytes];
    EncodeFrame(r.frame, out);
    iovec iov[2] = {{out, sizeof(out)},
                    {const_cast<uint8_t*>(r.data), r.frame.length}};
    bool ok;
    {
      ferry::MutexLock lock(&conn->mu);
      ok = conn->WriteAll(iov, r.data != nullptr ? 2 : 1, &r.mr,
                          r.mr != nullptr ? 1 : 0);
    }
    if (r.mr != nullptr) ReleaseMr(r.mr);
    DeliverRecvCompletion(qp, r);
    if (!ok) break;
  }
  conn->Close();
  // Drop the QP's reference, so the descriptor is closed now, not when
  // the QP is next connected or destroyed.
  ferry::MutexLock lock(&qp->mu);
  if (qp->accepted == conn) qp->accepted.reset();
}

// The device's listener: accepts connections and reads each one's HELLO
// without a thread of its own (one epoll loop per device), so connections
// that never identify a QP -- idle, slow or hostile -- cost a descriptor
// for at most the handshake timeout and no thread. Connections are capped
// per device and per source address (Limits); accept failures for lack of
// descriptors or memory pause accepting with exponential back-off.
//
// Every HELLO that is not taken gets the same answer, a "no such QP" NAK,
// whether the QP is missing, connected to another peer, in the wrong state
// or the proof is wrong, so a stranger learns nothing from it. A HELLO for
// a QP not yet ready to receive (RESET, INIT) is held, unanswered, until
// the QP reaches RTR or the handshake timeout passes: peers move their QPs
// to RTR in either order.
class Acceptor {
 public:
  Acceptor(Device* dev, int listen_fd, int epoll_fd)
      : dev_(dev),
        listen_fd_(listen_fd),
        epoll_fd_(epoll_fd),
        timeout_(std::chrono::milliseconds(GetLimits().handshake_timeout_ms)) {}

  void Run() {
    if (!Watch(listen_fd_)) return;
    epoll_event events[64];
    while (true) {
      const int n = ::epoll_wait(epoll_fd_, events, 64, WaitMs());
      if (n < 0 && errno != EINTR) {
        std::fprintf(stderr, "softrnic: %s: epoll_wait: %s\n",
                     dev_->name.c_str(), std::strerror(errno));
        return;
      }
      const Clock::time_point now = Clock::now();
      for (int i = 0; i < n; ++i) {
        const int fd = events[i].data.fd;
        if (fd == listen_fd_) {
          if (!AcceptSome(now)) return;
        } else {
          ReadHello(fd);
        }
      }
      if (paused_ && now >= resume_at_) {
        paused_ = false;
        Watch(listen_fd_);
      }
      RecheckHeld();
      Expire(now);
    }
  }

 private:
  // A connection accepted but not yet identified by its HELLO.
  struct Handshake {
    uint32_t addr;  // Source address, network order.
    uint64_t serial;
    size_t got = 0;
    size_t want = kHeaderBytes;  // The header, then its proof.
    bool held = false;           // Waits for its QP to reach RTR.
    Frame hello{};
    uint8_t buf[kHeaderBytes + kHelloProofBytes];
    uint8_t challenge[kHeaderBytes];     // Sent on accept (token only).
    const std::string* token = nullptr;  // In force when it was accepted.
  };
  struct Deadline {
    Clock::time_point at;
    int fd;
    uint64_t serial;  // Descriptors are reused; serials are not.
  };
  enum class Verdict { kServe, kHold, kRefuse };

  bool Watch(int fd) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) == 0) return true;
    std::fprintf(stderr, "softrnic: %s: epoll_ctl: %s\n", dev_->name.c_str(),
                 std::strerror(errno));
    return false;
  }

  // Milliseconds until the next handshake deadline, the end of a pause, or
  // the next look at held HELLOs.
  int WaitMs() const {
    Clock::time_point next = Clock::time_point::max();
    if (!deadlines_.empty()) next = deadlines_.front().at;
    if (paused_) next = std::min(next, resume_at_);
    if (held_ > 0) next = std::min(next, next_recheck_);
    if (next == Clock::time_point::max()) return -1;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        next - Clock::now())
                        .count();
    return static_cast<int>(std::clamp<int64_t>(ms + 1, 0, 60000));
  }

  // Accepts what the listener has queued; false if the listener broke.
  bool AcceptSome(Clock::time_point now) {
    for (int i = 0; i < 64; ++i) {
      sockaddr_in from{};
      socklen_t len = sizeof(from);
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from),
                               &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        switch (errno) {
          case EAGAIN:
          case EINTR:
          case ECONNABORTED:
          case EPROTO:
          case EPERM:
            return true;
          case EMFILE:
          case ENFILE:
          case ENOBUFS:
          case ENOMEM:
            Pause(now, errno);
            return true;
          default:
            std::fprintf(stderr, "softrnic: %s: accept: %s\n",
                         dev_->name.c_str(), std::strerror(errno));
            return false;
        }
      }
      backoff_ = std::chrono::milliseconds(0);
      const uint32_t addr = from.sin_addr.s_addr;
      if (!dev_->LinkUp() || addr == 0 || !AdmitConnection(dev_, addr)) {
        // A port that is down answers nothing; over a cap, the connection
        // is reset at once rather than left to linger.
        linger lg{1, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
        ::close(fd);
        continue;
      }
      Handshake h{addr, ++serial_};
      // Read per connection: an engine may give softrnic its token after
      // the device started (SetClusterToken); never taken back.
      h.token = ClusterToken();
      if (h.token != nullptr) {
        // The socket buffer of a new connection takes a header at once.
        EncodeFrame(MakeChallenge(), h.challenge);
        if (::send(fd, h.challenge, kHeaderBytes,
                   MSG_NOSIGNAL | MSG_DONTWAIT) !=
            static_cast<ssize_t>(kHeaderBytes)) {
          ::close(fd);
          ReleaseConnection(dev_, addr);
          continue;
        }
      }
      if (!Watch(fd)) {
        ::close(fd);
        ReleaseConnection(dev_, addr);
        continue;
      }
      pending_.emplace(fd, h);
      deadlines_.push_back({now + timeout_, fd, h.serial});
    }
    return true;
  }

  // Out of descriptors or memory: stop accepting for a while (the kernel
  // queues new connections meanwhile), doubling the pause while it lasts.
  void Pause(Clock::time_point now, int err) {
    backoff_ = std::clamp(backoff_ * 2, std::chrono::milliseconds(10),
                          std::chrono::milliseconds(1000));
    if (backoff_ == std::chrono::milliseconds(10)) {
      std::fprintf(stderr, "softrnic: %s: accept: %s; pausing accepts\n",
                   dev_->name.c_str(), std::strerror(err));
    }
    paused_ = true;
    resume_at_ = now + backoff_;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
  }

  void Drop(int fd) {
    auto it = pending_.find(fd);
    if (it == pending_.end()) return;
    if (it->second.held) {
      --held_;
    } else {
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    }
    ::close(fd);
    ReleaseConnection(dev_, it->second.addr);
    pending_.erase(it);
  }

  // Answers "no such QP" and closes: the one answer to every HELLO that
  // is not taken.
  void Refuse(int fd, const Frame& hello) {
    uint8_t out[kHeaderBytes];
    EncodeFrame(NakTo(hello, NakCode::kNoQp, 0), out);
    ssize_t sent = ::send(fd, out, sizeof(out), MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)sent;
    Drop(fd);
  }

  void Expire(Clock::time_point now) {
    while (!deadlines_.empty() && deadlines_.front().at <= now) {
      const Deadline d = deadlines_.front();
      deadlines_.pop_front();
      auto it = pending_.find(d.fd);
      if (it == pending_.end() || it->second.serial != d.serial) continue;
      if (it->second.held) {
        Refuse(d.fd, it->second.hello);  // Its QP never became ready.
      } else {
        Drop(d.fd);
      }
    }
  }

  void ReadHello(int fd) {
    auto it = pending_.find(fd);
    if (it == pending_.end() || it->second.held) return;
    Handshake& h = it->second;
    while (h.got < h.want) {
      const ssize_t r = ::recv(fd, h.buf + h.got, h.want - h.got, 0);
      if (r > 0) {
        h.got += static_cast<size_t>(r);
        if (h.got == kHeaderBytes && h.want == kHeaderBytes) {
          if (!DecodeFrame(h.buf, kMaxMsgSize, &h.hello) ||
              h.hello.type != FrameType::kHello) {
            Drop(fd);
            return;
          }
          h.want += h.hello.length;
        }
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && errno == EAGAIN) return;  // The rest comes later.
      Drop(fd);  // EOF or error before a whole HELLO.
      return;
    }
    // The proof first, before anything about QPs is looked at.
    const bool proven =
        h.token == nullptr ? h.hello.length == 0
                           : h.hello.length == kHelloProofBytes &&
                                 HelloProofMatches(*h.token, h.challenge, h.buf,
                                                   h.buf + kHeaderBytes);
    if (!proven) {
      Refuse(fd, h.hello);
      return;
    }
    Decide(fd, h);
  }

  void Decide(int fd, Handshake& h) {
    std::shared_ptr<Qp> qp;
    switch (Check(h, &qp)) {
      case Verdict::kRefuse:
        Refuse(fd, h.hello);
        return;
      case Verdict::kHold:
        if (!h.held) {
          // Out of epoll while held: early requests must not wake it.
          ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
          h.held = true;
          ++held_;
          // Its QP is likely to reach RTR at once: looked at again in a
          // millisecond, without resetting the back-off (a stranger
          // sending HELLOs for QPs that stay in INIT would keep every held
          // one rechecked each millisecond).
          next_recheck_ = std::min(next_recheck_,
                                   Clock::now() + std::chrono::milliseconds(1));
        }
        return;
      case Verdict::kServe:
        break;
    }
    Serve(fd, h, std::move(qp));
  }

  Verdict Check(const Handshake& h, std::shared_ptr<Qp>* qp) {
    switch (CheckHello(dev_, h.hello, h.addr, qp)) {
      case HelloCheck::kTake:
        // The other RoCE version: a NIC drops such packets, and the
        // sender's QP times out. Looked at only once the peer checked
        // out, so it tells a stranger nothing.
        if (((h.hello.flags & kFlagRoceV1) != 0) !=
            (*qp)->sgid_v1.load(std::memory_order_acquire)) {
          return Verdict::kRefuse;
        }
        return Verdict::kServe;
      case HelloCheck::kNotReady:
        return Verdict::kHold;
      case HelloCheck::kRefuse:
        break;
    }
    return Verdict::kRefuse;
  }

  // Looks at the held HELLOs again: every ms at first, then less often
  // (up to every 32 ms) while none of them moves, so that a stranger's
  // HELLOs for QPs that stay in INIT cost little.
  void RecheckHeld() {
    if (held_ == 0) return;
    const Clock::time_point now = Clock::now();
    if (now < next_recheck_) return;
    const size_t before = held_;
    std::vector<int> fds;
    for (const auto& [fd, h] : pending_) {
      if (h.held) fds.push_back(fd);
    }
    for (int fd : fds) {
      auto it = pending_.find(fd);
      if (it != pending_.end()) Decide(fd, it->second);
    }
    recheck_ms_ = held_ < before ? 1 : std::min(recheck_ms_ * 2, 32);
    next_recheck_ = now + std::chrono::milliseconds(recheck_ms_);
  }

  // Hands the connection to a thread of its own; the Connection now owns
  // the descriptor and the admission slot.
  void Serve(int fd, const Handshake& h, std::shared_ptr<Qp> qp) {
    const uint32_t addr = h.addr;
    const Frame hello = h.hello;
    if (h.held) {
      --held_;
    } else {
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    }
    pending_.erase(fd);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    TuneSocket(fd);
    auto conn = std::make_shared<Connection>(dev_, fd, addr);
    Track(dev_, conn);
    Device* dev = dev_;
    if (!StartThread("srnic-serve", [dev, conn, qp, hello] {
          ServeConnection(dev, conn, qp, hello);
        })) {
      conn->Close();  // The requester retries, as after a lost packet.
    }
  }

  Device* const dev_;
  const int listen_fd_;
  const int epoll_fd_;
  const Clock::duration timeout_;
  std::unordered_map<int, Handshake> pending_;
  size_t held_ = 0;     // Of pending_, those held.
  int recheck_ms_ = 1;  // How often held HELLOs are looked at now.
  Clock::time_point next_recheck_{};
  // Handshake deadlines in order: every connection gets the same timeout.
  std::deque<Deadline> deadlines_;
  uint64_t serial_ = 0;
  bool paused_ = false;
  Clock::time_point resume_at_{};
  std::chrono::milliseconds backoff_{0};
};

}  // namespace

HelloCheck CheckHello(Device* dev, const Frame& hello, uint32_t from,
                      std::shared_ptr<Qp>* out) {
  std::shared_ptr<Qp> qp = FindQp(hello.qpn);
  if (qp == nullptr || qp->dev != dev) return HelloCheck::kRefuse;
  ferry::MutexLock lock(&qp->mu);
  const HelloCheck verdict = CheckHelloLocked(*qp, hello, from);
  if (verdict == HelloCheck::kTake) *out = std::move(qp);
  return verdict;
}

HelloCheck CheckHelloLocked(const Qp& qp, const Frame& hello, uint32_t from) {
  if (qp.destroyed) return HelloCheck::kRefuse;
  const ibv_qp_state st = qp.attr.qp_state;
  if (st == IBV_QPS_RESET || st == IBV_QPS_INIT) return HelloCheck::kNotReady;
  if (st != IBV_QPS_RTR && st != IBV_QPS_RTS) return HelloCheck::kRefuse;
  // A connected QP takes a HELLO only from its peer QP at its peer's
  // address, as a NIC drops packets whose source QP or address is not the
  // one in its context (rxe's check_addr). So nobody can take over, or
  // join, a connected QP from another host, whatever QP numbers they know.
  if (qp.attr.dest_qp_num != hello.aux || qp.peer_ip.s_addr != from) {
    return HelloCheck::kRefuse;
  }
  return HelloCheck::kTake;
}

void AcceptLoop(Device* dev, int listen_fd, int epoll_fd) {
  Acceptor(dev, listen_fd, epoll_fd).Run();
}

}  // namespace softrnic
