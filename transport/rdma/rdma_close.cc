// RdmaTransport: notices between peers (READY, DISCONNECT) and closing
// connections -- ours (an evicted endpoint, ClosePeer) and the ones the
// peer closed. A close never fails a slice: what waited moves to a new
// endpoint, what was posted drains (flushed at the drain deadline).
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/rdma_transport.h"

namespace ferry::rdma {
namespace {

// Beyond the peer's drain deadline, how long a side that closed a
// connection keeps its QPs.
constexpr int64_t kLingerMarginNs = 100'000'000;

using Kind = RailConnector::Action::Kind;

}  // namespace

RdmaTransport::Job RdmaTransport::NoticeJob(Peer* peer, const Endpoint& ep,
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

void RdmaTransport::RunNotice(const Job& job) {
  std::string rpc;
  const int64_t now = clock_->NowNanos();
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
  n->set_initiator_segment(env_.local_segment);
  n->set_initiator_incarnation(incarnation_);
  n->set_initiator_nic(nics_[job.local]->name());
  n->set_target_nic(job.remote_nic);
  n->set_epoch(job.epoch);
  n->set_target_incarnation(job.incarnation);
  auto r = env_.peer_channel->Call(rpc, "rdma", msg.SerializeAsString());
  if (!r.ok() && (r.status().code() == absl::StatusCode::kDeadlineExceeded ||
                  r.status().code() == absl::StatusCode::kUnavailable)) {
    MutexLock lock(&job.peer->mu);
    job.peer->unresponsive_until_ns =
        clock_->NowNanos() + absl::ToInt64Nanoseconds(options_.connect_timeout);
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

RailNoticeReply RdmaTransport::OnNotice(const std::string& from,
                                        const RailNotice& n) {
  RailNoticeReply reply;
  std::shared_ptr<Peer> peer = peers_.Find(from);
  const int local = NicIndex(n.target_nic());
  if (peer == nullptr || local < 0) return reply;
  Later later;
  {
    MutexLock lock(&peer->mu);
    // Only about a connection of the sender's current run with this run.
    if (peer->incarnation != n.initiator_incarnation() ||
        n.target_incarnation() != incarnation_) {
      return reply;
    }
    peer->unresponsive_until_ns = 0;
    Peer::Rail* rail = peer->FindRail(local, n.initiator_nic());
    if (rail == nullptr) return reply;
    Actions acts;
    if (n.kind() == RailNotice::READY) {
      rail->conn.OnReady(n.epoch(), &acts);
    } else {
      rail->conn.OnDisconnect(n.epoch(), &acts);
    }
    ApplyLocked(peer.get(), rail, acts, nullptr, nullptr, &later);
  }
  // Posting (READY) and draining (DISCONNECT) happen on the control
  // threads: the answer goes back at once. If the endpoint can be taken
  // out of service right away (its lock is free: no post in progress) and
  // has nothing posted, the peer may drop its QPs at once.
  for (const Job& j : later.jobs) {
    if (j.kind != Job::Kind::kClose) continue;
    FERRY_LOG(kInfo, "rdma", "rail to '", from, "' on ",
              nics_[j.ep->local_nic()]->name(), " -> ", j.ep->remote_nic(),
              " closed by the peer (epoch ", n.epoch(), ")");
    if (!j.ep->mu.TryLock()) continue;
    const Endpoint::State st = j.ep->state();
    if (st == Endpoint::State::kConnected ||
        st == Endpoint::State::kConnecting) {
      j.ep->SetStateLocked(Endpoint::State::kClosing);
    }
    reply.set_drained(j.ep->PostedLocked() == 0);
    j.ep->mu.Unlock();
  }
  RunLater(&later, /*inline_ok=*/false);
  return reply;
}

bool RdmaTransport::Close(const EndpointPtr& ep, bool evicted) {
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
            clock_->NowNanos() +
            absl::ToInt64Nanoseconds(options_.connect_timeout / 2) +
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
    evictions_.fetch_add(1, std::memory_order_relaxed);
    FERRY_LOG_EVERY(kInfo, "rdma", absl::Seconds(1), "idle endpoint to '",
                    ep->peer()->name(), "' evicted (rdma.max_endpoints ",
                    options_.rdma.max_endpoints, ")");
  }
  store_.Drain(ep);
  RunLater(&later, /*inline_ok=*/false);
  return true;
}

void RdmaTransport::CloseForPeer(const EndpointPtr& ep) {
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
          clock_->NowNanos() +
          absl::ToInt64Nanoseconds(options_.connect_timeout / 2);
    }
    waiting.Append(&ep->waiting);
  }
  store_.Drain(ep);
  ep->Unload(waiting);
  // They never ran: a new endpoint takes them, no try charged.
  RouteQueue(&waiting, clock_->Now(), 1);
  DropIfDrained(ep);
}

}  // namespace ferry::rdma
