#include "transport/tcp/tcp_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dma_annotations.h"

namespace ferry::tcp {
namespace {

// Connections accepted per listener wake-up, so one flood cannot starve
// the connections served on the same loop.
constexpr int kAcceptBatch = 64;
// Listener back-off when accept() cannot get a descriptor or memory.
constexpr absl::Duration kMinAcceptBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxAcceptBackoff = absl::Seconds(1);
// Timeouts are checked this often while connections are open.
constexpr absl::Duration kBusyTick = absl::Milliseconds(50);
constexpr absl::Duration kIdleTick = absl::Seconds(1);
// recv/send rounds per connection wake-up (fairness between connections).
constexpr int kMaxRounds = 8;
constexpr int kMaxIov = 64;

UniqueFd OpenSpare() {
  return UniqueFd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
}

}  // namespace

// One accepted connection: moves bytes between its socket and its session.
class TcpServer::Conn : public EventLoop::Handler {
 public:
  Conn(TcpServer* server, Loop* loop, UniqueFd fd, Slot slot, absl::Time now)
      : server_(server),
        loop_(loop),
        fd_(std::move(fd)),
        slot_(std::move(slot)),
        session_(std::make_unique<ServerSession>(
            server->registry_, server->limits_, server->incarnation_, now,
            &server->gpu_staging_, server->auth_token_)) {}

  int fd() const { return fd_.get(); }

  void OnEvents(uint32_t events, absl::Time now) override {
    if (session_ == nullptr) return;  // Closed earlier in this batch.
    for (int round = 0; round < kMaxRounds; ++round) {
      // Read until the socket is drained (a short read) or input pauses.
      bool paused = false;
      for (int reads = 0; reads < kMaxRounds; ++reads) {
        if (!session_->wants_input()) {
          paused = true;
          break;
        }
        auto [buf, len] = session_->InputBuffer();
        // Payload goes straight into application memory, as a NIC's DMA
        // would (common/dma_annotations.h).
        ssize_t n;
        {
          ScopedDmaAccess dma;
          n = ::recv(fd_.get(), buf, len, 0);
        }
        if (n > 0) {
          const absl::Status s = session_->OnReceived(n, now);
          CountDenied();
          NoteUseful();
          if (!s.ok()) return Fail(s);
          if (static_cast<size_t>(n) < len) break;
          continue;
        }
        if (n == 0) return Close();  // The peer closed.
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return Close();
      }
      // Write until the socket is full or nothing is left.
      while (session_->has_output()) {
        iovec iov[kMaxIov];
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = session_->PrepareOutput(iov, kMaxIov);
        size_t offered = 0;
        for (size_t i = 0; i < msg.msg_iovlen; ++i) offered += iov[i].iov_len;
        ssize_t n;
        {
          ScopedDmaAccess dma;  // Payload from application memory.
          n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL);
        }
        if (n > 0) {
          const absl::Status s = session_->OnSent(n, now);
          CountDenied();  // OnSent may resume staged requests.
          NoteUseful();
          if (!s.ok()) return Fail(s);
          if (static_cast<size_t>(n) < offered) break;  // The socket is full.
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        return Close();
      }
      // A request waiting for a staging buffer tries again at once: the
      // answers just sent may have given theirs back (else the tick does).
      if (session_->stalled()) {
        if (!session_->Resume(now).ok()) {
          server_->bad_frames_.fetch_add(1, std::memory_order_relaxed);
          return Close();
        }
        paused = paused || !session_->stalled();
      }
      // Another round only if taking responses out resumed paused input.
      if (!paused || !session_->wants_input()) break;
    }
    UpdateInterest();
  }

  // Closes the connection if the peer overran a timeout; retries a
  // request that waits for a staging buffer.
  void CheckTimeouts(absl::Time now) {
    if (!session_->CheckTimeouts(now).ok()) {
      server_->timeouts_.fetch_add(1, std::memory_order_relaxed);
      return Close();
    }
    if (!session_->stalled()) return;
    if (!session_->Resume(now).ok()) {
      server_->bad_frames_.fetch_add(1, std::memory_order_relaxed);
      return Close();
    }
    OnEvents(EPOLLIN | EPOLLOUT, now);
  }

  // On the loop thread, the only one doing I/O on this socket: once it is
  // closed nothing touches the target memory any more, so the session's
  // leases go at once.
  void Close() {
    if (session_ != nullptr) CountDenied();
    // Leases and the slot go first: whoever sees the socket close sees
    // them released too.
    session_.reset();
    slot_.Release();
    loop_->loop->Remove(fd_.get());
    fd_.Reset();
    auto it = loop_->conns.find(this);
    if (it == loop_->conns.end()) return;
    std::unique_ptr<Conn> self = std::move(it->second);
    loop_->conns.erase(it);
    loop_->loop->DestroyLater(std::move(self));
  }

  // Closes the connection for what the session refused. A peer refused
  // for its token proof still gets the CHALLENGE, if it was not sent yet:
  // a peer with no token then learns why (ClientSession).
  void Fail(const absl::Status& s) {
    if (s.code() != absl::StatusCode::kPermissionDenied) {
      server_->bad_frames_.fetch_add(1, std::memory_order_relaxed);
      return Close();
    }
    server_->unproven_.fetch_add(1, std::memory_order_relaxed);
    iovec iov[kMaxIov];
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = session_->PrepareOutput(iov, kMaxIov);
    // At most one CHALLENGE (24 bytes): a new socket takes it at once.
    (void)::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    Close();
  }

  // The events to watch first: a session under a token speaks first (its
  // CHALLENGE).
  uint32_t StartInterest() {
    interest_ = EPOLLIN | (session_->has_output() ? EPOLLOUT : 0u);
    return interest_;
  }

 private:
  void NoteUseful() {
    if (!useful_ && session_->admitted() > 0) {
      useful_ = true;
      slot_.admitted()->useful.store(true, std::memory_order_relaxed);
    }
  }

  void CountDenied() {
    const uint64_t denied = session_->denied();
    if (denied == denied_counted_) return;
    server_->denied_.fetch_add(denied - denied_counted_,
                               std::memory_order_relaxed);
    denied_counted_ = denied;
  }

  void UpdateInterest() {
    const uint32_t want = (session_->wants_input() ? EPOLLIN : 0u) |
                          (session_->has_output() ? EPOLLOUT : 0u);
    if (want == interest_) return;
    if (loop_->loop->Modify(fd_.get(), want, this).ok()) interest_ = want;
  }

  TcpServer* const server_;
  Loop* const loop_;
  UniqueFd fd_;
  Slot slot_;
  std::unique_ptr<ServerSession> session_;
  uint64_t denied_counted_ = 0;  // Of session_->denied(), in server_->denied_.
  uint32_t interest_ = EPOLLIN;
  bool useful_ = false;  // Told to the slot's Admitted.
};

class TcpServer::Listener : public EventLoop::Handler {
 public:
  explicit Listener(TcpServer* server) : server_(server) {}
  void OnEvents(uint32_t, absl::Time now) override { server_->AcceptSome(now); }

 private:
  TcpServer* const server_;
};

TcpServer::Slot& TcpServer::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    Release();
    server_ = other.server_;
    admitted_ = std::move(other.admitted_);
    other.server_ = nullptr;
  }
  return *this;
}

void TcpServer::Slot::Release() {
  if (server_ != nullptr) server_->Leave(*admitted_);
  server_ = nullptr;
  admitted_.reset();
}

TcpServer::TcpServer(MemoryRegistry* registry, const TcpOptions& options)
    : registry_(registry),
      options_(options),
      gpu_staging_(options.staging_buffers, options.max_slice_bytes),
      limits_{options.handshake_timeout, options.idle_timeout,
              options.frame_timeout},
      accept_backoff_(kMinAcceptBackoff) {}

TcpServer::~TcpServer() { Stop(); }

absl::Status TcpServer::Start(const std::string& host, uint16_t port,
                              uint64_t incarnation, Clock* clock,
                              std::string auth_token) {
  incarnation_ = incarnation;  // Before any loop thread reads it.
  auth_token_ = std::move(auth_token);
  // The cap binds before the descriptors run out, so that connections are
  // shared fairly (Admit) rather than refused by a failing accept: at most
  // half the soft descriptor limit, leaving the rest to the engine.
  max_connections_ = static_cast<uint64_t>(options_.max_connections);
  if (rlimit nofile{}; getrlimit(RLIMIT_NOFILE, &nofile) == 0 &&
                       nofile.rlim_cur != RLIM_INFINITY) {
    max_connections_ = std::min<uint64_t>(
        max_connections_, std::max<uint64_t>(16, nofile.rlim_cur / 2));
  }
  clock_ = clock;
  auto fd = ListenTcp(host, port, &port_);
  if (!fd.ok()) return fd.status();
  listener_ = std::move(*fd);
  auto bound = LocalAddress(listener_.get());
  if (!bound.ok()) return bound.status();
  address_ = bound->ToString();
  int flags = ::fcntl(listener_.get(), F_GETFL);
  ::fcntl(listener_.get(), F_SETFL, flags | O_NONBLOCK);
  spare_ = OpenSpare();
  const int n = std::max(1, options_.io_threads);
  for (int i = 0; i < n; ++i) {
    auto loop = std::make_unique<Loop>();
    loop->loop =
        std::make_unique<EventLoop>(absl::StrCat("tcp-server-", i), clock_);
    Loop* raw = loop.get();
    EventLoop::TickFn tick;
    if (i == 0) {
      tick = [this, raw](absl::Time now) {
        return std::min(ListenerTick(now), ConnTick(raw, now));
      };
    } else {
      tick = [this, raw](absl::Time now) { return ConnTick(raw, now); };
    }
    loops_.push_back(std::move(loop));
    // The listener goes in before the thread runs: no race on the handler.
    if (i == 0) {
      listener_handler_ = std::make_unique<Listener>(this);
      if (absl::Status s = raw->loop->Start(std::move(tick)); !s.ok()) {
        Stop();
        return s;
      }
      raw->loop->Post([this, raw] {
        if (!raw->loop->Add(listener_.get(), EPOLLIN, listener_handler_.get())
                 .ok()) {
          PauseAccept(clock_->Now());
        }
      });
    } else if (absl::Status s = raw->loop->Start(std::move(tick)); !s.ok()) {
      Stop();
      return s;
    }
  }
  return absl::OkStatus();
}

void TcpServer::Stop() {
  for (auto& l : loops_) l->loop->Stop();
  // The loops are joined: this thread is the only one left.
  for (auto& l : loops_) l->conns.clear();
  loops_.clear();
  listener_handler_.reset();
  listener_.Reset();
  spare_.Reset();
}

std::shared_ptr<TcpServer::Admitted> TcpServer::Admit(absl::uint128 ip,
                                                      Loop* loop) {
  MutexLock lock(&mu_);
  auto it = per_address_.find(ip);
  const size_t mine = it == per_address_.end() ? 0 : it->second.size();
  if (mine >= static_cast<size_t>(options_.max_connections_per_address)) {
    return nullptr;
  }
  // Connections being shed still hold their slots for a moment: counted
  // out, up to a bound, so that sheds in flight cannot run away.
  const absl::Time now = clock_->Now();
  if (open_ - shedding_ >= max_connections_ && !ShedForLocked(ip, now)) {
    return nullptr;
  }
  auto a = std::make_shared<Admitted>();
  a->ip = ip;
  a->since = now;
  a->loop = loop;
  per_address_[ip].push_back(a);
  ++open_;
  return a;
}

bool TcpServer::ShedForLocked(absl::uint128 ip, absl::Time now) {
  constexpr int kMaxShedding = 16;
  if (shedding_ >= kMaxShedding) return false;
  // First a useless connection, from the address that holds the most:
  // wherever it is, it is worth less than a newcomer.
  std::shared_ptr<Admitted> victim;
  size_t most_useless = 0;
  for (const auto& [addr, list] : per_address_) {
    size_t useless = 0;
    std::shared_ptr<Admitted> first;
    for (const auto& a : list) {
      if (a->shedding || a->useful.load(std::memory_order_relaxed) ||
          now - a->since < kShedGrace) {
        continue;
      }
      if (first == nullptr) first = a;
      ++useless;
    }
    if (useless > most_useless) {
      most_useless = useless;
      victim = first;
    }
  }
  if (victim == nullptr) {
    // Else max-min: the address that holds the most, if that is at least
    // two more than the newcomer's would be.
    auto mine = per_address_.find(ip);
    const size_t have = mine == per_address_.end() ? 0 : mine->second.size();
    const std::vector<std::shared_ptr<Admitted>>* most = nullptr;
    size_t most_held = 0;
    for (const auto& [addr, list] : per_address_) {
      size_t held = 0;
      for (const auto& a : list) held += a->shedding ? 0 : 1;
      if (addr != ip && held > most_held) {
        most = &list;
        most_held = held;
      }
    }
    if (most == nullptr || most_held < have + 2) return false;
    for (const auto& a : *most) {
      if (a->shedding) continue;
      if (victim == nullptr) victim = a;  // The oldest, if all were useful.
      if (!a->useful.load(std::memory_order_relaxed)) {
        victim = a;
        break;
      }
    }
  }
  victim->shedding = true;
  ++shedding_;
  shed_.fetch_add(1, std::memory_order_relaxed);
  Loop* loop = victim->loop;
  // Posted while mu_ is held: the loop runs it later, on its own thread,
  // and it takes mu_ itself.
  loop->loop->Post([this, victim] { CloseShed(victim); });
  return true;
}

void TcpServer::CloseShed(const std::shared_ptr<Admitted>& admitted) {
  Conn* conn;
  {
    MutexLock lock(&mu_);
    conn = admitted->conn;
  }
  // Not adopted yet: Adopt sees `shedding` and closes it. Closed already:
  // not in conns any more (and its Admitted, held here, cannot be reused).
  if (conn == nullptr || !admitted->loop->conns.contains(conn)) return;
  conn->Close();
}

void TcpServer::Leave(Admitted& admitted) {
  MutexLock lock(&mu_);
  --open_;
  if (admitted.shedding) --shedding_;
  admitted.conn = nullptr;  // Closed: a CloseShed still queued finds none.
  auto it = per_address_.find(admitted.ip);
  if (it == per_address_.end()) return;
  auto& list = it->second;
  for (auto a = list.begin(); a != list.end(); ++a) {
    if (a->get() == &admitted) {
      list.erase(a);
      break;
    }
  }
  if (list.empty()) per_address_.erase(it);
}

bool TcpServer::ShedOne() {
  if (!spare_.valid()) return false;
  spare_.Reset();
  const int fd = ::accept4(listener_.get(), nullptr, nullptr,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd >= 0) {
    SetResetOnClose(fd);
    ::close(fd);
    refused_.fetch_add(1, std::memory_order_relaxed);
  }
  spare_ = OpenSpare();
  return fd >= 0 && spare_.valid();
}

void TcpServer::PauseAccept(absl::Time now) {
  EventLoop* loop = loops_[0]->loop.get();
  if (!accept_paused_) {
    loop->Modify(listener_.get(), 0, listener_handler_.get()).IgnoreError();
    accept_paused_ = true;
    accept_pauses_.fetch_add(1, std::memory_order_relaxed);
  }
  accept_resume_ = now + accept_backoff_;
  accept_backoff_ = std::min(accept_backoff_ * 2, kMaxAcceptBackoff);
  loop->TickBy(accept_resume_);
}

absl::Duration TcpServer::ListenerTick(absl::Time now) {
  if (!spare_.valid()) spare_ = OpenSpare();
  if (!accept_paused_) return kIdleTick;
  if (now < accept_resume_) return accept_resume_ - now;
  EventLoop* loop = loops_[0]->loop.get();
  if (!loop->Modify(listener_.get(), EPOLLIN, listener_handler_.get()).ok() &&
      !loop->Add(listener_.get(), EPOLLIN, listener_handler_.get()).ok()) {
    PauseAccept(now);
    return accept_resume_ - now;
  }
  accept_paused_ = false;
  AcceptSome(now);
  return kIdleTick;
}

void TcpServer::AcceptSome(absl::Time now) {
  for (int i = 0; i < kAcceptBatch; ++i) {
    SockAddr peer;
    peer.len = sizeof(peer.storage);
    const int fd = ::accept4(listener_.get(), peer.mutable_get(), &peer.len,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        accept_backoff_ = kMinAcceptBackoff;
        return;
      }
      if (err == EINTR || err == ECONNABORTED || err == EPROTO ||
          err == EPERM) {
        continue;  // That connection is gone; the next one may be fine.
      }
      if (err == EMFILE || err == ENFILE) {
        fd_exhausted_.fetch_add(1, std::memory_order_relaxed);
        if (ShedOne()) continue;
      }
      PauseAccept(now);  // No fd or memory even to shed: back off.
      return;
    }
    UniqueFd conn(fd);
    // Shared per host: an IPv6 host holds a /64 (AddressGroupKey).
    const absl::uint128 ip = peer.AddressGroupKey();
    Loop* target = loops_[next_loop_ % loops_.size()].get();
    std::shared_ptr<Admitted> admitted = Admit(ip, target);
    if (admitted == nullptr) {
      SetResetOnClose(conn.get());
      refused_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    ++next_loop_;
    accepted_.fetch_add(1, std::memory_order_relaxed);
    Slot slot(this, std::move(admitted));
    if (target == loops_[0].get()) {
      Adopt(target, std::move(conn), std::move(slot), now);
    } else {
      // Dropped with the task (closing the fd, freeing the slot) if that
      // loop stops first.
      target->loop->Post([this, target, conn = std::move(conn),
                          slot = std::move(slot)]() mutable {
        Adopt(target, std::move(conn), std::move(slot), clock_->Now());
      });
    }
  }
}

void TcpServer::Adopt(Loop* loop, UniqueFd fd, Slot slot, absl::Time now) {
  Admitted* admitted = slot.admitted();
  {
    MutexLock lock(&mu_);
    if (admitted->shedding) return;  // Shed before it started: the slot goes.
  }
  TuneDataSocket(fd.get());
  const int raw_fd = fd.get();
  auto conn =
      std::make_unique<Conn>(this, loop, std::move(fd), std::move(slot), now);
  if (!loop->loop->Add(raw_fd, conn->StartInterest(), conn.get()).ok()) {
    return;
  }
  {
    MutexLock lock(&mu_);
    admitted->conn = conn.get();
  }
  loop->conns.emplace(conn.get(), std::move(conn));
  loop->loop->TickBy(now + kBusyTick);
}

absl::Duration TcpServer::ConnTick(Loop* loop, absl::Time now) {
  if (loop->conns.empty()) return kIdleTick;
  std::vector<Conn*> conns;
  conns.reserve(loop->conns.size());
  for (auto& [raw, conn] : loop->conns) conns.push_back(raw);
  for (Conn* c : conns) c->CheckTimeouts(now);  // May close (erase) c.
  return kBusyTick;
}

TcpServer::Counters TcpServer::counters() const {
  Counters c;
  c.accepted = accepted_.load(std::memory_order_relaxed);
  c.refused = refused_.load(std::memory_order_relaxed);
  c.timeouts = timeouts_.load(std::memory_order_relaxed);
  c.bad_frames = bad_frames_.load(std::memory_order_relaxed);
  c.unproven = unproven_.load(std::memory_order_relaxed);
  c.shed = shed_.load(std::memory_order_relaxed);
  c.denied = denied_.load(std::memory_order_relaxed);
  c.fd_exhausted = fd_exhausted_.load(std::memory_order_relaxed);
  c.accept_pauses = accept_pauses_.load(std::memory_order_relaxed);
  MutexLock lock(&mu_);
  c.open = open_;
  return c;
}

int TcpServer::threads() const {
  int n = 0;
  for (const auto& l : loops_) n += l->loop->running() ? 1 : 0;
  return n;
}

}  // namespace ferry::tcp
