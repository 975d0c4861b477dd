// RailLifecycle: the accepting side of connection set-up. A peer's
// handshake messages arrive on gRPC threads (OnExchange), are validated
// completely (handshake.h) before use, and go to the rail's connector;
// these threads never wait for a drain, a post or another RPC -- what
// would block is queued for the control threads (rail_connect.cc).
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/rail_lifecycle.h"

namespace ferry::rdma {
namespace {

// Rails a peer may have: every pair of its NICs and ours (a request naming
// ever new NICs cannot grow the table without bound).
constexpr size_t kMaxRailsPerPeer = 64 * 64;

using Kind = RailConnector::Action::Kind;

}  // namespace

absl::StatusOr<std::string> RailLifecycle::OnExchange(
    const std::string& from, const std::string& payload) {
  if (ctx_->stopping.load()) {
    return absl::UnavailableError("RDMA transport is shutting down");
  }
  auto msg = ParseRdmaMessage(payload);
  if (!msg.ok()) return msg.status();
  if (msg->has_connect()) {
    FERRY_RETURN_IF_ERROR(ValidateConnectRequest(msg->connect(), from));
    auto reply = OnConnect(from, msg->connect());
    if (!reply.ok()) return reply.status();
    return reply->SerializeAsString();
  }
  FERRY_RETURN_IF_ERROR(ValidateRailNotice(msg->notice(), from));
  return OnNotice(from, msg->notice()).SerializeAsString();
}

absl::StatusOr<ConnectReply> RailLifecycle::AcceptSelf(
    const ConnectRequest& req, int local) {
  Nic* nic = ctx_->nics[local].get();
  std::shared_ptr<Peer> peer = peers_.Get(ctx_->env.local_segment);
  uint64_t inc;
  {
    MutexLock lock(&peer->mu);
    inc = peer->incarnation;
  }
  const uint64_t epoch = req.rail_epoch() + 1;
  auto ep = std::make_shared<Endpoint>(next_endpoint_id_.fetch_add(1), peer,
                                       inc, local, nic, req.initiator_nic(),
                                       /*off_rail=*/true);
  std::vector<QueuePair> qps;
  absl::Status s = CreateQps(nic, req.initiator_qps_size(), &qps);
  for (int k = 0; s.ok() && k < req.initiator_qps_size(); ++k) {
    s = ConnectQp(qps[k].qp, nic, req.initiator_qps(k), ctx_->timers,
                  &qps[k].path_mtu);
  }
  ConnectReply reply;
  reply.set_target_incarnation(ctx_->incarnation);
  if (!s.ok()) {
    DestroyQps(&qps);
    reply.set_result(ConnectReply::REFUSED);
    reply.set_reason(std::string(s.message().substr(0, kMaxReasonBytes)));
    return reply;
  }
  for (QueuePair& q : qps) DescribeQp(q.qp, nic, reply.add_target_qps());
  // No READY race with ourselves: it may send at once.
  InstallLocked(ep, &qps, epoch, /*confirmed=*/true);
  StoreInsert(ep);
  ctx_->counters.connects_accepted.fetch_add(1, std::memory_order_relaxed);
  reply.set_result(ConnectReply::ACCEPTED);
  reply.set_epoch(epoch);
  return reply;
}

absl::StatusOr<ConnectReply> RailLifecycle::OnConnect(
    const std::string& from, const ConnectRequest& req) {
  // The request is validated (ValidateConnectRequest); what it names must
  // exist here.
  ConnectReply reply;
  reply.set_target_incarnation(ctx_->incarnation);
  // The run it is meant for, which every Ferry release names: with the
  // Exchange signature covering it, a captured handshake is good at this
  // run of this engine only (0 is no run, not "any").
  if (req.target_incarnation() != ctx_->incarnation) {
    reply.set_result(ConnectReply::STALE_INCARNATION);
    return reply;
  }
  // Refusals that concern this rail only: the initiator uses its others.
  auto refuse = [&](const absl::Status& why) {
    reply.set_result(ConnectReply::REFUSED);
    reply.set_reason(std::string(why.message().substr(0, kMaxReasonBytes)));
    reply.clear_target_qps();
    return reply;
  };
  const int local = ctx_->NicIndex(req.target_nic());
  if (local < 0) {
    return refuse(absl::NotFoundError(
        absl::StrCat("no RDMA NIC named '", req.target_nic(), "'")));
  }
  Nic* nic = ctx_->nics[local].get();
  if (!nic->port_active()) {
    return refuse(absl::UnavailableError(absl::StrCat(
        "RDMA NIC ", nic->name(), nic->fatal() ? " is dead" : " is down")));
  }
  if (from == ctx_->env.local_segment) return AcceptSelf(req, local);

  std::shared_ptr<Peer> peer = peers_.Get(from);
  std::vector<EndpointPtr> retired;
  Later later;
  EndpointPtr ep;
  uint64_t epoch = 0;
  bool accept = false, fresh = false;
  absl::Status refused;
  {
    // Decide under the peer's lock; the QPs are made without it (on
    // softrnic connecting one may take a dial of up to a second).
    MutexLock lock(&peer->mu);
    if (!peer->SeeIncarnation(req.initiator_incarnation(), &retired)) {
      return absl::FailedPreconditionError(
          "RDMA connect request from an earlier run of its segment");
    }
    peer->unresponsive_until_ns = 0;  // It is talking to us.
    if (peer->rpc_address.empty()) {
      peer->rpc_address = req.initiator_rpc_address();
    }
    Peer::Rail* rail = peer->FindRail(local, req.initiator_nic());
    if (rail == nullptr) {
      if (peer->rails.size() >= kMaxRailsPerPeer) {
        return refuse(
            absl::ResourceExhaustedError("too many RDMA rails to one peer"));
      }
      rail = &peer->GetRail(local, req.initiator_nic());
    }
    const uint64_t new_id = next_endpoint_id_.fetch_add(1);
    Actions acts;
    rail->conn.OnRequest(req.rail_epoch(), new_id, &acts);
    EndpointPtr created;
    for (const auto& a : acts) {
      switch (a.kind) {
        case Kind::kAccept:
          accept = true;
          epoch = a.epoch;
          fresh = a.fresh;
          if (fresh) {
            created =
                std::make_shared<Endpoint>(new_id, peer, peer->incarnation,
                                           local, nic, req.initiator_nic());
          }
          break;
        case Kind::kReply:
          reply.set_result(a.result);
          reply.set_epoch(a.epoch);
          break;
        case Kind::kRefuse:
          refused = a.why;
          break;
        default:
          break;
      }
    }
    ApplyLocked(peer.get(), rail, acts, created, nullptr, &later);
    ep = fresh ? created : rail->ep;
  }
  for (auto& old : retired) {
    later.fails.emplace_back(old, absl::UnavailableError("peer restarted"));
    later.flush.push_back(old);
  }
  RunLater(&later, /*inline_ok=*/false);
  if (!accept) {
    if (!refused.ok()) return refuse(refused);
    return reply;
  }
  if (ep == nullptr) {
    return refuse(
        absl::UnavailableError("RDMA endpoint failed during the connect"));
  }
  if (fresh) StoreInsert(ep);
  const int n = req.initiator_qps_size();
  std::vector<QueuePair> qps;
  absl::Status s = CreateQps(nic, n, &qps);
  for (int k = 0; s.ok() && k < n; ++k) {
    s = ConnectQp(qps[k].qp, nic, req.initiator_qps(k), ctx_->timers,
                  &qps[k].path_mtu);
  }
  if (s.ok()) {
    for (QueuePair& q : qps) DescribeQp(q.qp, nic, reply.add_target_qps());
  }
  Later done;
  bool accepted = false;
  {
    MutexLock lock(&peer->mu);
    Peer::Rail* rail = peer->FindRail(local, req.initiator_nic());
    Actions acts;
    rail->conn.AcceptDone(ep->id(), epoch, s, ctx_->clock->NowNanos(), &acts);
    for (const auto& a : acts) {
      if (a.kind == Kind::kReplyAccepted) accepted = true;
      if (a.kind == Kind::kRefuse) refused = a.why;
    }
    ApplyLocked(peer.get(), rail, acts, nullptr, &qps, &done);
  }
  if (!done.activated) DestroyQps(&qps);
  RunLater(&done, /*inline_ok=*/false);
  if (!accepted) {
    return refuse(refused.ok() ? absl::UnavailableError(
                                     "RDMA endpoint failed during the connect")
                               : refused);
  }
  ep->used.store(true, std::memory_order_relaxed);
  if (!fresh)
    ctx_->counters.connect_races.fetch_add(1, std::memory_order_relaxed);
  ctx_->counters.connects_accepted.fetch_add(1, std::memory_order_relaxed);
  reply.set_result(ConnectReply::ACCEPTED);
  reply.set_epoch(epoch);
  return reply;
}

RailNoticeReply RailLifecycle::OnNotice(const std::string& from,
                                        const RailNotice& n) {
  RailNoticeReply reply;
  std::shared_ptr<Peer> peer = peers_.Find(from);
  const int local = ctx_->NicIndex(n.target_nic());
  if (peer == nullptr || local < 0) return reply;
  Later later;
  {
    MutexLock lock(&peer->mu);
    // Only about a connection of the sender's current run with this run.
    if (peer->incarnation != n.initiator_incarnation() ||
        n.target_incarnation() != ctx_->incarnation) {
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
              ctx_->nics[j.ep->local_nic()]->name(), " -> ", j.ep->remote_nic(),
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

}  // namespace ferry::rdma
