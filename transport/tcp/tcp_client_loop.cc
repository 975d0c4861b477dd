// TcpClient (tcp_client.h): the loop thread's side. Dispatch of queued
// slices to the least loaded connection of their pool, connects and the
// back-off of failing peers, the fate of a closed connection's slices,
// completion, deadlines and idle timeouts (Tick), and the retirement of
// dropped pools.
#include <sys/epoll.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/socket_util.h"
#include "transport/tcp/tcp_client.h"
#include "transport/tcp/tcp_client_conn.h"
#include "transport/tcp/tcp_client_pool.h"

namespace ferry::tcp {
namespace {

// Deadlines are checked this often while slices are in flight.
constexpr absl::Duration kBusyTick = absl::Milliseconds(10);
constexpr absl::Duration kIdleTick = absl::Seconds(1);
// Tries of a slice that never reached the wire, over closing connections.
constexpr uint32_t kMaxAttempts = 4;

using Done = ClientSession::Done;

}  // namespace

absl::Status BackoffError(absl::string_view address, int failures,
                          const absl::Status& last, absl::Duration next_in) {
  return absl::UnavailableError(absl::StrCat(
      "TCP peer ", address, " is backed off after ", failures,
      " failed attempt", failures == 1 ? "" : "s", " (last: ", last.message(),
      "); next attempt in ",
      absl::FormatDuration(absl::Ceil(std::max(next_in, absl::ZeroDuration()),
                                      absl::Milliseconds(1)))));
}

absl::Status TcpClient::BackoffStatus(const Pool& pool, absl::Time now) const {
  return BackoffError(pool.address, pool.failures, pool.last_failure,
                      pool.retry_after - now);
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
  auto fd = StartConnect(pool->addr, source_ ? &*source_ : nullptr);
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

}  // namespace ferry::tcp
