// SlicePath: rail choice and posting -- the submit path.
//
// Slices that share a target snapshot are routed as one run: the peer, the
// rails' loads and health are read once per run (one lock), each slice's
// rail is chosen from that snapshot (updated as slices are assigned), and
// each rail's slices are handed to its endpoint at once (one lock, chained
// posts). Nothing here blocks on the network or on a handshake.
#include "transport/rdma/slice_path.h"

#include <algorithm>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "transport/rdma/local_mr.h"
#include "transport/rdma/rail_router.h"

namespace ferry::rdma {
namespace {

// How often slices may bounce off endpoints that failed under them before
// they fail.
constexpr int kMaxReroutes = 4;

// Time since routing after which Enqueue checks deadlines again.
constexpr absl::Duration kStaleRoute = absl::Milliseconds(1);

}  // namespace

void SlicePath::RouteQueue(SliceQueue* q, absl::Time now, int reroutes) {
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

void SlicePath::RouteRun(absl::Span<Slice* const> run, absl::Time now,
                         int reroutes) {
  const SegmentView& view = *run[0]->target;
  absl::Status why;
  std::shared_ptr<Peer> peer;
  const int t = view.FindTransportIndex("rdma");
  if (ctx_->stopping.load(std::memory_order_acquire)) {
    why = absl::CancelledError("RDMA transport is shut down");
  } else if (t < 0 || view.descriptor().transports(t).devices_size() == 0) {
    why = absl::FailedPreconditionError(
        absl::StrCat("segment '", view.name(), "' publishes no RDMA device"));
  } else if (reroutes > kMaxReroutes) {
    why = absl::UnavailableError(absl::StrCat("RDMA endpoints to segment '",
                                              view.name(), "' keep failing"));
  } else {
    peer = rails_->PeerForView(view, &why);
  }
  if (peer == nullptr) {
    for (Slice* s : run) s->Complete(why);
    return;
  }
  const auto& devices = view.descriptor().transports(t).devices();
  const int n_local = static_cast<int>(ctx_->nics.size());
  const int n_remote = devices.size();
  const int n_rails = n_local * n_remote;
  const int64_t now_ns = absl::ToUnixNanos(now);

  // The run's snapshot: rail loads and health, one lock.
  RailRouter router(n_local, n_remote, ctx_->options.rdma.slice_bytes,
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
    router.SetNic(i,
                  ctx_->nics[i]->inflight_bytes.load(std::memory_order_relaxed),
                  ctx_->nics[i]->port_active());
  }
  int keys_for = -1;     // The buffer the router holds the remote keys of.
  bool any_key = false;  // Whether that buffer has a key on some NIC.
  absl::InlinedVector<SliceQueue, 16> buckets(n_rails);
  absl::InlinedVector<uint64_t, 16> bucket_bytes(n_rails, 0);

  const uint64_t stripe = ctx_->options.rdma.stripe_bytes;
  for (size_t i = 0; i < run.size();) {
    Slice* const s = run[i++];
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
    // The slices that continue this one in memory, up to a stripe, take
    // its rail: on one rail they coalesce into one work request
    // (Endpoint::PostLocked), where spread slice by slice over several
    // rails each would be its own. Stripes, not slices, spread over the
    // rails. A slice that failed somewhere is routed alone: its rails to
    // avoid are its own.
    size_t end = i;
    uint64_t bytes = s->length;
    if (SliceFailedRails(s) == 0) {
      while (end < run.size() && bytes + run[end]->length <= stripe &&
             SliceFailedRails(run[end]) == 0 && run[end]->deadline > now &&
             ContinuesInMemory(run[end - 1], run[end])) {
        bytes += run[end++]->length;
      }
    }
    const int best = router.Choose(mr->tiers, SliceFailedRails(s));
    if (best < 0) {
      const absl::Status none = absl::UnavailableError(absl::StrCat(
          "no usable RDMA rail to segment '", view.name(),
          "' (all local ports down, or no remote key for the buffer)"));
      s->Complete(none);
      for (; i < end; ++i) run[i]->Complete(none);
      continue;
    }
    const auto key = static_cast<uint32_t>(router.key(router.remote_of(best)));
    router.Assign(best, bytes);
    bucket_bytes[best] += bytes;
    SetSliceRoute(s, best, key);
    buckets[best].push_back(s);
    // Same local MR, remote buffer and key as `s` (ContinuesInMemory).
    for (; i < end; ++i) {
      SetSliceRoute(run[i], best, key);
      buckets[best].push_back(run[i]);
    }
  }
  SliceQueue paused;
  for (int r = 0; r < n_rails; ++r) {
    if (buckets[r].empty()) continue;
    bool rail_paused = false;
    auto ep = rails_->RailEndpoint(
        peer, r / n_remote, devices[r % n_remote].name(), &why, &rail_paused);
    if (ep == nullptr && rail_paused) {
      // Paused since the routing looked (a connect on it failed, say its
      // NIC died at the peer): routed again, other rails take them.
      paused.Append(&buckets[r]);
      continue;
    }
    if (ep == nullptr) {
      ctx_->counters.fast_failures.fetch_add(buckets[r].size(),
                                             std::memory_order_relaxed);
      while (Slice* s = buckets[r].pop_front()) s->Complete(why);
      continue;
    }
    Enqueue(ep, &buckets[r], bucket_bytes[r], now, reroutes);
  }
  if (!paused.empty()) RouteQueue(&paused, now, reroutes + 1);
}

void SlicePath::Enqueue(const std::shared_ptr<Endpoint>& ep, SliceQueue* q,
                        uint64_t bytes, absl::Time now, int reroutes) {
  // Slices past their deadline end here, unposted: a post to an earlier
  // rail may have blocked (softrnic, a stopped peer) until its flush, and
  // `now` is from before it; posting them would block again. (Only then:
  // the routing checked `now` already.)
  if (const absl::Time fresh = ctx_->clock->Now(); fresh - now >= kStaleRoute) {
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
  rails_->AfterPost(ep, result);
  if (!bounced.empty()) RouteQueue(&bounced, now, reroutes + 1);
}

void SlicePath::Reroute(SliceQueue* slices) {
  RouteQueue(slices, ctx_->clock->Now(), 1);
}

}  // namespace ferry::rdma
