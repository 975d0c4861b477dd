// RdmaTransport: rail choice, endpoints and posting -- the submit path.
//
// Slices that share a target snapshot are routed as one run: the peer, the
// rails' loads and health are read once per run (one lock), each slice's
// rail is chosen from that snapshot (updated as slices are assigned), and
// each rail's slices are handed to its endpoint at once (one lock, chained
// posts). Nothing here blocks on the network or on a handshake.
#include <algorithm>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "transport/rdma/rail_router.h"
#include "transport/rdma/rdma_transport.h"

namespace ferry::rdma {
namespace {

// How often slices may bounce off endpoints that failed under them before
// they fail.
constexpr int kMaxReroutes = 4;

// Time since routing after which Enqueue checks deadlines again.
constexpr absl::Duration kStaleRoute = absl::Milliseconds(1);

}  // namespace

void RdmaTransport::Submit(absl::Span<Slice* const> slices) {
  if (stopping_.load(std::memory_order_acquire)) {
    for (Slice* s : slices) {
      s->Complete(absl::CancelledError("RDMA transport is shut down"));
    }
    return;
  }
  if (mrs_.any_staged()) {
    return SubmitSomeStaged(slices);
  }
  const absl::Time now = clock_->Now();
  size_t i = 0;
  while (i < slices.size()) {
    size_t j = i + 1;
    while (j < slices.size() && slices[j]->target == slices[i]->target) ++j;
    RouteRun(slices.subspan(i, j - i), now, 0);
    i = j;
  }
}

void RdmaTransport::SubmitSomeStaged(absl::Span<Slice* const> slices) {
  // GPU memory no NIC could register goes through host buffers; the rest
  // is routed as usual, in runs to one target.
  auto staged = [](const Slice* s) {
    const auto* mr = static_cast<const LocalMr*>(s->local_handle);
    return mr != nullptr && mr->staged ? mr->device : -1;
  };
  const absl::Time now = clock_->Now();
  size_t i = 0;
  while (i < slices.size()) {
    if (const int device = staged(slices[i]); device >= 0) {
      gpu_staging_->Submit(slices[i++], device);
      continue;
    }
    size_t j = i + 1;
    while (j < slices.size() && slices[j]->target == slices[i]->target &&
           staged(slices[j]) < 0) {
      ++j;
    }
    RouteRun(slices.subspan(i, j - i), now, 0);
    i = j;
  }
}

void RdmaTransport::RouteQueue(SliceQueue* q, absl::Time now, int reroutes) {
  absl::InlinedVector<Slice*, 64> v;
  while (Slice* s = q->pop_front()) v.push_back(s);
  size_t i = 0;
  while (i < v.size()) {
    size_t j = i + 1;
    while (j < v.size() && v[j]->target == v[i]->target) ++j;
    RouteRun(absl::MakeConstSpan(v).subspan(i, j - i), now, reroutes);
    i = j;
  }
}

void RdmaTransport::RouteRun(absl::Span<Slice* const> run, absl::Time now,
                             int reroutes) {
  const SegmentView& view = *run[0]->target;
  absl::Status why;
  std::shared_ptr<Peer> peer;
  const int t = view.FindTransportIndex(name());
  if (stopping_.load(std::memory_order_acquire)) {
    why = absl::CancelledError("RDMA transport is shut down");
  } else if (t < 0 || view.descriptor().transports(t).devices_size() == 0) {
    why = absl::FailedPreconditionError(
        absl::StrCat("segment '", view.name(), "' publishes no RDMA device"));
  } else if (reroutes > kMaxReroutes) {
    why = absl::UnavailableError(absl::StrCat("RDMA endpoints to segment '",
                                              view.name(), "' keep failing"));
  } else {
    peer = PeerForView(view, &why);
  }
  if (peer == nullptr) {
    for (Slice* s : run) s->Complete(why);
    return;
  }
  const auto& devices = view.descriptor().transports(t).devices();
  const int n_local = static_cast<int>(nics_.size());
  const int n_remote = devices.size();
  const int n_rails = n_local * n_remote;
  const int64_t now_ns = absl::ToUnixNanos(now);

  // The run's snapshot: rail loads and health, one lock.
  RailRouter router(n_local, n_remote, options_.rdma.slice_bytes,
                    rotate_.fetch_add(1, std::memory_order_relaxed));
  {
    MutexLock lock(&peer->mu);
    for (const Peer::Rail& r : peer->rails) {
      int j = 0;
      while (j < n_remote && devices[j].name() != r.remote_nic) ++j;
      if (j == n_remote) continue;
      RailRouter::RailState& rs = router.rail(r.local * n_remote + j);
      rs.paused = r.health.paused_until_ns > now_ns;
      if (r.ep != nullptr) {
        rs.load = r.ep->inflight_bytes.load(std::memory_order_relaxed);
      }
    }
  }
  for (int i = 0; i < n_local; ++i) {
    router.SetNic(i, nics_[i]->inflight_bytes.load(std::memory_order_relaxed),
                  nics_[i]->port_active());
  }
  int keys_for = -1;     // The buffer the router holds the remote keys of.
  bool any_key = false;  // Whether that buffer has a key on some NIC.
  absl::InlinedVector<SliceQueue, 16> buckets(n_rails);
  absl::InlinedVector<uint64_t, 16> bucket_bytes(n_rails, 0);

  for (Slice* s : run) {
    if (s->deadline <= now) {
      s->Complete(absl::DeadlineExceededError(kPastDeadline));
      continue;
    }
    const auto* mr = static_cast<const LocalMr*>(s->local_handle);
    if (mr == nullptr || mr->staged) {
      // A staged buffer has no MR: its slices reach here only as their
      // staging buffer's (SubmitSomeStaged).
      s->Complete(absl::FailedPreconditionError(
          mr == nullptr
              ? "local memory is not registered with the RDMA transport"
              : "staged GPU memory reached the RDMA data path unstaged"));
      continue;
    }
    if (s->remote_buffer != keys_for) {
      keys_for = s->remote_buffer;
      any_key = false;
      for (int j = 0; j < n_remote; ++j) {
        uint32_t k;
        const bool has = view.DeviceKey(t, keys_for, j, &k);
        any_key |= has;
        router.SetKey(j, has ? int64_t{k} : -1);
      }
    }
    if (!any_key) {
      s->Complete(absl::FailedPreconditionError(absl::StrCat(
          "segment '", view.name(),
          "' publishes no RDMA key for the buffer "
          "holding 0x",
          absl::Hex(s->remote),
          ": none of its NICs registered it (they were down then, or it is "
          "GPU memory without GPUDirect RDMA there, which peers reach over "
          "TCP only: run tcp beside rdma on both engines)")));
      continue;
    }
    const int best = router.Choose(mr->tiers, SliceFailedRails(s));
    if (best < 0) {
      s->Complete(absl::UnavailableError(absl::StrCat(
          "no usable RDMA rail to segment '", view.name(),
          "' (all local ports down, or no remote key for the buffer)")));
      continue;
    }
    SetSliceRoute(s, best,
                  static_cast<uint32_t>(router.key(router.remote_of(best))));
    router.Assign(best, s->length);
    buckets[best].push_back(s);
    bucket_bytes[best] += s->length;
  }
  for (int r = 0; r < n_rails; ++r) {
    if (buckets[r].empty()) continue;
    auto ep =
        RailEndpoint(peer, r / n_remote, devices[r % n_remote].name(), &why);
    if (ep == nullptr) {
      fast_failures_.fetch_add(buckets[r].size(), std::memory_order_relaxed);
      while (Slice* s = buckets[r].pop_front()) s->Complete(why);
      continue;
    }
    Enqueue(ep, &buckets[r], bucket_bytes[r], now, reroutes);
  }
}

std::shared_ptr<Endpoint> RdmaTransport::RailEndpoint(
    const std::shared_ptr<Peer>& peer, int local, const std::string& remote_nic,
    absl::Status* why) {
  std::shared_ptr<Endpoint> ep;
  bool created = false;
  Later later;
  {
    MutexLock lock(&peer->mu);
    Peer::Rail& rail = peer->GetRail(local, remote_nic);
    if (rail.ep != nullptr) {
      const Endpoint::State st = rail.ep->state();
      if (st == Endpoint::State::kConnecting ||
          st == Endpoint::State::kConnected) {
        ep = rail.ep;
      } else {
        // Failed under us (a QP error seen by a poller that has not told
        // the connector yet): tell it now.
        Actions acts;
        rail.conn.Failed(rail.ep->id(), &acts);
        ApplyLocked(peer.get(), &rail, acts, nullptr, nullptr, &later);
      }
    }
    if (ep == nullptr) {
      const int64_t now = clock_->NowNanos();
      if (peer->backoff.Admit(now) == ConnectBackoff::Verdict::kFailFast) {
        // Fail fast while backing off: no reconnect storm.
        *why = absl::UnavailableError(absl::StrCat(
            "RDMA peer '", peer->name(), "' unreachable (retrying in ",
            (peer->backoff.retry_after_ns() - now) / 1000000,
            " ms): ", peer->backoff.last_error().message()));
        return nullptr;
      }
      ep = std::make_shared<Endpoint>(next_endpoint_id_.fetch_add(1), peer,
                                      peer->incarnation, local,
                                      nics_[local].get(), remote_nic);
      ep->backoff_gen = peer->backoff.generation();
      Actions acts;
      rail.conn.Need(ep->id(), &acts);
      ApplyLocked(peer.get(), &rail, acts, ep, nullptr, &later);
      created = true;
    }
  }
  ep->used.store(true, std::memory_order_relaxed);
  ep->active.store(true, std::memory_order_relaxed);
  if (created) StoreInsert(ep);
  RunLater(&later, /*inline_ok=*/true);
  return ep;
}

void RdmaTransport::StoreInsert(const std::shared_ptr<Endpoint>& ep) {
  std::vector<std::shared_ptr<Endpoint>> evicted;
  store_.Insert(ep, &evicted);
  for (auto& v : evicted) Close(v, /*evicted=*/true);
}

void RdmaTransport::TrimStore() {
  std::vector<std::shared_ptr<Endpoint>> evicted;
  store_.Trim(&evicted);
  for (auto& v : evicted) Close(v, /*evicted=*/true);
}

void RdmaTransport::Enqueue(const std::shared_ptr<Endpoint>& ep, SliceQueue* q,
                            uint64_t bytes, absl::Time now, int reroutes) {
  // Slices past their deadline end here, unposted: a post to an earlier
  // rail may have blocked (softrnic, a stopped peer) until its flush, and
  // `now` is from before it; posting them would block again. (Only then:
  // the routing checked `now` already.)
  if (const absl::Time fresh = clock_->Now(); fresh - now >= kStaleRoute) {
    SliceQueue live;
    while (Slice* s = q->pop_front()) {
      if (s->deadline <= fresh) {
        bytes -= s->length;
        s->Complete(absl::DeadlineExceededError(kPastDeadline));
      } else {
        live.push_back(s);
      }
    }
    q->Append(&live);
    if (q->empty()) return;
  }
  const uint32_t n = static_cast<uint32_t>(q->size());
  SliceQueue bounced;
  Endpoint::PostResult result = Endpoint::PostResult::kDone;
  {
    MutexLock lock(&ep->mu);
    const Endpoint::State st = ep->state();
    if (st == Endpoint::State::kClosing || st == Endpoint::State::kFailed) {
      bounced.Append(q);  // Failed or closed since we looked it up.
    } else {
      ep->Load(n, bytes);
      Nic* nic = ep->nic();
      nic->slices.fetch_add(n, std::memory_order_relaxed);
      nic->bytes.fetch_add(bytes, std::memory_order_relaxed);
      ep->waiting.Append(q);
      // Connected: post now, on this thread.
      if (st == Endpoint::State::kConnected) result = ep->PostLocked();
    }
  }
  AfterPost(ep, result);
  if (!bounced.empty()) RouteQueue(&bounced, now, reroutes + 1);
}

void RdmaTransport::PostOrPark(const std::shared_ptr<Endpoint>& ep) {
  Endpoint::PostResult result;
  {
    MutexLock lock(&ep->mu);
    result = ep->PostLocked();
  }
  AfterPost(ep, result);
}

void RdmaTransport::AfterPost(const std::shared_ptr<Endpoint>& ep,
                              Endpoint::PostResult result) {
  if (result == Endpoint::PostResult::kRefused) {
    FailEndpoint(ep, absl::UnavailableError("ibv_post_send refused"), false);
  } else if (result == Endpoint::PostResult::kNicFull) {
    completions_.Park(ep->local_nic(), ep);
    // The NIC's last completions may have been reaped between the full
    // post and the parking, with nothing left to wake the parked: look
    // again. (Bounded: each round posts, or finds the budget used.)
    Nic* nic = ep->nic();
    if (nic->posted_wrs.load(std::memory_order_acquire) <
        nic->max_posted_wrs()) {
      for (auto& s : completions_.TakeParked(ep->local_nic())) PostOrPark(s);
    }
  }
}

}  // namespace ferry::rdma
