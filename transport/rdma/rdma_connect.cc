// RdmaTransport: connection set-up and tear-down, off the data path.
//
// A new endpoint is connected by a connector thread: it creates the QPs,
// sends a ConnectRequest over the peer service and, when accepted,
// connects them and posts the slices that waited. The target answers on a
// gRPC thread (OnConnect): it creates and connects its QPs and installs
// them as its own endpoint for the rail -- so one endpoint serves both
// directions -- or adopts them into an endpoint it is connecting itself
// (simultaneous connect; the lower segment name wins the tie-break).
// Endpoints evicted from the store are closed with the peer, which drains
// its own use of them first. A housekeeper enforces deadlines.
#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "transport/rdma/rdma_transport.h"

namespace ferry::rdma {
namespace {

constexpr int kMaxQpsPerRequest = 16;
constexpr size_t kMaxNicName = 64;
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
                             std::vector<QueuePair>* qps, uint64_t epoch) {
  Endpoint::PostResult post;
  {
    MutexLock lock(&ep->mu);
    if (ep->state() != Endpoint::State::kConnecting) return false;
    ep->qps = std::move(*qps);
    qps->clear();
    ep->epoch = epoch;
    ep->adopt_deadline_ns = 0;
    {
      // Registered for completions before anything is posted.
      Poller* p = pollers_[ep->local_nic()].get();
      MutexLock map_lock(&p->map_mu);
      for (size_t k = 0; k < ep->qps.size(); ++k) {
        p->by_qpn[ep->qps[k].qp->qp_num] = QpRef{ep, static_cast<int>(k)};
      }
    }
    ep->SetStateLocked(Endpoint::State::kConnected);
    post = ep->PostLocked();
  }
  AfterPost(ep, post);
  return true;
}

void RdmaTransport::RunConnect(const std::shared_ptr<Endpoint>& ep) {
  {
    MutexLock lock(&ep->mu);
    ep->connecting_job = false;
    // Adopted (the peer's request came first) or failed meanwhile.
    if (ep->state() != Endpoint::State::kConnecting) return;
  }
  Peer* peer = ep->peer();
  std::string rpc;
  uint64_t rail_epoch = 0;
  {
    MutexLock lock(&peer->mu);
    rpc = peer->rpc_address;
    if (Peer::Rail* r = peer->FindRail(ep->local_nic(), ep->remote_nic())) {
      rail_epoch = r->epoch;
    }
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
    req->set_rail_epoch(rail_epoch);
    for (QueuePair& q : qps) DescribeQp(q.qp, nic, req->add_initiator_qps());
    connects_started_.fetch_add(1, std::memory_order_relaxed);
    auto bytes = env_.peer_client->Exchange(rpc, "rdma", env_.local_segment,
                                            msg.SerializeAsString());
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
          // Not connecting any more: adopted the peer's QPs meanwhile (a
          // request of theirs crossed ours), or failed.
          if (!Activate(ep, &qps, reply.epoch())) DestroyQps(&qps);
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
    case RdmaMessage::kDisconnect: {
      if (absl::Status s = OnDisconnect(from, msg.disconnect()); !s.ok()) {
        return s;
      }
      return DisconnectReply().SerializeAsString();
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
  std::shared_ptr<Peer> peer = PeerNamed(from);
  std::vector<std::shared_ptr<Endpoint>> retired;
  std::shared_ptr<Endpoint> ep;
  bool fresh = false;
  std::vector<QueuePair> qps;
  uint64_t epoch = 0;
  absl::Status s;
  {
    MutexLock lock(&peer->mu);
    if (peer->incarnation != req.initiator_incarnation()) {
      if (peer->IsDead(req.initiator_incarnation())) {
        return absl::FailedPreconditionError(
            "RDMA connect request from an earlier run of its segment");
      }
      retired = peer->Restarted(req.initiator_incarnation());
    }
    Peer::Rail& rail = peer->GetRail(local, req.initiator_nic());
    std::shared_ptr<Endpoint> cur = rail.ep;
    const Endpoint::State st =
        cur != nullptr ? cur->state() : Endpoint::State::kFailed;
    if (st == Endpoint::State::kConnecting) {
      // Both sides are connecting this rail: the request of the segment
      // whose name sorts first wins, and the other side adopts its QPs.
      if (env_.local_segment < from) {
        reply.set_result(ConnectReply::LOST_TIE_BREAK);
        reply.set_epoch(rail.epoch);
        return reply;
      }
      ep = cur;
    } else if (st == Endpoint::State::kConnected) {
      // A request that was sent before the initiator learned of the
      // rail's current connection raced with it: it is stale.
      if (req.rail_epoch() < rail.epoch) {
        reply.set_result(ConnectReply::SUPERSEDED);
        reply.set_epoch(rail.epoch);
        return reply;
      }
      // The initiator knew the current connection and replaces it (it
      // lost its side of it).
      retired.push_back(cur);
      rail.ep = nullptr;
    }
    s = CreateQps(nic, n, &qps);
    for (int k = 0; s.ok() && k < n; ++k) {
      s = ConnectQp(qps[k].qp, nic, req.initiator_qps(k), timers_);
    }
    if (s.ok()) {
      epoch = std::max(rail.epoch, req.rail_epoch()) + 1;
      rail.epoch = epoch;
      if (ep == nullptr) {
        ep = std::make_shared<Endpoint>(next_endpoint_id_.fetch_add(1), peer,
                                        peer->incarnation, local, nic,
                                        req.initiator_nic());
        rail.ep = ep;
        fresh = true;
      }
      for (QueuePair& q : qps) DescribeQp(q.qp, nic, reply.add_target_qps());
    }
  }
  for (auto& old : retired) {
    FailEndpoint(old, absl::UnavailableError("RDMA connection replaced"),
                 /*flush=*/true);
  }
  if (!s.ok()) {
    DestroyQps(&qps);
    return s;
  }
  if (fresh) {
    StoreInsert(ep);
  } else {
    connect_races_.fetch_add(1, std::memory_order_relaxed);
  }
  ep->used.store(true, std::memory_order_relaxed);
  if (!Activate(ep, &qps, epoch)) {
    // The endpoint we meant to adopt into failed meanwhile.
    DestroyQps(&qps);
    return absl::UnavailableError("RDMA endpoint failed during the connect");
  }
  connects_accepted_.fetch_add(1, std::memory_order_relaxed);
  reply.set_result(ConnectReply::ACCEPTED);
  reply.set_epoch(epoch);
  return reply;
}

void RdmaTransport::Close(const std::shared_ptr<Endpoint>& ep) {
  Peer* peer = ep->peer();
  Peer::Rail* rail = nullptr;
  {
    MutexLock lock(&peer->mu);
    rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
    if (rail != nullptr && rail->ep == ep) rail->ep = nullptr;
  }
  bool closing = false;
  {
    MutexLock lock(&ep->mu);
    if (ep->state() == Endpoint::State::kConnected &&
        ep->busy.load(std::memory_order_acquire) == 0) {
      ep->SetStateLocked(Endpoint::State::kClosing);
      closing = true;
    }
  }
  if (!closing) {
    // It took work after the store chose it: keep it.
    if (ep->state() != Endpoint::State::kConnected &&
        ep->state() != Endpoint::State::kConnecting) {
      return;
    }
    {
      MutexLock lock(&peer->mu);
      if (rail != nullptr && rail->ep == nullptr) rail->ep = ep;
    }
    MutexLock lock(&store_mu_);
    store_.Insert(ep->id(), ep);
    return;
  }
  evictions_.fetch_add(1, std::memory_order_relaxed);
  QueueJob({Job::Kind::kDisconnect, ep});
}

void RdmaTransport::RunDisconnect(const std::shared_ptr<Endpoint>& ep) {
  Peer* peer = ep->peer();
  RdmaMessage msg;
  DisconnectRequest* req = msg.mutable_disconnect();
  req->set_initiator_segment(env_.local_segment);
  req->set_initiator_incarnation(incarnation_);
  req->set_initiator_nic(ep->nic()->name());
  req->set_target_nic(ep->remote_nic());
  {
    MutexLock lock(&ep->mu);
    req->set_epoch(ep->epoch);
  }
  std::string rpc;
  {
    MutexLock lock(&peer->mu);
    rpc = peer->rpc_address;
  }
  // Answered once the peer stopped using the QPs (bounded by the RPC
  // timeout); a peer that cannot be reached is not using them either.
  (void)env_.peer_client->Exchange(rpc, "rdma", env_.local_segment,
                                   msg.SerializeAsString());
  DropIfDrained(ep);
}

absl::Status RdmaTransport::OnDisconnect(const std::string& from,
                                         const DisconnectRequest& req) {
  std::shared_ptr<Peer> peer;
  {
    MutexLock lock(&peers_mu_);
    auto it = peers_.find(from);
    if (it == peers_.end()) return absl::OkStatus();
    peer = it->second;
  }
  const int local = NicIndex(req.target_nic());
  if (local < 0) return absl::OkStatus();
  std::shared_ptr<Endpoint> ep;
  {
    MutexLock lock(&peer->mu);
    if (peer->incarnation != req.initiator_incarnation()) {
      return absl::OkStatus();
    }
    Peer::Rail* rail = peer->FindRail(local, req.initiator_nic());
    // Only the connection the peer means; a newer one stays.
    if (rail == nullptr || rail->ep == nullptr || rail->epoch != req.epoch()) {
      return absl::OkStatus();
    }
    ep = std::move(rail->ep);
    rail->ep = nullptr;
  }
  {
    MutexLock lock(&store_mu_);
    const auto* cur = store_.Peek(ep->id());
    if (cur != nullptr && *cur == ep) store_.Erase(ep->id());
  }
  SliceQueue waiting;
  {
    MutexLock lock(&ep->mu);
    ep->SetStateLocked(Endpoint::State::kClosing);
    waiting.Append(&ep->waiting);
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
  return absl::OkStatus();
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
    {
      MutexLock lock(&ep->mu);
      adopt_timeout = ep->state() == Endpoint::State::kConnecting &&
                      ep->adopt_deadline_ns != 0 &&
                      now_ns > ep->adopt_deadline_ns;
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
        if (q.qp != nullptr && q.count() > 0 &&
            q.posted[q.head % kMaxOutstanding]->deadline <= now) {
          FlushQp(q.qp);
        }
      }
    }
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
