#include "transport/tcp/tcp_client.h"

#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dma_annotations.h"
#include "common/log.h"
#include "common/socket_util.h"

namespace ferry::tcp {
namespace {

// Deadlines are checked this often while slices are in flight.
constexpr absl::Duration kBusyTick = absl::Milliseconds(10);
constexpr absl::Duration kIdleTick = absl::Seconds(1);
// recv rounds per wake-up of a connection (fairness).
constexpr int kMaxRounds = 16;
constexpr int kMaxIov = 64;
// Tries of a slice that never reached the wire, over closing connections.
constexpr uint32_t kMaxAttempts = 4;

using Done = ClientSession::Done;

// What a slice to a backed-off peer fails with: who, why, and when the
// next attempt is.
absl::Status BackoffError(absl::string_view address, int failures,
                          const absl::Status& last, absl::Duration next_in) {
  return absl::UnavailableError(absl::StrCat(
      "TCP peer ", address, " is backed off after ", failures,
      " failed attempt", failures == 1 ? "" : "s", " (last: ", last.message(),
      "); next attempt in ",
      absl::FormatDuration(absl::Ceil(std::max(next_in, absl::ZeroDuration()),
                                      absl::Milliseconds(1)))));
}

}  // namespace

struct TcpClient::Pool : std::enable_shared_from_this<TcpClient::Pool> {
  Pool(std::string address_in, const SockAddr& addr_in, Loop* loop_in,
       absl::Time now)
      : address(std::move(address_in)),
        addr(addr_in),
        loop(loop_in),
        last_active(now) {}

  const std::string address;
  const SockAddr addr;
  Loop* const loop;

  // Submit hands slices over here; the loop drains them.
  Mutex mu;
  std::vector<Slice*> inbox ABSL_GUARDED_BY(mu);
  bool wake_posted ABSL_GUARDED_BY(mu) = false;
  // While now < fail_until, Submit fails slices at once (fast failures).
  absl::Time fail_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  absl::Status fail_cause ABSL_GUARDED_BY(mu);
  int fail_count ABSL_GUARDED_BY(mu) = 0;

  // Slices Submit accepted for this pool and not completed yet; changed
  // under TcpClient::mu_ upwards (so eviction can trust a zero), anywhere
  // downwards.
  std::atomic<int64_t> outstanding{0};
  std::atomic<uint64_t> last_use{0};

  // Loop thread only.
  std::vector<std::unique_ptr<Conn>> conns;
  bool registered = false;  // In loop->pools.
  bool closing = false;     // Retire once no slice is left.
  bool retired = false;
  int failures = 0;  // Consecutive; reset by the first answer.
  absl::Time retry_after = absl::InfinitePast();
  absl::Status last_failure;
  bool published = false;  // fail_until is set.
  absl::Time last_active;
};

// One connection: moves bytes between its socket and its session.
class TcpClient::Conn : public EventLoop::Handler {
 public:
  Conn(TcpClient* client, Pool* pool, UniqueFd fd, absl::Time now)
      : client_(client),
        pool_(pool),
        fd_(std::move(fd)),
        session_(pool->address, client->auth_token_),
        connect_deadline_(now + client->connect_timeout_),
        last_busy_(now) {}

  ClientSession& session() { return session_; }
  bool closed() const { return closed_; }
  bool connected() const { return connected_; }
  int fd() const { return fd_.get(); }

  // Queues `slice`; FlushAll sends it (one sendmsg for a batch).
  void Add(Slice* slice, absl::Time now) {
    session_.Add(slice);
    last_busy_ = now;
  }

  // Sends what it can and updates the poll interest.
  void FlushAndWatch(absl::Time now) {
    Flush(now);
    if (!closed_) UpdateInterest();
  }

  void OnEvents(uint32_t events, absl::Time now) override {
    if (closed_) return;
    // Completing a slice may retire a closing pool and drop the last
    // reference to it, while this handler still needs the pool.
    const std::shared_ptr<Pool> keep = pool_->shared_from_this();
    if (!session_.empty()) last_busy_ = now;
    if (!connected_) {
      int err = SocketError(fd_.get());
      if (err == 0 && (events & (EPOLLERR | EPOLLHUP))) err = ECONNRESET;
      if (err != 0) {
        return Close(absl::UnavailableError(absl::StrCat(
                         "connect ", pool_->address, ": ", std::strerror(err))),
                     /*failed=*/true, now);
      }
      if ((events & EPOLLOUT) == 0) return;
      connected_ = true;
      TuneDataSocket(fd_.get());
    }
    std::vector<Done> done;
    if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
      const bool answered_before = session_.answered_any();
      for (int round = 0; round < kMaxRounds; ++round) {
        auto [buf, len] = session_.InputBuffer();
        // Payload goes straight into application memory, as a NIC's DMA
        // would (common/dma_annotations.h).
        ssize_t n;
        {
          ScopedDmaAccess dma;
          n = ::recv(fd_.get(), buf, len, 0);
        }
        if (n > 0) {
          if (absl::Status s = session_.OnReceived(n, &done); !s.ok()) {
            client_->Complete(pool_, &done, now);
            return Close(s, !session_.answered_any(), now);
          }
          if (static_cast<size_t>(n) < len) break;  // Drained.
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        const std::string why =
            n == 0 ? "closed by the peer" : std::strerror(errno);
        client_->Complete(pool_, &done, now);
        if (session_.proof_sent() && !session_.answered_any()) {
          return Close(
              absl::PermissionDeniedError(absl::StrCat(
                  "target at ", pool_->address,
                  " closed the TCP connection after this engine's proof of "
                  "the cluster token and before any answer: its token likely "
                  "differs from this engine's (or it restarted meanwhile)")),
              /*failed=*/true, now);
        }
        // A quiet close of an idle connection (say, the target's idle
        // timeout) is no failure of the peer.
        const bool failed = !session_.answered_any() && !session_.empty();
        return Close(absl::UnavailableError(absl::StrCat(
                         "TCP connection to ", pool_->address, " lost: ", why)),
                     failed, now);
      }
      if (!answered_before && session_.answered_any()) {
        client_->OnConnAnswered(pool_);
      }
    }
    Flush(now);
    if (closed_) return client_->Complete(pool_, &done, now);
    UpdateInterest();
    if (!session_.empty()) last_busy_ = now;
    client_->Complete(pool_, &done, now);  // May retire the pool: last.
  }

  // Sends what the session has, until the socket is full.
  void Flush(absl::Time now) {
    while (connected_ && !closed_ && session_.has_output()) {
      iovec iov[kMaxIov];
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = session_.PrepareOutput(iov, kMaxIov);
      ssize_t n;
      {
        ScopedDmaAccess dma;  // Payload from application memory.
        n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL);
      }
      if (n > 0) {
        size_t offered = 0;
        for (size_t i = 0; i < msg.msg_iovlen; ++i) offered += iov[i].iov_len;
        session_.OnSent(n);
        if (static_cast<size_t>(n) < offered) return;  // The socket is full.
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      Close(absl::UnavailableError(
                absl::StrCat("TCP connection to ", pool_->address,
                             " lost: ", std::strerror(errno))),
            !session_.answered_any(), now);
      return;
    }
  }

  // Closes the socket and hands the slices to the client (retry or fail).
  void Close(const absl::Status& cause, bool failed, absl::Time now) {
    if (closed_) return;
    CloseSocket();
    client_->OnConnClosed(pool_, this, cause, failed, now);
  }

  // Closes the socket only (the caller deals with the session).
  void CloseSocket() {
    if (closed_) return;
    closed_ = true;
    pool_->loop->loop->Remove(fd_.get());
    fd_.Reset();
    client_->conns_open_.fetch_sub(1, std::memory_order_relaxed);
  }

  absl::Time connect_deadline() const { return connect_deadline_; }
  absl::Time last_busy() const { return last_busy_; }

 private:
  void UpdateInterest() {
    const uint32_t want =
        connected_ ? EPOLLIN | (session_.has_output() ? EPOLLOUT : 0u)
                   : EPOLLOUT;
    if (want == interest_) return;
    if (pool_->loop->loop->Modify(fd_.get(), want, this).ok()) interest_ = want;
  }

  TcpClient* const client_;
  Pool* const pool_;
  UniqueFd fd_;
  ClientSession session_;
  const absl::Time connect_deadline_;
  absl::Time last_busy_;
  bool connected_ = false;
  bool closed_ = false;
  uint32_t interest_ = EPOLLOUT;
};

TcpClient::TcpClient(const TcpOptions& options, absl::Duration connect_timeout)
    : options_(options), connect_timeout_(connect_timeout) {}

TcpClient::~TcpClient() { Shutdown(); }

absl::Status TcpClient::Start(Clock* clock, std::string auth_token) {
  clock_ = clock;
  auth_token_ = std::move(auth_token);  // Before any loop thread reads it.
  const int n = std::max(1, options_.io_threads);
  for (int i = 0; i < n; ++i) {
    auto loop = std::make_unique<Loop>();
    loop->loop =
        std::make_unique<EventLoop>(absl::StrCat("tcp-client-", i), clock_);
    Loop* raw = loop.get();
    loops_.push_back(std::move(loop));
    if (absl::Status s = raw->loop->Start(
            [this, raw](absl::Time now) { return Tick(raw, now); });
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

int TcpClient::threads() const {
  int n = 0;
  for (const auto& l : loops_) n += l->loop->running() ? 1 : 0;
  return n;
}

absl::Status TcpClient::BackoffStatus(const Pool& pool, absl::Time now) const {
  return BackoffError(pool.address, pool.failures, pool.last_failure,
                      pool.retry_after - now);
}

void TcpClient::Submit(absl::Span<Slice* const> slices) {
  const absl::Time now = clock_->Now();
  std::vector<Done> failed;
  // Slices per pool, in order (usually one pool per call).
  std::vector<std::pair<std::shared_ptr<Pool>, std::vector<Slice*>>> routed;
  {
    MutexLock lock(&mu_);
    const SegmentView* target = nullptr;
    std::shared_ptr<Pool> pool;
    absl::Status error;
    for (Slice* slice : slices) {
      if (shut_down_) {
        failed.push_back(
            {slice, absl::CancelledError("TCP transport is shut down")});
        continue;
      }
      if (slice->target != target) {
        target = slice->target;
        pool = nullptr;
        error = absl::OkStatus();
        const metadata::TransportEndpoint* ep = target->FindTransport("tcp");
        if (ep == nullptr) {
          error = absl::FailedPreconditionError(absl::StrCat(
              "segment '", target->name(), "' has no TCP endpoint"));
        } else if (auto it = pools_.find(ep->address()); it != pools_.end()) {
          pool = it->second;
        } else if (auto addr = ParseNumericEndpoint(ep->address());
                   !addr.ok()) {
          // No pool for an address that does not parse: nothing is kept.
          error = absl::InvalidArgumentError(absl::StrCat(
              "segment '", target->name(), "': TCP ", addr.status().message()));
        } else if (pools_.size() >= static_cast<size_t>(options_.max_peers) &&
                   !EvictIdleLocked()) {
          error = absl::ResourceExhaustedError(absl::StrCat(
              "TCP transport: all ", options_.max_peers,
              " peer slots (tcp.max_peers) have transfers in flight; "
              "cannot add peer ",
              ep->address()));
        } else {
          Loop* loop = loops_[next_loop_++ % loops_.size()].get();
          pool = std::make_shared<Pool>(ep->address(), *addr, loop, now);
          pools_.emplace(ep->address(), pool);
          all_pools_.emplace(pool.get(), pool);
        }
        if (pool != nullptr) {
          pool->last_use.store(++use_clock_, std::memory_order_relaxed);
        }
      }
      if (!error.ok()) {
        failed.push_back({slice, error});
        continue;
      }
      pool->outstanding.fetch_add(1, std::memory_order_relaxed);
      if (routed.empty() || routed.back().first != pool) {
        routed.push_back({pool, {}});
      }
      routed.back().second.push_back(slice);
    }
  }
  for (auto& [pool, list] : routed) {
    bool post = false;
    bool fast_failed = false;
    // Counted before they are handed over: once in the inbox a loop may
    // complete them, and their sink free them, at any moment.
    uint64_t bytes = 0;
    for (const Slice* slice : list) bytes += slice->length;
    {
      MutexLock lock(&pool->mu);
      if (now < pool->fail_until) {
        // Backing off: one clear status, no connect attempt.
        const absl::Status s =
            BackoffError(pool->address, pool->fail_count, pool->fail_cause,
                         pool->fail_until - now);
        for (Slice* slice : list) failed.push_back({slice, s});
        fast_failures_.fetch_add(list.size(), std::memory_order_relaxed);
        fast_failed = true;
      } else {
        pool->inbox.insert(pool->inbox.end(), list.begin(), list.end());
        if (!pool->wake_posted) post = pool->wake_posted = true;
      }
    }
    if (fast_failed) {
      if (pool->outstanding.fetch_sub(list.size(), std::memory_order_relaxed) ==
          static_cast<int64_t>(list.size())) {
        MaybeRetireLater(pool);
      }
      continue;
    }
    slices_.fetch_add(list.size(), std::memory_order_relaxed);
    bytes_.fetch_add(bytes, std::memory_order_relaxed);
    if (post) {
      pool->loop->loop->Post([this, p = pool] { Drain(p, clock_->Now()); });
    }
  }
  for (Done& d : failed) d.slice->Complete(d.status);
}

void TcpClient::MaybeRetireLater(const std::shared_ptr<Pool>& pool) {
  {
    MutexLock lock(&mu_);
    auto it = pools_.find(pool->address);
    // Still routed to: it is not closing, and its next slice comes here.
    if (it != pools_.end() && it->second == pool) return;
  }
  // Dropped (ClosePeer, eviction): the task that marked it closing may
  // have run while these slices were counted, and left the pool to retire
  // with its last slice, which is now.
  pool->loop->loop->Post([this, pool] { MaybeRetire(pool.get()); });
}

bool TcpClient::EvictIdleLocked() {
  Pool* victim = nullptr;
  for (auto& [address, pool] : pools_) {
    if (pool->outstanding.load(std::memory_order_relaxed) != 0) continue;
    if (victim == nullptr ||
        pool->last_use.load(std::memory_order_relaxed) <
            victim->last_use.load(std::memory_order_relaxed)) {
      victim = pool.get();
    }
  }
  if (victim == nullptr) return false;
  std::shared_ptr<Pool> pool = pools_[victim->address];
  pools_.erase(victim->address);
  evictions_.fetch_add(1, std::memory_order_relaxed);
  pool->loop->loop->Post([this, pool] {
    pool->closing = true;
    MaybeRetire(pool.get());
  });
  return true;
}

void TcpClient::ClosePeer(const std::string& address) {
  std::shared_ptr<Pool> pool;
  {
    MutexLock lock(&mu_);
    if (shut_down_) return;
    auto it = pools_.find(address);
    if (it == pools_.end()) return;
    pool = std::move(it->second);
    pools_.erase(it);
  }
  pool->loop->loop->Post([this, pool] {
    pool->closing = true;
    MaybeRetire(pool.get());
  });
}

void TcpClient::Drain(const std::shared_ptr<Pool>& pool, absl::Time now) {
  if (!pool->registered) {
    pool->registered = true;
    pool->loop->pools.push_back(pool);
  }
  std::vector<Slice*> slices;
  {
    MutexLock lock(&pool->mu);
    slices.swap(pool->inbox);
    pool->wake_posted = false;
  }
  for (Slice* slice : slices) Dispatch(pool.get(), slice, now, false);
  FlushAll(pool.get(), now);
  pool->loop->loop->TickBy(now + kBusyTick);
  MaybeRetire(pool.get());
}

void TcpClient::FlushAll(Pool* pool, absl::Time now) {
  std::vector<Conn*> conns;
  for (auto& c : pool->conns) {
    if (c->connected() && c->session().has_output()) conns.push_back(c.get());
  }
  for (Conn* c : conns) {
    if (!c->closed()) c->FlushAndWatch(now);  // May close others.
  }
}

void TcpClient::Dispatch(Pool* pool, Slice* slice, absl::Time now, bool retry) {
  pool->last_active = now;
  std::vector<Done> done;
  if (slice->deadline < now) {
    done.push_back({slice, SliceDeadlineError(pool->address, *slice)});
    return Complete(pool, &done, now);
  }
  Conn* best = nullptr;
  for (auto& c : pool->conns) {
    if (best == nullptr ||
        c->session().load_bytes() < best->session().load_bytes()) {
      best = c.get();
    }
  }
  const bool want_more =
      pool->conns.size() < static_cast<size_t>(options_.connections_per_peer) &&
      (best == nullptr || best->session().load_bytes() > 0);
  if (want_more && now >= pool->retry_after) {
    absl::Status error;
    if (Conn* c = OpenConn(pool, now, &error); c != nullptr) {
      best = c;
    } else if (best == nullptr) {
      // This slice's own attempt failed: not a fast failure.
      done.push_back({slice, BackoffStatus(*pool, now)});
      return Complete(pool, &done, now);
    }
  }
  if (best == nullptr) {
    if (!retry) fast_failures_.fetch_add(1, std::memory_order_relaxed);
    done.push_back({slice, BackoffStatus(*pool, now)});
    return Complete(pool, &done, now);
  }
  best->Add(slice, now);
}

TcpClient::Conn* TcpClient::OpenConn(Pool* pool, absl::Time now,
                                     absl::Status* error) {
  connects_.fetch_add(1, std::memory_order_relaxed);
  auto fd = StartConnect(pool->addr);
  if (fd.ok()) {
    const int raw = fd->get();
    auto conn = std::make_unique<Conn>(this, pool, std::move(*fd), now);
    absl::Status s = pool->loop->loop->Add(raw, EPOLLOUT, conn.get());
    if (s.ok()) {
      conns_open_.fetch_add(1, std::memory_order_relaxed);
      pool->conns.push_back(std::move(conn));
      return pool->conns.back().get();
    }
    *error = s;
  } else {
    *error = fd.status();
  }
  // Failed at once (refused on loopback, out of fds): back off as for any
  // failed connect.
  RecordFailure(pool, *error, now);
  return nullptr;
}

void TcpClient::RecordFailure(Pool* pool, const absl::Status& cause,
                              absl::Time now) {
  connect_failures_.fetch_add(1, std::memory_order_relaxed);
  ++pool->failures;
  pool->last_failure = cause;
  pool->retry_after =
      now + std::min(options_.backoff_max,
                     options_.backoff_min *
                         (int64_t{1} << std::min(pool->failures - 1, 20)));
  FERRY_LOG_EVERY(kWarn, "tcp", absl::Seconds(1), "peer ", pool->address, ": ",
                  cause.message(), "; not tried again for ",
                  absl::FormatDuration(pool->retry_after - now), " (failure ",
                  pool->failures, ")");
  // With no connection left, Submit fails the peer's slices at once until
  // the next attempt is due.
  if (pool->conns.empty()) {
    MutexLock lock(&pool->mu);
    pool->fail_until = pool->retry_after;
    pool->fail_cause = cause;
    pool->fail_count = pool->failures;
    pool->published = true;
  }
}

void TcpClient::OnConnAnswered(Pool* pool) {
  pool->failures = 0;
  pool->retry_after = absl::InfinitePast();
  if (pool->published) {
    MutexLock lock(&pool->mu);
    pool->fail_until = absl::InfinitePast();
    pool->published = false;
  }
}

void TcpClient::OnConnClosed(Pool* pool, Conn* conn, const absl::Status& cause,
                             bool failed, absl::Time now) {
  // Complete may retire a closing pool; the retries and MaybeRetire below
  // still use it (the close may start in a Conn handler holding nothing).
  const std::shared_ptr<Pool> keep = pool->shared_from_this();
  std::vector<Slice*> retry;
  std::vector<Done> done;
  conn->session().Abort(cause, now, &retry, &done);
  std::unique_ptr<Conn> owned;
  for (auto it = pool->conns.begin(); it != pool->conns.end(); ++it) {
    if (it->get() == conn) {
      owned = std::move(*it);
      pool->conns.erase(it);
      break;
    }
  }
  if (owned != nullptr) pool->loop->loop->DestroyLater(std::move(owned));
  if (failed) RecordFailure(pool, cause, now);
  // Each slice's fate is settled before any completes: a completed slice
  // may be freed by its sink, so it must not be looked at again.
  std::vector<Slice*> again;
  for (Slice* slice : retry) {
    if (++slice->attempts >= kMaxAttempts) {
      done.push_back({slice, cause});
    } else {
      again.push_back(slice);
    }
  }
  Complete(pool, &done, now);
  for (Slice* slice : again) {
    retries_.fetch_add(1, std::memory_order_relaxed);
    Dispatch(pool, slice, now, /*retry=*/true);
  }
  if (!again.empty()) FlushAll(pool, now);
  MaybeRetire(pool);
}

void TcpClient::Complete(Pool* pool, std::vector<Done>* done, absl::Time now) {
  if (done->empty()) return;
  pool->outstanding.fetch_sub(done->size(), std::memory_order_relaxed);
  pool->last_active = now;
  // Successes in groups per sink (one call for a batch's worth).
  std::vector<Slice*> ok;
  auto flush = [&] {
    if (!ok.empty()) ok.front()->sink->OnSlicesDone(ok.data(), ok.size());
    ok.clear();
  };
  for (Done& d : *done) {
    if (d.status.ok()) {
      if (!ok.empty() && ok.front()->sink != d.slice->sink) flush();
      ok.push_back(d.slice);
    } else {
      flush();
      d.slice->Complete(d.status);
    }
  }
  flush();
  done->clear();
  MaybeRetire(pool);
}

void TcpClient::MaybeRetire(Pool* pool) {
  if (!pool->closing || pool->retired ||
      pool->outstanding.load(std::memory_order_relaxed) != 0) {
    return;
  }
  pool->retired = true;
  for (auto& c : pool->conns) {
    c->CloseSocket();  // Idle: no slice in its session.
    pool->loop->loop->DestroyLater(std::move(c));
  }
  pool->conns.clear();
  std::shared_ptr<Pool> keep;  // The loop's reference; dropped last.
  auto& list = pool->loop->pools;
  for (auto it = list.begin(); it != list.end(); ++it) {
    if (it->get() == pool) {
      keep = std::move(*it);
      list.erase(it);
      break;
    }
  }
  MutexLock lock(&mu_);
  all_pools_.erase(pool);
}

absl::Duration TcpClient::Tick(Loop* loop, absl::Time now) {
  bool busy = false;
  std::vector<std::shared_ptr<Pool>> idle;
  const std::vector<std::shared_ptr<Pool>> pools = loop->pools;
  for (const auto& pool : pools) {
    if (pool->retired) continue;
    std::vector<Conn*> conns;
    for (auto& c : pool->conns) conns.push_back(c.get());
    std::vector<Done> done;
    for (Conn* c : conns) {
      if (c->closed()) continue;
      if (!c->connected()) {
        if (now > c->connect_deadline()) {
          c->Close(absl::DeadlineExceededError(absl::StrCat(
                       "connect ", pool->address, ": no answer within ",
                       absl::FormatDuration(connect_timeout_))),
                   /*failed=*/true, now);
        } else {
          // Nothing is on the wire before the connect completed, so late
          // slices leave now rather than at the connect timeout, which
          // may be seconds after their deadline.
          c->session().Expire(now, &done);
          busy = true;
        }
        continue;
      }
      if (c->session().awaiting_challenge() && now > c->connect_deadline()) {
        c->Close(
            absl::FailedPreconditionError(absl::StrCat(
                "TCP connection to ", pool->address, ": no challenge within ",
                absl::FormatDuration(connect_timeout_),
                " of connecting; this engine has a cluster token, and "
                "the target runs without one (or is not a Ferry "
                "engine)")),
            /*failed=*/true, now);
        continue;
      }
      if (c->session().Expire(now, &done)) {
        // A slice on the wire is late: its frame cannot be taken back.
        c->Close(absl::UnavailableError(absl::StrCat(
                     "TCP connection to ", pool->address,
                     " closed: a transfer on it passed its deadline")),
                 !c->session().answered_any(), now);
        continue;
      }
      if (!c->session().empty()) {
        busy = true;
      } else if (now - c->last_busy() > options_.idle_timeout / 2) {
        // Before the target's idle timeout could race a new request.
        c->Close(absl::UnavailableError("idle"), /*failed=*/false, now);
      }
    }
    Complete(pool.get(), &done, now);
    if (!pool->retired && !pool->closing && pool->conns.empty() &&
        pool->outstanding.load(std::memory_order_relaxed) == 0 &&
        now >= pool->retry_after &&
        now - pool->last_active > options_.idle_timeout) {
      idle.push_back(pool);
    }
  }
  if (!idle.empty()) {
    {
      MutexLock lock(&mu_);
      for (auto it = idle.begin(); it != idle.end();) {
        auto found = pools_.find((*it)->address);
        if (found != pools_.end() && found->second == *it &&
            (*it)->outstanding.load(std::memory_order_relaxed) == 0) {
          pools_.erase(found);
          evictions_.fetch_add(1, std::memory_order_relaxed);
          ++it;
        } else {
          it = idle.erase(it);
        }
      }
    }
    for (const auto& pool : idle) {
      pool->closing = true;
      MaybeRetire(pool.get());
    }
  }
  return busy ? kBusyTick : kIdleTick;
}

void TcpClient::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  for (auto& l : loops_) l->loop->Stop();
  // The loops are joined: this thread is the only one left, and no
  // syscall is in progress on any slice's memory.
  std::vector<std::shared_ptr<Pool>> pools;
  {
    MutexLock lock(&mu_);
    for (auto& [raw, pool] : all_pools_) pools.push_back(pool);
    all_pools_.clear();
    pools_.clear();
  }
  const absl::Status cancelled =
      absl::CancelledError("TCP transport shut down");
  for (const auto& pool : pools) {
    std::vector<Done> done;
    {
      MutexLock lock(&pool->mu);
      for (Slice* s : pool->inbox) done.push_back({s, cancelled});
      pool->inbox.clear();
    }
    for (auto& c : pool->conns) {
      c->CloseSocket();
      c->session().Abort(cancelled, absl::InfinitePast(), nullptr, &done);
    }
    pool->conns.clear();
    pool->retired = true;  // Nothing may retire it again.
    Complete(pool.get(), &done, clock_->Now());
  }
  for (auto& l : loops_) l->pools.clear();
}

void TcpClient::AddStats(TransportStats* st) const {
  if (!st->nics.empty()) {
    st->nics[0].slices += slices_.load(std::memory_order_relaxed);
    st->nics[0].bytes += bytes_.load(std::memory_order_relaxed);
  }
  st->endpoints += conns_open_.load(std::memory_order_relaxed);
  st->connects_started += connects_.load(std::memory_order_relaxed);
  st->connect_failures += connect_failures_.load(std::memory_order_relaxed);
  st->fast_failures += fast_failures_.load(std::memory_order_relaxed);
  st->retries += retries_.load(std::memory_order_relaxed);
  st->evictions += evictions_.load(std::memory_order_relaxed);
  st->threads += threads();
  MutexLock lock(&mu_);
  st->peers += all_pools_.size();
}

}  // namespace ferry::tcp
