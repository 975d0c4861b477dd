// RailLifecycle: notices to peers (READY, DISCONNECT) and the ends of
// connections -- ours (an evicted endpoint, ClosePeer), the ones the peer
// closed, and failed ones. A close never fails a slice: what waited moves
// to a new endpoint, what was posted drains (flushed at the drain
// deadline). A failure hands the endpoint's slices to RailHost::Retry.
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/rdma/rail_lifecycle.h"

namespace ferry::rdma {
namespace {

// Beyond the peer's drain deadline, how long a side that closed a
// connection keeps its QPs.
constexpr int64_t kLingerMarginNs = 100'000'000;

using Kind = RailConnector::Action::Kind;

}  // namespace

RailLifecycle::Job RailLifecycle::NoticeJob(Peer* peer, const Endpoint& ep,
                                            RailNotice::Kind kind,
                                            uint64_t epoch) {
  Job j;
  j.kind = Job::Kind::kNotice;
  j.peer = peer->shared_from_this();
  j.notice = kind;
  j.epoch = epoch;
  j.local = ep.local_nic();
  j.remote_nic = ep.remote_nic();
  j.incarnation = peer->incarnation;
  return j;
}

void RailLifecycle::RunNotice(const Job& job) {
  std::string rpc;
  const int64_t now = ctx_->clock->NowNanos();
  {
    MutexLock lock(&job.peer->mu);
    // Best effort: a peer that did not answer the last one is not waited
    // for again for a while, and one that restarted has no such
    // connection any more.
    if (now < job.peer->unresponsive_until_ns ||
        job.peer->incarnation != job.incarnation) {
      return;
    }
    rpc = job.peer->rpc_address;
  }
  if (rpc.empty()) return;  // It never told us where it listens.
  RdmaMessage msg;
  RailNotice* n = msg.mutable_notice();
  n->set_kind(job.notice);
  n->set_initiator_segment(ctx_->env.local_segment);
  n->set_initiator_incarnation(ctx_->incarnation);
  n->set_initiator_nic(ctx_->nics[job.local]->name());
  n->set_target_nic(job.remote_nic);
  n->set_epoch(job.epoch);
  n->set_target_incarnation(job.incarnation);
  auto r = ctx_->env.peer_channel->Call(rpc, "rdma", msg.SerializeAsString());
  if (!r.ok() && (r.status().code() == absl::StatusCode::kDeadlineExceeded ||
                  r.status().code() == absl::StatusCode::kUnavailable)) {
    MutexLock lock(&job.peer->mu);
    job.peer->unresponsive_until_ns =
        ctx_->clock->NowNanos() +
        absl::ToInt64Nanoseconds(ctx_->options.connect_timeout);
    return;
  }
  RailNoticeReply reply;
  if (r.ok() && job.ep != nullptr && reply.ParseFromString(*r) &&
      reply.drained()) {
    // The peer used nothing of the connection any more: our QPs may go now
    // rather than after the linger.
    {
      MutexLock lock(&job.ep->mu);
      job.ep->drop_after_ns = 0;
    }
    DropIfDrained(job.ep);
  }
}

bool RailLifecycle::Close(const EndpointPtr& ep, bool evicted) {
  Peer* peer = ep->peer();
  Later later;
  bool closing = false;
  {
    // Both locks, so that no route can take the endpoint between the
    // check that it is idle and its leaving the rail.
    MutexLock peer_lock(&peer->mu);
    MutexLock ep_lock(&ep->mu);
    if (ep->Idle()) {
      if (ep->off_rail()) {
        closing = true;
        later.jobs.push_back(
            NoticeJob(peer, *ep, RailNotice::DISCONNECT, ep->epoch));
        later.jobs.back().ep = ep;
      } else {
        Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
        Actions acts;
        if (rail != nullptr && rail->ep == ep &&
            rail->conn.Close(ep->id(), &acts)) {
          rail->ep = nullptr;
          closing = true;
          for (const auto& a : acts) {
            if (a.kind == Kind::kTellDisconnect) {
              later.jobs.push_back(
                  NoticeJob(peer, *ep, RailNotice::DISCONNECT, a.epoch));
              later.jobs.back().ep = ep;
            }
          }
        }
      }
      if (closing) {
        ep->SetStateLocked(Endpoint::State::kClosing);
        // The peer drains its own use of the connection (one-sided
        // traffic is invisible here) before our QPs go.
        ep->drop_after_ns =
            ctx_->clock->NowNanos() +
            absl::ToInt64Nanoseconds(ctx_->options.connect_timeout / 2) +
            kLingerMarginNs;
      }
    }
  }
  if (!closing) {
    // It took work (or is being set up) since it was chosen: keep it,
    // past the store's bound rather than evicting another for it.
    const Endpoint::State st = ep->state();
    if (st == Endpoint::State::kConnected ||
        st == Endpoint::State::kConnecting) {
      store_.Keep(ep);
    }
    return false;
  }
  if (evicted) {
    ctx_->counters.evictions.fetch_add(1, std::memory_order_relaxed);
    FERRY_LOG_EVERY(kInfo, "rdma", absl::Seconds(1), "idle endpoint to '",
                    ep->peer()->name(), "' evicted (rdma.max_endpoints ",
                    ctx_->options.rdma.max_endpoints, ")");
  }
  store_.Drain(ep);
  RunLater(&later, /*inline_ok=*/false);
  return true;
}

void RailLifecycle::CloseForPeer(const EndpointPtr& ep) {
  SliceQueue waiting;
  {
    MutexLock lock(&ep->mu);
    const Endpoint::State st = ep->state();
    if (st == Endpoint::State::kConnected ||
        st == Endpoint::State::kConnecting) {
      ep->SetStateLocked(Endpoint::State::kClosing);
    }
    if (ep->state() == Endpoint::State::kClosing &&
        ep->drain_deadline_ns == 0) {
      // Our own posted work finishes (or is flushed at this deadline)
      // before the QPs go; the peer keeps its QPs that long.
      ep->drain_deadline_ns =
          ctx_->clock->NowNanos() +
          absl::ToInt64Nanoseconds(ctx_->options.connect_timeout / 2);
    }
    waiting.Append(&ep->waiting);
  }
  store_.Drain(ep);
  ep->Unload(waiting);
  // They never ran: a new endpoint takes them, no try charged.
  host_->Reroute(&waiting);
  DropIfDrained(ep);
}

void RailLifecycle::FailEndpoint(const std::shared_ptr<Endpoint>& ep,
                                 const absl::Status& why, bool flush,
                                 bool tell_peer) {
  FERRY_LOG_EVERY(kWarn, "rdma", absl::Seconds(1), "endpoint to '",
                  ep->peer()->name(), "' on ",
                  ctx_->nics[ep->local_nic()]->name(), " -> ", ep->remote_nic(),
                  " disconnected: ", why.message());
  // Off its rail first (its connector told), so that slices routed from
  // now on get a fresh endpoint or another rail.
  Later later;
  if (!ep->off_rail()) {
    Peer* peer = ep->peer();
    MutexLock lock(&peer->mu);
    Peer::Rail* r = peer->FindRail(ep->local_nic(), ep->remote_nic());
    if (r != nullptr && r->ep == ep) {
      Actions acts;
      r->conn.Failed(ep->id(), &acts);
      ApplyLocked(peer, r, acts, nullptr, nullptr, &later);
    }
  }
  if (!tell_peer) later.jobs.clear();  // Only a DISCONNECT to a dead peer.
  store_.Drain(ep);
  SliceQueue waiting;
  {
    MutexLock lock(&ep->mu);
    ep->SetStateLocked(Endpoint::State::kFailed);
    waiting.Append(&ep->waiting);
    // Flushing completes every posted WR at once (with a flush error),
    // instead of after the retry timeout.
    if (flush) {
      for (QueuePair& q : ep->qps) {
        if (q.qp != nullptr && q.count() > 0) FlushQp(q.qp);
      }
    }
  }
  ep->Unload(waiting);
  while (Slice* s = waiting.pop_front()) host_->Retry(s, why);
  RunLater(&later, /*inline_ok=*/true);  // A DISCONNECT notice at most.
  DropIfDrained(ep);
}

void RailLifecycle::DropIfDrained(const std::shared_ptr<Endpoint>& ep) {
  std::vector<uint32_t> qpns;
  {
    MutexLock lock(&ep->mu);
    const Endpoint::State st = ep->state();
    if ((st != Endpoint::State::kFailed && st != Endpoint::State::kClosing) ||
        ep->PostedLocked() != 0 ||
        ctx_->clock->NowNanos() < ep->drop_after_ns) {
      return;
    }
    for (const QueuePair& q : ep->qps) {
      if (q.qp != nullptr) qpns.push_back(q.qp->qp_num);
    }
  }
  if (!ep->off_rail()) {
    // Never dropped while still its rail's (the rail would keep it, and
    // its peer record, alive for good): a failure that did not go through
    // FailEndpoint is told to the connector here.
    Peer* peer = ep->peer();
    MutexLock lock(&peer->mu);
    Peer::Rail* r = peer->FindRail(ep->local_nic(), ep->remote_nic());
    if (r != nullptr && r->ep == ep) {
      Actions ignored;  // A DISCONNECT at most; FailEndpoint's job.
      r->conn.Failed(ep->id(), &ignored);
      r->ep = nullptr;
    }
  }
  // The QPs are destroyed with the endpoint's last reference.
  store_.Remove(*ep);
  completions_->Untrack(ep->local_nic(), qpns, *ep);
}

}  // namespace ferry::rdma
