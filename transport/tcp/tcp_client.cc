// TcpClient: the callers' side (any thread): start and shutdown, Submit's
// routing of slices to the pools of their peers, eviction of idle pools,
// ClosePeer and the stats. The loop thread's side is in
// tcp_client_loop.cc, a connection's socket I/O in tcp_client_conn.cc.
#include "transport/tcp/tcp_client.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "transport/tcp/tcp_client_conn.h"
#include "transport/tcp/tcp_client_pool.h"

namespace ferry::tcp {
namespace {

using Done = ClientSession::Done;

}  // namespace

TcpClient::TcpClient(const TcpOptions& options, absl::Duration connect_timeout)
    : options_(options), connect_timeout_(connect_timeout) {}

TcpClient::~TcpClient() { Shutdown(); }

absl::Status TcpClient::Start(Clock* clock, std::string auth_token,
                              const std::string& source_host) {
  clock_ = clock;
  auth_token_ = std::move(auth_token);  // Before any loop thread reads it.
  if (auto sa = ParseNumericEndpoint(JoinHostPort(source_host, 1));
      sa.ok() && !sa->IsWildcard()) {
    source_ = *sa;
  }
  const int n = std::max(1, options_.io_threads);
  for (int i = 0; i < n; ++i) {
    auto loop = std::make_unique<Loop>();
    loop->loop =
        std::make_unique<EventLoop>(absl::StrCat("tcp-client-", i), clock_);
    Loop* raw = loop.get();
    loops_.push_back(std::move(loop));
    auto tick = [this, raw](absl::Time now) { return Tick(raw, now); };
    FERRY_RETURN_IF_ERROR(raw->loop->Start(std::move(tick)));
  }
  return absl::OkStatus();
}

int TcpClient::threads() const {
  int n = 0;
  for (const auto& l : loops_) n += l->loop->running() ? 1 : 0;
  return n;
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
        const descriptor::TransportEndpoint* ep = target->FindTransport("tcp");
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
