#include "transport/tcp/tcp_transport.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry::tcp {
namespace {

// Deadlines are checked at this granularity.
constexpr absl::Duration kReapInterval = absl::Milliseconds(20);
// Reconnect backoff doubles from the first to the last value: a dead peer
// costs one connect attempt per interval, not one per slice.
constexpr absl::Duration kMinBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(2);
// Unregistering waits this long for peers' accesses in progress.
constexpr absl::Duration kUnregisterWait = absl::Seconds(10);

}  // namespace

TcpTransport::TcpTransport(const TransportOptions& options)
    : options_(options) {}

TcpTransport::~TcpTransport() { Shutdown(); }

absl::Status TcpTransport::Install(const TransportEnv& env,
                                   metadata::TransportEndpoint* endpoint) {
  if (options_.tcp.connections_per_peer < 1 ||
      options_.tcp.connections_per_peer > 64) {
    return absl::InvalidArgumentError(
        "tcp.connections_per_peer must be in 1..64");
  }
  if (options_.tcp.max_slice_bytes == 0 ||
      options_.tcp.max_slice_bytes > (64u << 20)) {
    return absl::InvalidArgumentError(
        "tcp.max_slice_bytes must be in 1..64 MiB");
  }
  if (absl::Status s = server_.Start(env.listen_host, 0); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("TCP transport: ", s.message()));
  }
  endpoint->set_address(absl::StrCat(env.listen_host, ":", server_.port()));
  reaper_ = std::thread([this] { ReaperLoop(); });
  return absl::OkStatus();
}

absl::StatusOr<MemoryHandle> TcpTransport::RegisterMemory(
    const MemoryRegion& region, metadata::Buffer*) {
  if (absl::Status s = registry_.Add(region); !s.ok()) return s;
  return nullptr;  // The target side looks buffers up per request.
}

absl::Status TcpTransport::UnregisterMemory(uintptr_t addr) {
  return registry_.Remove(addr, kUnregisterWait);
}

TcpConnection* TcpTransport::PickLocked(Pool* pool, absl::Status* why) {
  absl::Time now = absl::Now();
  // Bury broken connections, and learn from them for the backoff: a peer
  // that cannot be reached costs one connect attempt per backoff interval.
  for (auto& c : pool->conns) {
    if (!c->broken()) continue;
    if (c->ever_connected()) {
      pool->consecutive_failures = 0;
    } else {
      ++connect_failures_;
      pool->last_failure = c->failure();
      pool->retry_after =
          now + std::min(kMaxBackoff,
                         kMinBackoff *
                             (1 << std::min(pool->consecutive_failures, 6)));
      ++pool->consecutive_failures;
    }
    graveyard_.push_back(std::move(c));
  }
  pool->conns.erase(
      std::remove(pool->conns.begin(), pool->conns.end(), nullptr),
      pool->conns.end());
  TcpConnection* best = nullptr;
  for (auto& c : pool->conns) {
    if (best == nullptr || c->load_bytes() < best->load_bytes()) best = c.get();
  }
  const size_t want = static_cast<size_t>(options_.tcp.connections_per_peer);
  if (pool->conns.size() < want &&
      (best == nullptr || best->load_bytes() > 0)) {
    if (now < pool->retry_after && best == nullptr) {
      *why = absl::UnavailableError(absl::StrCat(
          "peer ", pool->addr.ToString(), " unreachable, retrying in ",
          absl::FormatDuration(pool->retry_after - now), ": ",
          pool->last_failure.message()));
      return nullptr;
    }
    if (now >= pool->retry_after) {
      pool->conns.push_back(std::make_unique<TcpConnection>(
          pool->addr, options_.connect_timeout));
      ++connects_started_;
      best = pool->conns.back().get();
    }
  }
  return best;
}

void TcpTransport::Submit(absl::Span<Slice* const> slices) {
  struct Routed {
    Slice* slice;
    TcpConnection* conn;
    absl::Status error;
  };
  std::vector<Routed> routed;
  routed.reserve(slices.size());
  {
    MutexLock lock(&mu_);
    for (Slice* slice : slices) {
      Routed r{slice, nullptr, absl::OkStatus()};
      const metadata::TransportEndpoint* ep =
          slice->target->FindTransport("tcp");
      if (shut_down_) {
        r.error = absl::CancelledError("TCP transport is shut down");
      } else if (ep == nullptr) {
        r.error = absl::FailedPreconditionError(absl::StrCat(
            "segment '", slice->target->name(), "' has no TCP endpoint"));
      } else {
        auto& pool = pools_[ep->address()];
        if (pool == nullptr) {
          auto addr = ParseHostPort(ep->address());
          if (!addr.ok()) {
            r.error = addr.status();
            routed.push_back(std::move(r));
            continue;
          }
          pool = std::make_unique<Pool>();
          pool->addr = *addr;
        }
        r.conn = PickLocked(pool.get(), &r.error);
      }
      routed.push_back(std::move(r));
    }
  }
  // Completions may run inline (a broken connection fails at once), so
  // enqueue outside the lock.
  for (Routed& r : routed) {
    if (r.conn != nullptr) {
      slices_.fetch_add(1, std::memory_order_relaxed);
      bytes_.fetch_add(r.slice->length, std::memory_order_relaxed);
      r.conn->Enqueue(r.slice);
    } else {
      r.slice->Complete(r.error);
    }
  }
}

void TcpTransport::ClosePeer(const SegmentView& segment) {
  // TODO(issue 9): close the peer's pool.
  (void)segment;
}

TransportStats TcpTransport::Stats() const {
  TransportStats st;
  st.transport = "tcp";
  NicStats& all = st.nics.emplace_back();
  all.name = "tcp";
  all.port_active = true;
  all.slices = slices_.load(std::memory_order_relaxed);
  all.bytes = bytes_.load(std::memory_order_relaxed);
  MutexLock lock(&mu_);
  for (const auto& [addr, pool] : pools_) st.endpoints += pool->conns.size();
  st.connects_started = connects_started_;
  st.connect_failures = connect_failures_;
  return st;
}

void TcpTransport::ReaperLoop() {
  while (!stop_reaper_.WaitForNotificationWithTimeout(kReapInterval)) {
    std::vector<std::unique_ptr<TcpConnection>> dead;
    {
      absl::Time now = absl::Now();
      MutexLock lock(&mu_);
      for (auto& [addr, pool] : pools_) {
        for (auto& c : pool->conns) c->ExpireOverdue(now);
      }
      dead.swap(graveyard_);
    }
    // Joining a connection's threads can take a moment: not under mu_.
    dead.clear();
  }
}

void TcpTransport::Shutdown() {
  std::vector<std::unique_ptr<TcpConnection>> conns;
  {
    MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [addr, pool] : pools_) {
      for (auto& c : pool->conns) conns.push_back(std::move(c));
    }
    pools_.clear();
    for (auto& c : graveyard_) conns.push_back(std::move(c));
    graveyard_.clear();
  }
  if (!stop_reaper_.HasBeenNotified()) stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  conns.clear();  // Fails what is still in flight with Cancelled.
  server_.Stop();
}

}  // namespace ferry::tcp
