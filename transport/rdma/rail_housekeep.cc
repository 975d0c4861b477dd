// RailLifecycle's housekeeping round (the control plane runs it every
// kHousekeepingInterval): it enforces the deadlines of slices an endpoint
// holds (waiting ones fail, posted ones are flushed), ticks the
// connectors' own deadlines, probes idle connections (keepalive), closes
// endpoints marked to close when idle and drops drained ones.
#include "absl/strings/str_cat.h"
#include "transport/rdma/rail_lifecycle.h"

namespace ferry::rdma {

absl::Duration RailLifecycle::Housekeep(int64_t now_ns) {
  const absl::Time now = absl::FromUnixNanos(now_ns);
  bool busy = false;
  const int64_t keepalive_ns =
      absl::ToInt64Nanoseconds(ctx_->options.rdma.keepalive_interval);
  // Deadlines of the slices an endpoint holds: waiting ones fail here,
  // posted ones by flushing their QP (the NIC might still be moving their
  // bytes, so they complete only when the flush says the NIC is done).
  // False if a post held the endpoint (see LockUnlessPosting).
  auto expire = [&](const EndpointPtr& ep, bool live) {
    SliceQueue expired;
    if (!ep->LockUnlessPosting(now_ns)) return false;
    {
      SliceQueue keep;
      while (Slice* s = ep->waiting.pop_front()) {
        if (s->deadline <= now) {
          expired.push_back(s);
        } else {
          keep.push_back(s);
        }
      }
      ep->waiting.Append(&keep);
      const bool drain_over =
          !live && ep->drain_deadline_ns != 0 && now_ns > ep->drain_deadline_ns;
      for (QueuePair& q : ep->qps) {
        if (q.qp == nullptr || q.count() == 0) continue;
        // The oldest slice, past any keepalive or fence (null entries):
        // one of those waiting for its acknowledgement must not hide the
        // slices behind it from their deadlines.
        const Slice* oldest = nullptr;
        for (uint64_t seq = q.head; seq < q.next && oldest == nullptr; ++seq) {
          oldest = q.posted[seq % kMaxOutstanding];
        }
        if (drain_over || (oldest != nullptr && oldest->deadline <= now)) {
          FlushQp(q.qp);
        }
      }
      if (drain_over) ep->drain_deadline_ns = 0;  // Flushed once.
      busy = busy || !ep->waiting.empty() || ep->PostedLocked() > 0 ||
             ep->drain_deadline_ns != 0;
      // Keepalive: probe a connection idle for keepalive_interval.
      if (live && keepalive_ns > 0 && ep->Idle() && ep->PostedLocked() == 0) {
        if (ep->active.exchange(false, std::memory_order_relaxed) ||
            ep->last_active_ns == 0) {
          ep->last_active_ns = now_ns;
        } else if (now_ns - ep->last_active_ns >= keepalive_ns) {
          ep->last_active_ns = now_ns;
          ep->PostKeepaliveLocked();
        }
      }
      ep->mu.Unlock();
    }
    ep->Unload(expired);
    while (Slice* s = expired.pop_front()) {
      s->Complete(absl::DeadlineExceededError(kPastDeadline));
    }
    return true;
  };
  for (const EndpointPtr& ep : store_.Live()) {
    // The connector's deadlines: the tie-break winner's request, READY.
    const bool timed = ep->state() == Endpoint::State::kConnecting ||
                       !ep->confirmed.load(std::memory_order_acquire);
    busy = busy || timed;
    if (timed && !ep->off_rail()) {
      Peer* peer = ep->peer();
      Later later;
      {
        MutexLock lock(&peer->mu);
        Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
        if (rail != nullptr && rail->ep == ep) {
          Actions acts;
          rail->conn.Tick(now_ns, &acts);
          ApplyLocked(peer, rail, acts, nullptr, nullptr, &later);
        }
      }
      RunLater(&later, /*inline_ok=*/true);
    }
    // Held by a post: slices are in flight, so the next round is soon.
    if (!expire(ep, /*live=*/true)) busy = true;
    if (ep->close_when_idle.load(std::memory_order_relaxed)) {
      if (ep->Idle()) {
        Close(ep, /*evicted=*/false);
      } else {
        busy = true;
      }
    }
  }
  for (const EndpointPtr& ep : store_.Draining()) {
    busy = true;
    if (expire(ep, /*live=*/false)) DropIfDrained(ep);
  }
  TrimStore();
  peers_.Trim();
  if (busy) return absl::ZeroDuration();
  return keepalive_ns > 0 ? absl::Nanoseconds(keepalive_ns) / 4
                          : absl::InfiniteDuration();
}

}  // namespace ferry::rdma
