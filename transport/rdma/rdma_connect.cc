// RdmaTransport: connection set-up and tear-down, off the data path.
//
// A new endpoint is connected by a connector thread: it creates the QPs,
// sends a ConnectRequest over the peer service and, when accepted,
// connects them, posts the slices that waited, and tells the target its
// QPs can receive (READY). The target answers on a gRPC thread
// (OnConnect): it creates and connects its QPs and installs them as its own
// endpoint for the rail -- so one endpoint serves both directions -- or
// adopts them into an endpoint it is connecting itself (simultaneous
// connect; the lower segment name wins the tie-break). It sends on them
// once READY came. Endpoints evicted from the store are closed with the
// peer, which drains its own use of them first. A housekeeper enforces
// deadlines.
#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "transport/rdma/rdma_transport.h"

namespace ferry::rdma {
namespace {

constexpr int kMaxQpsPerRequest = 16;
constexpr size_t kMaxNicName = 64;
// Rails a peer may have: every pair of its NICs and ours (a request naming
// ever new NICs cannot grow the table without bound).
constexpr size_t kMaxRailsPerPeer = 64 * 64;
// Reconnect backoff per peer: 50 ms doubling up to 1.6 s.
constexpr int64_t kMinBackoffNs = 50'000'000;
constexpr int kMaxBackoffShift = 5;
constexpr absl::Duration kHousekeepingInterval = absl::Milliseconds(50);

void DestroyQps(std::vector<QueuePair>* qps) {
  for (QueuePair& q : *qps) {
    if (q.qp != nullptr) ibv_destroy_qp(q.qp);
  }
  qps->clear();
}

}  // namespace

void RdmaTransport::QueueJob(Job job) {
  MutexLock lock(&jobs_mu_);
  jobs_.push_back(std::move(job));
  jobs_cv_.Signal();
}

void RdmaTransport::ConnectorLoop() {
  while (true) {
    Job job;
    {
      MutexLock lock(&jobs_mu_);
      while (!stopping_.load() && jobs_.empty()) jobs_cv_.Wait(&jobs_mu_);
      if (stopping_.load()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    if (job.kind == Job::Kind::kConnect) {
      RunConnect(job.ep);
    } else {
      RunDisconnect(job.ep);
    }
  }
}

absl::Status RdmaTransport::CreateQps(Nic* nic, int n,
                                      std::vector<QueuePair>* qps) {
  for (int k = 0; k < n; ++k) {
    uint32_t max_inline = 0;
    auto qp = CreateQp(nic, &max_inline);
    if (!qp.ok()) {
      DestroyQps(qps);
      return qp.status();
    }
    QueuePair& q = qps->emplace_back();
    q.qp = *qp;
    q.max_inline = max_inline;
  }
  return absl::OkStatus();
}

bool RdmaTransport::Activate(const std::shared_ptr<Endpoint>& ep,
                             std::vector<QueuePair>* qps, uint64_t epoch,
                             bool confirmed) {
  Endpoint::PostResult post;
  {
    MutexLock lock(&ep->mu);
    if (ep->state() != Endpoint::State::kConnecting) return false;
    ep->qps = std::move(*qps);
    qps->clear();
    ep->epoch = epoch;
    ep->adopt_deadline_ns = 0;
    ep->confirmed.store(confirmed, std::memory_order_release);
    if (!confirmed) {
      ep->confirm_deadline_ns =
          absl::GetCurrentTimeNanos() +
          absl::ToInt64Nanoseconds(options_.connect_timeout);
    }
    {
      // Registered for completions before anything is posted.
      Poller* p = pollers_[ep->local_nic()].get();
      MutexLock map_lock(&p->map_mu);
      for (size_t k = 0; k < ep->qps.size(); ++k) {
        p->by_qpn[ep->qps[k].qp->qp_num] = QpRef{ep, static_cast<int>(k)};
      }
    }
    ep->SetStateLocked(Endpoint::State::kConnected);
    post = ep->PostLocked();  // Nothing while unconfirmed.
  }
  AfterPost(ep, post);
  return true;
}

void RdmaTransport::Tell(const Endpoint& ep, RailNotice::Kind kind,
                         uint64_t epoch) {
  RdmaMessage msg;
  RailNotice* n = msg.mutable_notice();
  n->set_kind(kind);
  n->set_initiator_segment(env_.local_segment);
  n->set_initiator_incarnation(incarnation_);
  n->set_initiator_nic(ep.nic()->name());
  n->set_target_nic(ep.remote_nic());
  n->set_epoch(epoch);
  std::string rpc;
  {
    MutexLock lock(&ep.peer()->mu);
    rpc = ep.peer()->rpc_address;
  }
  // The reply carries nothing; a peer that cannot be reached has nothing
  // to act on either (it restarted, or its QPs will fail on their own).
  (void)env_.peer_channel->Call(rpc, "rdma", msg.SerializeAsString());
}

void RdmaTransport::RunConnect(const std::shared_ptr<Endpoint>& ep) {
  {
    MutexLock lock(&ep->mu);
    // Adopted (the peer's request came first), being adopted, or failed.
    if (ep->state() != Endpoint::State::kConnecting || ep->accepting) return;
  }
  Peer* peer = ep->peer();
  std::string rpc;
  {
    MutexLock lock(&peer->mu);
    rpc = peer->rpc_address;
  }
  Nic* nic = ep->nic();
  std::vector<QueuePair> qps;
  absl::Status s = CreateQps(nic, options_.rdma.qps_per_endpoint, &qps);
  ConnectReply reply;
  if (s.ok()) {
    RdmaMessage msg;
    ConnectRequest* req = msg.mutable_connect();
    req->set_initiator_segment(env_.local_segment);
    req->set_initiator_incarnation(incarnation_);
    req->set_target_incarnation(ep->peer_incarnation());
    req->set_initiator_nic(nic->name());
    req->set_target_nic(ep->remote_nic());
    // The epoch known when the endpoint was made, not the rail's current
    // one: if the peer's connect was adopted meanwhile, this request is
    // stale and must be answered so (SUPERSEDED), not replace it.
    req->set_rail_epoch(ep->known_epoch());
    for (QueuePair& q : qps) DescribeQp(q.qp, nic, req->add_initiator_qps());
    connects_started_.fetch_add(1, std::memory_order_relaxed);
    auto bytes = env_.peer_channel->Call(rpc, "rdma", msg.SerializeAsString());
    s = bytes.status();
    if (s.ok() && !reply.ParseFromString(*bytes)) {
      s = absl::DataLossError("malformed RDMA connect reply");
    }
  }
  std::vector<std::shared_ptr<Endpoint>> restarted;
  if (s.ok()) {
    switch (reply.result()) {
      case ConnectReply::ACCEPTED:
        if (reply.target_qps_size() != static_cast<int>(qps.size())) {
          s = absl::DataLossError(absl::StrCat("RDMA connect reply has ",
                                               reply.target_qps_size(),
                                               " QPs for our ", qps.size()));
        }
        for (size_t k = 0; s.ok() && k < qps.size(); ++k) {
          s = ConnectQp(qps[k].qp, nic, reply.target_qps(k), timers_);
        }
        if (s.ok()) {
          {
            MutexLock lock(&peer->mu);
            Peer::Rail& r = peer->GetRail(ep->local_nic(), ep->remote_nic());
            r.epoch = std::max(r.epoch, reply.epoch());
            peer->connect_failures = 0;
            peer->retry_after_ns = 0;
          }
          if (Activate(ep, &qps, reply.epoch(), /*confirmed=*/true)) {
            Tell(*ep, RailNotice::READY, reply.epoch());
            return;
          }
          // Failed or closed meanwhile: the connection the target just
          // made is nobody's; close it there rather than leave it dead.
          DestroyQps(&qps);
          Tell(*ep, RailNotice::DISCONNECT, reply.epoch());
          return;
        }
        break;
      case ConnectReply::LOST_TIE_BREAK: {
        // The peer is connecting this rail too, and its request wins: it
        // brings the QPs. If it does not come in time, the endpoint fails.
        DestroyQps(&qps);
        MutexLock lock(&ep->mu);
        if (ep->state() == Endpoint::State::kConnecting) {
          ep->adopt_deadline_ns =
              absl::GetCurrentTimeNanos() +
              absl::ToInt64Nanoseconds(options_.connect_timeout);
        }
        return;
      }
      case ConnectReply::SUPERSEDED:
        // The rail has a newer connection than we knew of: ours is
        // adopted already, or we lost ours and reconnect knowing the
        // newer epoch.
        DestroyQps(&qps);
        {
          MutexLock lock(&peer->mu);
          Peer::Rail& r = peer->GetRail(ep->local_nic(), ep->remote_nic());
          r.epoch = std::max(r.epoch, reply.epoch());
        }
        if (ep->state() == Endpoint::State::kConnecting) {
          FailEndpoint(ep, absl::UnavailableError("RDMA connect superseded"),
                       false);
        }
        return;
      case ConnectReply::STALE_INCARNATION: {
        s = absl::FailedPreconditionError(absl::StrCat(
            "segment '", peer->name(),
            "' restarted (new incarnation): RefreshSegment and resubmit"));
        MutexLock lock(&peer->mu);
        if (reply.target_incarnation() != 0) {
          restarted = peer->Restarted(reply.target_incarnation());
        }
        break;
      }
      default:
        s = absl::DataLossError("RDMA connect reply with an unknown result");
    }
  }
  DestroyQps(&qps);
  connect_failures_.fetch_add(1, std::memory_order_relaxed);
  {
    // Back off: while it lasts, slices for this peer fail fast instead of
    // each starting a handshake (no reconnect storm).
    MutexLock lock(&peer->mu);
    const int shift = std::min<int>(static_cast<int>(peer->connect_failures),
                                    kMaxBackoffShift);
    ++peer->connect_failures;
    peer->retry_after_ns =
        absl::GetCurrentTimeNanos() + (kMinBackoffNs << shift);
    peer->last_error = s;
  }
  for (auto& old : restarted) {
    if (old != ep) FailEndpoint(old, s, /*flush=*/true);
  }
  FailEndpoint(
      ep,
      absl::Status(s.code(),
                   absl::StrCat("RDMA handshake with '", peer->name(), "' (",
                                ep->remote_nic(), "): ", s.message())),
      false);
}

absl::StatusOr<std::string> RdmaTransport::OnExchange(
    const std::string& from, const std::string& payload) {
  RdmaMessage msg;
  if (!msg.ParseFromString(payload)) {
    return absl::InvalidArgumentError("malformed RDMA message");
  }
  if (stopping_.load()) {
    return absl::UnavailableError("RDMA transport is shutting down");
  }
  switch (msg.kind_case()) {
    case RdmaMessage::kConnect: {
      auto reply = OnConnect(from, msg.connect());
      if (!reply.ok()) return reply.status();
      return reply->SerializeAsString();
    }
    case RdmaMessage::kNotice: {
      std::shared_ptr<Peer> peer;
      // Notices about anything but the rail's current endpoint, from the
      // peer's current run, are stale: nothing to do.
      if (auto ep = NoticeTarget(from, msg.notice(), &peer)) {
        if (msg.notice().kind() == RailNotice::READY) {
          OnReady(ep, msg.notice());
        } else {
          OnDisconnect(peer.get(), ep, msg.notice());
        }
      }
      return RailNoticeReply().SerializeAsString();
    }
    default:
      return absl::InvalidArgumentError("RDMA message of no known kind");
  }
}

absl::StatusOr<ConnectReply> RdmaTransport::OnConnect(
    const std::string& from, const ConnectRequest& req) {
  // Everything here comes from the wire: check it before use.
  if (req.initiator_segment() != from) {
    return absl::InvalidArgumentError(
        "RDMA connect request names another segment than its sender");
  }
  const int n = req.initiator_qps_size();
  if (n < 1 || n > kMaxQpsPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA connect request with ", n, " QPs (1..", kMaxQpsPerRequest, ")"));
  }
  if (req.initiator_nic().empty() || req.initiator_nic().size() > kMaxNicName) {
    return absl::InvalidArgumentError("RDMA connect request: bad NIC name");
  }
  const int local = NicIndex(req.target_nic());
  if (local < 0) {
    return absl::NotFoundError(
        absl::StrCat("no RDMA NIC named '", req.target_nic(), "'"));
  }
  ConnectReply reply;
  reply.set_target_incarnation(incarnation_);
  if (req.target_incarnation() != 0 &&
      req.target_incarnation() != incarnation_) {
    reply.set_result(ConnectReply::STALE_INCARNATION);
    return reply;
  }
  Nic* nic = nics_[local].get();
  // A connect from this engine to itself: the initiating endpoint holds the
  // rail, so the accepting end is a separate endpoint outside it (adopting
  // would connect a QP to itself).
  const bool self = from == env_.local_segment;
  std::shared_ptr<Peer> peer = PeerNamed(from);
  std::vector<std::shared_ptr<Endpoint>> retired;
  std::shared_ptr<Endpoint> ep;
  bool fresh = false;
  uint64_t epoch = 0;
  {
    // Decide and reserve under the peer's lock; the QPs are made without
    // it (on softrnic connecting one may take a dial of up to a second).
    MutexLock lock(&peer->mu);
    if (peer->incarnation != req.initiator_incarnation()) {
      if (peer->IsDead(req.initiator_incarnation())) {
        return absl::FailedPreconditionError(
            "RDMA connect request from an earlier run of its segment");
      }
      retired = peer->Restarted(req.initiator_incarnation());
    }
    Peer::Rail* rail = peer->FindRail(local, req.initiator_nic());
    if (rail == nullptr) {
      if (peer->rails.size() >= kMaxRailsPerPeer) {
        return absl::ResourceExhaustedError("too many RDMA rails to one peer");
      }
      rail = &peer->GetRail(local, req.initiator_nic());
    }
    std::shared_ptr<Endpoint> cur = self ? nullptr : rail->ep;
    const Endpoint::State st =
        cur != nullptr ? cur->state() : Endpoint::State::kFailed;
    if (st == Endpoint::State::kConnecting) {
      {
        MutexLock ep_lock(&cur->mu);
        if (cur->accepting) {
          return absl::UnavailableError(
              "a connect for this RDMA rail is being accepted");
        }
      }
      // Both sides are connecting this rail: the request of the segment
      // whose name sorts first wins, and the other side adopts its QPs.
      if (env_.local_segment < from) {
        reply.set_result(ConnectReply::LOST_TIE_BREAK);
        reply.set_epoch(rail->epoch);
        return reply;
      }
      ep = cur;
    } else if (st == Endpoint::State::kConnected) {
      // A request sent before the initiator learned of the rail's current
      // connection raced with it: it is stale.
      if (req.rail_epoch() < rail->epoch) {
        reply.set_result(ConnectReply::SUPERSEDED);
        reply.set_epoch(rail->epoch);
        return reply;
      }
      // The initiator knew the current connection and replaces it (it
      // lost its side of it).
      retired.push_back(cur);
      rail->ep = nullptr;
    }
    epoch = std::max(rail->epoch, req.rail_epoch()) + 1;
    if (!self) rail->epoch = epoch;
    if (ep == nullptr) {
      ep = std::make_shared<Endpoint>(next_endpoint_id_.fetch_add(1), peer,
                                      peer->incarnation, local, nic,
                                      req.initiator_nic(), epoch);
      if (!self) rail->ep = ep;
      fresh = true;
    }
    MutexLock ep_lock(&ep->mu);
    ep->accepting = true;
  }
  for (auto& old : retired) {
    FailEndpoint(old, absl::UnavailableError("RDMA connection replaced"),
                 /*flush=*/true);
  }
  if (fresh) StoreInsert(ep);
  std::vector<QueuePair> qps;
  absl::Status s = CreateQps(nic, n, &qps);
  for (int k = 0; s.ok() && k < n; ++k) {
    s = ConnectQp(qps[k].qp, nic, req.initiator_qps(k), timers_);
  }
  {
    MutexLock lock(&ep->mu);
    ep->accepting = false;
  }
  if (!s.ok()) {
    DestroyQps(&qps);
    // Slices routed to the new endpoint meanwhile go elsewhere; an endpoint
    // we meant to adopt into waits out its own tie-break deadline.
    if (fresh) FailEndpoint(ep, s, false);
    return s;
  }
  for (QueuePair& q : qps) DescribeQp(q.qp, nic, reply.add_target_qps());
  ep->used.store(true, std::memory_order_relaxed);
  // Sending waits for the initiator's READY (its QPs reach RTR only when
  // it has our reply); a connection to ourselves has no such race.
  if (!Activate(ep, &qps, epoch, /*confirmed=*/self)) {
    DestroyQps(&qps);
    return absl::UnavailableError("RDMA endpoint failed during the connect");
  }
  if (!fresh) connect_races_.fetch_add(1, std::memory_order_relaxed);
  connects_accepted_.fetch_add(1, std::memory_order_relaxed);
  reply.set_result(ConnectReply::ACCEPTED);
  reply.set_epoch(epoch);
  return reply;
}

std::shared_ptr<Endpoint> RdmaTransport::NoticeTarget(
    const std::string& from, const RailNotice& n, std::shared_ptr<Peer>* peer) {
  *peer = FindPeer(from);
  const int local = NicIndex(n.target_nic());
  if (*peer == nullptr || local < 0) return nullptr;
  MutexLock lock(&(*peer)->mu);
  if ((*peer)->incarnation != n.initiator_incarnation()) return nullptr;
  Peer::Rail* rail = (*peer)->FindRail(local, n.initiator_nic());
  return rail != nullptr ? rail->ep : nullptr;
}

void RdmaTransport::OnReady(const std::shared_ptr<Endpoint>& ep,
                            const RailNotice& n) {
  Endpoint::PostResult post = Endpoint::PostResult::kDone;
  {
    MutexLock lock(&ep->mu);
    if (ep->epoch != n.epoch() || ep->confirmed.load()) return;
    ep->confirmed.store(true, std::memory_order_release);
    post = ep->PostLocked();
  }
  AfterPost(ep, post);
}

void RdmaTransport::Close(const std::shared_ptr<Endpoint>& ep) {
  Peer* peer = ep->peer();
  bool closing = false;
  {
    // Both locks, so that no route can take the endpoint between the
    // check that it is idle and its leaving the rail.
    MutexLock peer_lock(&peer->mu);
    MutexLock ep_lock(&ep->mu);
    if (ep->Idle()) {
      ep->SetStateLocked(Endpoint::State::kClosing);
      Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
      if (rail != nullptr && rail->ep == ep) rail->ep = nullptr;
      closing = true;
    }
  }
  if (!closing) {
    // It took work (or is being set up) since the store chose it: keep it,
    // past the store's bound rather than evicting another for it.
    const Endpoint::State st = ep->state();
    if (st == Endpoint::State::kConnected ||
        st == Endpoint::State::kConnecting) {
      MutexLock lock(&store_mu_);
      store_.Insert(ep->id(), ep, nullptr, /*allow_evict=*/false);
    }
    return;
  }
  evictions_.fetch_add(1, std::memory_order_relaxed);
  QueueJob({Job::Kind::kDisconnect, ep});
}

void RdmaTransport::RunDisconnect(const std::shared_ptr<Endpoint>& ep) {
  uint64_t epoch;
  {
    MutexLock lock(&ep->mu);
    epoch = ep->epoch;
  }
  // Answered once the peer stopped using the QPs (bounded by the RPC
  // timeout); a peer that cannot be reached is not using them either.
  Tell(*ep, RailNotice::DISCONNECT, epoch);
  DropIfDrained(ep);
}

void RdmaTransport::OnDisconnect(Peer* peer,
                                 const std::shared_ptr<Endpoint>& ep,
                                 const RailNotice& n) {
  SliceQueue waiting;
  {
    MutexLock peer_lock(&peer->mu);
    MutexLock ep_lock(&ep->mu);
    // Only the connection the peer means: a newer one, or one still
    // connecting, stays.
    if (ep->epoch != n.epoch() || ep->state() != Endpoint::State::kConnected) {
      return;
    }
    ep->SetStateLocked(Endpoint::State::kClosing);
    waiting.Append(&ep->waiting);
    Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
    if (rail != nullptr && rail->ep == ep) rail->ep = nullptr;
  }
  {
    MutexLock lock(&store_mu_);
    const auto* cur = store_.Peek(ep->id());
    if (cur != nullptr && *cur == ep) store_.Erase(ep->id());
  }
  ep->Unload(waiting);
  // They never ran: a new endpoint takes them, no try charged.
  RouteQueue(&waiting, absl::Now(), 1);
  // Our own posted work finishes before the peer destroys its QPs.
  const absl::Time deadline = absl::Now() + options_.connect_timeout / 2;
  while (absl::Now() < deadline) {
    {
      MutexLock lock(&ep->mu);
      if (ep->PostedLocked() == 0) break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  {
    // Still posted: flush it now rather than wait for retry timeouts.
    MutexLock lock(&ep->mu);
    for (QueuePair& q : ep->qps) {
      if (q.qp != nullptr && q.count() > 0) FlushQp(q.qp);
    }
  }
  DropIfDrained(ep);
}

void RdmaTransport::HousekeeperLoop() {
  while (!stop_housekeeper_.WaitForNotificationWithTimeout(
      kHousekeepingInterval)) {
    Housekeep(absl::GetCurrentTimeNanos());
  }
}

void RdmaTransport::Housekeep(int64_t now_ns) {
  std::vector<std::shared_ptr<Endpoint>> eps;
  {
    MutexLock lock(&store_mu_);
    eps.reserve(store_.size());
    store_.ForEach([&](const uint64_t&, const std::shared_ptr<Endpoint>& ep) {
      eps.push_back(ep);
    });
  }
  const absl::Time now = absl::FromUnixNanos(now_ns);
  for (auto& ep : eps) {
    SliceQueue expired;
    bool adopt_timeout = false;
    Endpoint::PostResult post = Endpoint::PostResult::kDone;
    {
      MutexLock lock(&ep->mu);
      adopt_timeout = ep->state() == Endpoint::State::kConnecting &&
                      !ep->accepting && ep->adopt_deadline_ns != 0 &&
                      now_ns > ep->adopt_deadline_ns;
      // No READY in time (lost, or the initiator gave up): send anyway; RC
      // retransmission covers a peer that was slow to connect.
      if (ep->state() == Endpoint::State::kConnected && !ep->confirmed.load() &&
          now_ns > ep->confirm_deadline_ns) {
        ep->confirmed.store(true, std::memory_order_release);
        post = ep->PostLocked();
      }
      // Waiting slices past their deadline fail here; posted ones by
      // flushing their QP (the NIC might still be moving their bytes, so
      // they complete only when the flush says the NIC is done).
      SliceQueue keep;
      while (Slice* s = ep->waiting.pop_front()) {
        if (s->deadline <= now) {
          expired.push_back(s);
        } else {
          keep.push_back(s);
        }
      }
      ep->waiting.Append(&keep);
      for (QueuePair& q : ep->qps) {
        if (q.qp == nullptr || q.count() == 0) continue;
        const Slice* oldest = q.posted[q.head % kMaxOutstanding];
        if (oldest != nullptr && oldest->deadline <= now) FlushQp(q.qp);
      }
    }
    AfterPost(ep, post);
    ep->Unload(expired);
    while (Slice* s = expired.pop_front()) {
      s->Complete(absl::DeadlineExceededError(
          "RDMA transfer did not complete before its deadline"));
    }
    if (adopt_timeout) {
      FailEndpoint(ep,
                   absl::UnavailableError(absl::StrCat(
                       "RDMA peer '", ep->peer()->name(),
                       "' won the connect tie-break but did not connect")),
                   false);
    }
  }
}

}  // namespace ferry::rdma
