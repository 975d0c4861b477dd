// RailLifecycle: executing the connectors' decisions (ApplyLocked,
// RunLater) and the initiating handshake, on a control thread.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/rail_lifecycle.h"

namespace ferry::rdma {
namespace {

using Kind = RailConnector::Action::Kind;

}  // namespace

absl::Status RailLifecycle::CreateQps(Nic* nic, int n,
                                      std::vector<QueuePair>* qps) {
  for (int k = 0; k < n; ++k) {
    QpCaps caps;
    auto qp = CreateQp(nic, ctx_->posting, &caps);
    if (!qp.ok()) {
      DestroyQps(qps);
      return qp.status();
    }
    ctx_->counters.qps_created.fetch_add(1, std::memory_order_relaxed);
    QueuePair& q = qps->emplace_back();
    q.qp = *qp;
    q.max_inline = caps.max_inline;
    q.signal_every = ctx_->posting.signal_every;
    q.window = caps.window;
  }
  return absl::OkStatus();
}

bool RailLifecycle::InstallLocked(const EndpointPtr& ep,
                                  std::vector<QueuePair>* qps, uint64_t epoch,
                                  bool confirmed) {
  MutexLock lock(&ep->mu);
  if (ep->state() != Endpoint::State::kConnecting) return false;
  ep->qps = std::move(*qps);
  qps->clear();
  ep->epoch = epoch;
  ep->confirmed.store(confirmed, std::memory_order_release);
  {
    // Registered for completions before anything is posted.
    for (size_t k = 0; k < ep->qps.size(); ++k) {
      completions_->Track(ep->local_nic(), ep->qps[k].qp->qp_num,
                          QpRef{ep, static_cast<int>(k)});
    }
  }
  ep->SetStateLocked(Endpoint::State::kConnected);
  // The path MTU the QPs were given: the smaller of both ports' active
  // MTUs, which a switch's smaller MTU does not lower.
  FERRY_LOG(kInfo, "rdma", "connected to '", ep->peer()->name(), "' on ",
            ctx_->nics[ep->local_nic()]->name(), " -> ", ep->remote_nic(), " (",
            ep->qps.size(), " QPs, epoch ", epoch,
            ep->qps.empty()
                ? std::string()
                : absl::StrCat(", path MTU ", MtuBytes(ep->qps[0].path_mtu)),
            ")");
  return true;
}

void RailLifecycle::ApplyLocked(Peer* peer, Peer::Rail* rail,
                                const Actions& acts, const EndpointPtr& created,
                                std::vector<QueuePair>* qps, Later* later) {
  const int64_t now = ctx_->clock->NowNanos();
  // The endpoint an action names: the rail's (before or after this step)
  // or the one made for it.
  auto resolve = [&](uint64_t id) -> EndpointPtr {
    if (rail->ep != nullptr && rail->ep->id() == id) return rail->ep;
    if (created != nullptr && created->id() == id) return created;
    return nullptr;
  };
  for (const RailConnector::Action& a : acts) {
    switch (a.kind) {
      case Kind::kSendRequest: {
        EndpointPtr ep = resolve(a.ep);
        if (ep == nullptr) break;
        Job j;
        j.kind = Job::Kind::kConnect;
        j.ep = ep;
        j.attempt = a.attempt;
        j.epoch = a.epoch;
        later->jobs.push_back(std::move(j));
        break;
      }
      case Kind::kAccept:
        if (a.fresh) rail->ep = created;
        break;
      case Kind::kActivate: {
        EndpointPtr ep = resolve(a.ep);
        if (ep != nullptr && qps != nullptr &&
            InstallLocked(ep, qps, a.epoch, a.confirmed)) {
          later->activated = true;
          if (a.confirmed) later->posts.push_back(ep);
          // A connection was made with this run of the peer, either way.
          peer->backoff.Succeeded();
          rail->health.connect_fault = absl::OkStatus();
          peer->reached.store(true, std::memory_order_relaxed);
          break;
        }
        // Failed meanwhile (it cannot take the QPs): the rail has nothing.
        Actions more;
        rail->conn.Failed(a.ep, &more);
        rail->ep = nullptr;
        for (const auto& m : more) {
          if (m.kind == Kind::kTellDisconnect && ep != nullptr) {
            later->jobs.push_back(
                NoticeJob(peer, *ep, RailNotice::DISCONNECT, m.epoch));
          }
        }
        break;
      }
      case Kind::kConfirm: {
        EndpointPtr ep = resolve(a.ep);
        if (ep == nullptr) break;
        ep->confirmed.store(true, std::memory_order_release);
        later->posts.push_back(ep);
        later->trim = true;
        break;
      }
      case Kind::kFail: {
        EndpointPtr ep = resolve(a.ep);
        if (a.backoff) {
          peer->backoff.Failed(now, a.why);
          ctx_->counters.connect_failures.fetch_add(1,
                                                    std::memory_order_relaxed);
        }
        if (a.rail_fault) {
          // The peer refused this rail (e.g. its NIC is down): other rails
          // take the slices; this one is probed again after a pause.
          ctx_->counters.connect_failures.fetch_add(1,
                                                    std::memory_order_relaxed);
          RailHealth& h = rail->health;
          h.errors = 0;
          const int64_t pause =
              absl::ToInt64Nanoseconds(ctx_->options.rdma.pause_duration)
              << std::min<uint32_t>(h.pauses, 6);
          h.paused_until_ns = now + pause;
          h.connect_fault = a.why;
          ++h.pauses;
          FERRY_LOG_EVERY(kWarn, "rdma", absl::Seconds(1), "rail to '",
                          peer->name(), "' paused for ",
                          absl::FormatDuration(absl::Nanoseconds(pause)), ": ",
                          a.why.message());
        }
        if (ep == nullptr) break;
        if (rail->ep == ep) rail->ep = nullptr;
        later->fails.emplace_back(ep, a.why);
        if (a.flush) later->flush.push_back(ep);
        break;
      }
      case Kind::kClose: {
        EndpointPtr ep = resolve(a.ep);
        if (ep == nullptr) break;
        if (rail->ep == ep) rail->ep = nullptr;
        Job j;
        j.kind = Job::Kind::kClose;
        j.ep = std::move(ep);
        later->jobs.push_back(std::move(j));
        break;
      }
      case Kind::kTellReady:
      case Kind::kTellDisconnect: {
        Job j;
        j.kind = Job::Kind::kNotice;
        j.peer = peer->shared_from_this();
        j.notice = a.kind == Kind::kTellReady ? RailNotice::READY
                                              : RailNotice::DISCONNECT;
        j.epoch = a.epoch;
        j.local = rail->local;
        j.remote_nic = rail->remote_nic;
        j.incarnation = peer->incarnation;
        later->jobs.push_back(std::move(j));
        break;
      }
      case Kind::kInstall:
      case Kind::kReply:
      case Kind::kReplyAccepted:
      case Kind::kRefuse:
        break;  // The caller's: it holds the QPs or the reply.
    }
  }
  // The rail's endpoint and its connector stay in step.
  if (rail->conn.phase() == RailConnector::Phase::kIdle) {
    rail->ep = nullptr;
  } else if (rail->ep == nullptr || rail->ep->id() != rail->conn.ep()) {
    rail->ep = resolve(rail->conn.ep());
  }
}

void RailLifecycle::RunLater(Later* later, bool inline_ok) {
  for (Job& j : later->jobs) control_->Push(std::move(j));
  later->jobs.clear();
  for (auto& [ep, why] : later->fails) {
    const bool flush = std::find(later->flush.begin(), later->flush.end(),
                                 ep) != later->flush.end();
    if (inline_ok) {
      FailEndpoint(ep, why, flush);
    } else {
      Job j;
      j.kind = Job::Kind::kFail;
      j.ep = ep;
      j.why = why;
      j.flush = flush;
      control_->Push(std::move(j));
    }
  }
  later->fails.clear();
  for (EndpointPtr& ep : later->posts) {
    if (inline_ok) {
      PostOrPark(ep);
    } else {
      Job j;
      j.kind = Job::Kind::kPost;
      j.ep = std::move(ep);
      control_->Push(std::move(j));
    }
  }
  later->posts.clear();
  if (later->trim) {
    later->trim = false;
    TrimStore();
  }
}

void RailLifecycle::RunConnect(const EndpointPtr& ep, uint64_t attempt,
                               uint64_t claim) {
  Peer* peer = ep->peer();
  std::string rpc;
  absl::Status s;
  {
    MutexLock lock(&peer->mu);
    Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
    // Adopted, failed or replaced while the job waited: nothing to send.
    if (rail == nullptr || rail->ep != ep || !rail->conn.BeginSend(attempt)) {
      return;
    }
    rpc = peer->rpc_address;
    // Another rail's handshake failed while this one waited its turn: the
    // peer is backed off, and this one is not tried either (every rail of
    // an unreachable peer would otherwise cost a handshake). The probe
    // admitted after that failure does go.
    if (peer->backoff.failures() > 0 &&
        peer->backoff.generation() != ep->backoff_gen) {
      s = peer->backoff.last_error();
    }
  }
  Nic* nic = ep->nic();
  std::vector<QueuePair> qps;
  const bool skipped = !s.ok();
  if (!skipped) s = CreateQps(nic, ctx_->options.rdma.qps_per_endpoint, &qps);
  // Our NIC could not make the QPs (it died, or is out of resources): the
  // rail's fault, not the peer's. Backing the peer off would fail every
  // slice bound for its other rails while they still work.
  const bool local_fault = !skipped && !s.ok();
  ConnectReply reply;
  if (s.ok()) {
    RdmaMessage msg;
    ConnectRequest* req = msg.mutable_connect();
    req->set_initiator_segment(ctx_->env.local_segment);
    req->set_initiator_incarnation(ctx_->incarnation);
    req->set_target_incarnation(ep->peer_incarnation());
    req->set_initiator_nic(nic->name());
    req->set_target_nic(ep->remote_nic());
    req->set_rail_epoch(claim);
    req->set_initiator_rpc_address(ctx_->env.rpc_address);
    for (QueuePair& q : qps) DescribeQp(q.qp, nic, req->add_initiator_qps());
    ctx_->counters.connects_started.fetch_add(1, std::memory_order_relaxed);
    auto bytes =
        ctx_->env.peer_channel->Call(rpc, "rdma", msg.SerializeAsString());
    s = bytes.status();
    if (s.ok() && !reply.ParseFromString(*bytes)) {
      s = absl::DataLossError("malformed RDMA connect reply");
    }
    if (s.ok()) s = ValidateConnectReply(reply, static_cast<int>(qps.size()));
  }
  const bool stale =
      s.ok() && reply.result() == ConnectReply::STALE_INCARNATION;
  if (stale) {
    s = absl::FailedPreconditionError(absl::StrCat(
        "segment '", peer->name(),
        "' restarted (new incarnation): RefreshSegment and resubmit"));
  }
  const RailConnector::Outcome outcome = s.ok() ? OutcomeOf(reply)
                                         : local_fault
                                             ? RailConnector::Outcome::kRefused
                                             : RailConnector::Outcome::kFailed;
  if (s.ok() && outcome == RailConnector::Outcome::kRefused) {
    std::string reason = reply.reason();
    for (char& c : reason) {
      if (c < ' ' || c > '~') c = '?';  // From the wire, into a status.
    }
    s = absl::UnavailableError(
        absl::StrCat("RDMA peer '", peer->name(), "' refused the rail ",
                     nic->name(), " -> ", ep->remote_nic(), ": ", reason));
  } else if (!s.ok() && !skipped) {
    absl::Status wrapped(
        s.code(),
        absl::StrCat("RDMA handshake with '", peer->name(), "' (", nic->name(),
                     " -> ", ep->remote_nic(), "): ", s.message()));
    // The peer's hints (retry later, refresh) travel on.
    s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
      wrapped.SetPayload(url, payload);
    });
    s = std::move(wrapped);
  }
  std::vector<EndpointPtr> restarted;
  Later later;
  bool install = false;
  {
    MutexLock lock(&peer->mu);
    // A STALE reply names the target's run: a newer one restarts the
    // peer; an older one (late, or forged) changes nothing.
    if (stale) peer->SeeIncarnation(reply.target_incarnation(), &restarted);
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      peer->unresponsive_until_ns =
          ctx_->clock->NowNanos() +
          absl::ToInt64Nanoseconds(ctx_->options.connect_timeout);
    }
    Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
    if (rail != nullptr) {
      Actions acts;
      rail->conn.OnReply(attempt, outcome, s.ok() ? reply.epoch() : 0, s,
                         ctx_->clock->NowNanos(), &acts);
      for (const auto& a : acts) install |= a.kind == Kind::kInstall;
      ApplyLocked(peer, rail, acts, nullptr, nullptr, &later);
    }
  }
  for (auto& old : restarted) {
    later.fails.emplace_back(old, absl::UnavailableError("peer restarted"));
    later.flush.push_back(old);
  }
  RunLater(&later, /*inline_ok=*/true);
  if (!install) {
    // Any connection the peer made for a moot reply is closed by the
    // DISCONNECT the connector asked for.
    DestroyQps(&qps);
    return;
  }
  absl::Status cs;
  for (size_t k = 0; cs.ok() && k < qps.size(); ++k) {
    cs = ConnectQp(qps[k].qp, nic, reply.target_qps(static_cast<int>(k)),
                   ctx_->timers, &qps[k].path_mtu);
  }
  Later done;
  {
    MutexLock lock(&peer->mu);
    Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
    Actions acts;
    rail->conn.Installed(ep->id(), reply.epoch(), cs, &acts);
    ApplyLocked(peer, rail, acts, nullptr, &qps, &done);
  }
  if (!done.activated) DestroyQps(&qps);
  RunLater(&done, /*inline_ok=*/true);
}

}  // namespace ferry::rdma
