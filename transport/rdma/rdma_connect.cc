// RdmaTransport: connection set-up and tear-down, off the data path --
// the executor of the rails' RailConnectors (connector.h).
//
// Every decision about a rail's connection is its connector's, taken
// under the Peer's lock; ApplyLocked carries out what must change with it
// atomically (the rail's endpoint, an endpoint's state and QPs) and leaves
// the rest (posting, failing endpoints, RPCs) to RunLater, after the lock.
// Handshakes and notices run on the control threads (ControlLoop); a
// peer's messages arrive on gRPC threads (OnExchange), which never wait
// for a drain, a post or an RPC. The housekeeper enforces deadlines and
// probes idle endpoints (keepalive).
#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/rdma_transport.h"

namespace ferry::rdma {
namespace {

// Rails a peer may have: every pair of its NICs and ours (a request naming
// ever new NICs cannot grow the table without bound).
constexpr size_t kMaxRailsPerPeer = 64 * 64;
constexpr absl::Duration kHousekeepingInterval = absl::Milliseconds(50);
// Beyond the peer's drain deadline, how long a side that closed a
// connection keeps its QPs.
constexpr int64_t kLingerMarginNs = 100'000'000;

void DestroyQps(std::vector<QueuePair>* qps) {
  for (QueuePair& q : *qps) {
    if (q.qp != nullptr) ibv_destroy_qp(q.qp);
  }
  qps->clear();
}

using Kind = RailConnector::Action::Kind;

}  // namespace

void RdmaTransport::QueueJob(Job job) {
  MutexLock lock(&jobs_mu_);
  jobs_.push_back(std::move(job));
  jobs_cv_.SignalAll();
}

bool RdmaTransport::MayStartConnect(const Peer* peer) const {
  auto it = connects_running_.find(peer);
  const int running = it == connects_running_.end() ? 0 : it->second;
  return running < (peer->reached.load(std::memory_order_relaxed)
                        ? kMaxConnectsPerPeer
                        : 1);
}

void RdmaTransport::ControlLoop() {
  while (true) {
    Job job;
    {
      MutexLock lock(&jobs_mu_);
      while (true) {
        const bool farewell = stopping_.load();
        if (farewell && clock_->Now() > farewell_deadline_) return;
        // The oldest job that may run: a connect waits while its peer has
        // as many running as it may (so that an unreachable peer holds one
        // control thread, not one per rail). Shutting down, only notices
        // already queued still go out (a peer learns at once that its
        // connections are closed), for a short while.
        auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](const Job& j) {
          jobs_mu_.AssertHeld();  // Called right here, under the lock.
          if (farewell) return j.kind == Job::Kind::kNotice;
          return j.kind != Job::Kind::kConnect || MayStartConnect(j.ep->peer());
        });
        if (farewell && it == jobs_.end()) return;
        if (it != jobs_.end()) {
          job = std::move(*it);
          jobs_.erase(it);
          break;
        }
        jobs_cv_.Wait(&jobs_mu_);
      }
      if (job.kind == Job::Kind::kConnect) ++connects_running_[job.ep->peer()];
    }
    switch (job.kind) {
      case Job::Kind::kConnect:
        RunConnect(job.ep, job.attempt, job.epoch);
        break;
      case Job::Kind::kNotice:
        RunNotice(job);
        break;
      case Job::Kind::kClose:
        CloseForPeer(job.ep);
        break;
      case Job::Kind::kFail:
        FailEndpoint(job.ep, job.why, job.flush);
        break;
      case Job::Kind::kPost:
        PostOrPark(job.ep);
        break;
    }
    if (job.kind == Job::Kind::kConnect) {
      MutexLock lock(&jobs_mu_);
      auto it = connects_running_.find(job.ep->peer());
      if (it != connects_running_.end() && --it->second <= 0) {
        connects_running_.erase(it);
      }
      jobs_cv_.SignalAll();
    }
  }
}

absl::Status RdmaTransport::CreateQps(Nic* nic, int n,
                                      std::vector<QueuePair>* qps) {
  for (int k = 0; k < n; ++k) {
    QpCaps caps;
    auto qp = CreateQp(nic, posting_, &caps);
    if (!qp.ok()) {
      DestroyQps(qps);
      return qp.status();
    }
    QueuePair& q = qps->emplace_back();
    q.qp = *qp;
    q.max_inline = caps.max_inline;
    q.signal_every = posting_.signal_every;
    q.window = caps.window;
  }
  return absl::OkStatus();
}

bool RdmaTransport::InstallLocked(const EndpointPtr& ep,
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
    Poller* p = pollers_[ep->local_nic()].get();
    MutexLock map_lock(&p->map_mu);
    for (size_t k = 0; k < ep->qps.size(); ++k) {
      p->by_qpn[ep->qps[k].qp->qp_num] = QpRef{ep, static_cast<int>(k)};
    }
  }
  ep->SetStateLocked(Endpoint::State::kConnected);
  // The path MTU the QPs were given: the smaller of both ports' active
  // MTUs, which a switch's smaller MTU does not lower.
  FERRY_LOG(kInfo, "rdma", "connected to '", ep->peer()->name(), "' on ",
            nics_[ep->local_nic()]->name(), " -> ", ep->remote_nic(), " (",
            ep->qps.size(), " QPs, epoch ", epoch,
            ep->qps.empty()
                ? std::string()
                : absl::StrCat(", path MTU ", MtuBytes(ep->qps[0].path_mtu)),
            ")");
  return true;
}

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

void RdmaTransport::ApplyLocked(Peer* peer, Peer::Rail* rail,
                                const Actions& acts, const EndpointPtr& created,
                                std::vector<QueuePair>* qps, Later* later) {
  const int64_t now = clock_->NowNanos();
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
        break;
      }
      case Kind::kFail: {
        EndpointPtr ep = resolve(a.ep);
        if (a.backoff) {
          peer->backoff.Failed(now, a.why);
          connect_failures_.fetch_add(1, std::memory_order_relaxed);
        }
        if (a.rail_fault) {
          // The peer refused this rail (e.g. its NIC is down): other rails
          // take the slices; this one is probed again after a pause.
          connect_failures_.fetch_add(1, std::memory_order_relaxed);
          RailHealth& h = rail->health;
          h.errors = 0;
          const int64_t pause =
              absl::ToInt64Nanoseconds(options_.rdma.pause_duration)
              << std::min<uint32_t>(h.pauses, 6);
          h.paused_until_ns = now + pause;
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

void RdmaTransport::RunLater(Later* later, bool inline_ok) {
  for (Job& j : later->jobs) QueueJob(std::move(j));
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
      QueueJob(std::move(j));
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
      QueueJob(std::move(j));
    }
  }
  later->posts.clear();
}

void RdmaTransport::RunConnect(const EndpointPtr& ep, uint64_t attempt,
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
  if (!skipped) s = CreateQps(nic, options_.rdma.qps_per_endpoint, &qps);
  ConnectReply reply;
  if (s.ok()) {
    RdmaMessage msg;
    ConnectRequest* req = msg.mutable_connect();
    req->set_initiator_segment(env_.local_segment);
    req->set_initiator_incarnation(incarnation_);
    req->set_target_incarnation(ep->peer_incarnation());
    req->set_initiator_nic(nic->name());
    req->set_target_nic(ep->remote_nic());
    req->set_rail_epoch(claim);
    req->set_initiator_rpc_address(env_.rpc_address);
    for (QueuePair& q : qps) DescribeQp(q.qp, nic, req->add_initiator_qps());
    connects_started_.fetch_add(1, std::memory_order_relaxed);
    auto bytes = env_.peer_channel->Call(rpc, "rdma", msg.SerializeAsString());
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
  const RailConnector::Outcome outcome =
      s.ok() ? OutcomeOf(reply) : RailConnector::Outcome::kFailed;
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
          clock_->NowNanos() +
          absl::ToInt64Nanoseconds(options_.connect_timeout);
    }
    Peer::Rail* rail = peer->FindRail(ep->local_nic(), ep->remote_nic());
    if (rail != nullptr) {
      Actions acts;
      rail->conn.OnReply(attempt, outcome, s.ok() ? reply.epoch() : 0, s,
                         clock_->NowNanos(), &acts);
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
                   timers_, &qps[k].path_mtu);
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

absl::StatusOr<std::string> RdmaTransport::OnExchange(
    const std::string& from, const std::string& payload) {
  if (stopping_.load()) {
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

absl::StatusOr<ConnectReply> RdmaTransport::AcceptSelf(
    const ConnectRequest& req, int local) {
  Nic* nic = nics_[local].get();
  std::shared_ptr<Peer> peer = peers_.Get(env_.local_segment);
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
    s = ConnectQp(qps[k].qp, nic, req.initiator_qps(k), timers_,
                  &qps[k].path_mtu);
  }
  ConnectReply reply;
  reply.set_target_incarnation(incarnation_);
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
  connects_accepted_.fetch_add(1, std::memory_order_relaxed);
  reply.set_result(ConnectReply::ACCEPTED);
  reply.set_epoch(epoch);
  return reply;
}

absl::StatusOr<ConnectReply> RdmaTransport::OnConnect(
    const std::string& from, const ConnectRequest& req) {
  // The request is validated (ValidateConnectRequest); what it names must
  // exist here.
  ConnectReply reply;
  reply.set_target_incarnation(incarnation_);
  // The run it is meant for, which every Ferry release names: with the
  // Exchange signature covering it, a captured handshake is good at this
  // run of this engine only (0 is no run, not "any").
  if (req.target_incarnation() != incarnation_) {
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
  const int local = NicIndex(req.target_nic());
  if (local < 0) {
    return refuse(absl::NotFoundError(
        absl::StrCat("no RDMA NIC named '", req.target_nic(), "'")));
  }
  Nic* nic = nics_[local].get();
  if (!nic->port_active()) {
    return refuse(absl::UnavailableError(absl::StrCat(
        "RDMA NIC ", nic->name(), nic->fatal() ? " is dead" : " is down")));
  }
  if (from == env_.local_segment) return AcceptSelf(req, local);

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
    s = ConnectQp(qps[k].qp, nic, req.initiator_qps(k), timers_,
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
    rail->conn.AcceptDone(ep->id(), epoch, s, clock_->NowNanos(), &acts);
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
  if (!fresh) connect_races_.fetch_add(1, std::memory_order_relaxed);
  connects_accepted_.fetch_add(1, std::memory_order_relaxed);
  reply.set_result(ConnectReply::ACCEPTED);
  reply.set_epoch(epoch);
  return reply;
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

void RdmaTransport::HousekeeperLoop() {
  while (true) {
    {
      MutexLock lock(&housekeeper_mu_);
      const absl::Time next = clock_->Now() + kHousekeepingInterval;
      while (
          !stop_housekeeper_ &&
          !clock_->WaitWithDeadline(&housekeeper_cv_, &housekeeper_mu_, next)) {
      }
      if (stop_housekeeper_) return;
    }
    Housekeep(clock_->NowNanos());
  }
}

void RdmaTransport::Housekeep(int64_t now_ns) {
  const absl::Time now = absl::FromUnixNanos(now_ns);
  const int64_t keepalive_ns =
      absl::ToInt64Nanoseconds(options_.rdma.keepalive_interval);
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
    expire(ep, /*live=*/true);
    if (ep->close_when_idle.load(std::memory_order_relaxed) && ep->Idle()) {
      Close(ep, /*evicted=*/false);
    }
  }
  for (const EndpointPtr& ep : store_.Draining()) {
    if (expire(ep, /*live=*/false)) DropIfDrained(ep);
  }
  peers_.Trim();
}

}  // namespace ferry::rdma
