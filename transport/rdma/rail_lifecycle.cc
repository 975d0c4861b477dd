// RailLifecycle: peers, the rails' endpoints as the data path asks for
// them, posting, rail health, and what a NIC's fault does to its
// endpoints.
#include "transport/rdma/rail_lifecycle.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace ferry::rdma {

RailLifecycle::RailLifecycle(RdmaContext* context, Completions* completions,
                             ControlQueue* control, RailHost* host)
    : ctx_(context),
      completions_(completions),
      control_(control),
      host_(host),
      peers_(context->options.rdma.max_peers,
             [this](const std::string& name) { return MakePeer(name); }),
      store_(context->options.rdma.max_endpoints) {}

void RailLifecycle::RunJob(const ControlJob& job) {
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
}

std::shared_ptr<Peer> RailLifecycle::MakePeer(const std::string& name) {
  return std::make_shared<Peer>(
      name, ctx_->env.local_segment < name,
      absl::ToInt64Nanoseconds(ctx_->options.connect_timeout));
}

std::shared_ptr<Peer> RailLifecycle::PeerForView(const SegmentView& view,
                                                 absl::Status* why) {
  std::shared_ptr<Peer> peer = peers_.Get(view.name());
  std::vector<std::shared_ptr<Endpoint>> old;
  {
    MutexLock lock(&peer->mu);
    // A new incarnation: the segment's engine restarted, so its QPs and
    // keys are gone.
    if (!peer->SeeIncarnation(view.incarnation(), &old)) {
      *why = absl::FailedPreconditionError(absl::StrCat(
          "the descriptor of segment '", view.name(),
          "' is from an earlier run of that engine (it restarted): "
          "RefreshSegment and resubmit"));
      return nullptr;
    }
    // Fixed for an incarnation, unless the peer was first known from its
    // own connect request: copied once, not per run.
    if (peer->rpc_address.empty()) {
      peer->rpc_address = view.descriptor().rpc_address();
    }
  }
  for (auto& ep : old) {
    FailEndpoint(ep, absl::UnavailableError("peer restarted"), /*flush=*/true);
  }
  return peer;
}

void RailLifecycle::ClosePeer(const std::string& name) {
  if (ctx_->stopping.load()) return;
  std::shared_ptr<Peer> peer = peers_.Remove(name);
  if (peer == nullptr) return;
  std::vector<std::shared_ptr<Endpoint>> eps;
  {
    MutexLock lock(&peer->mu);
    for (const Peer::Rail& r : peer->rails) {
      if (r.ep != nullptr) eps.push_back(r.ep);
    }
  }
  // Idle ones go now; busy or connecting ones as soon as they are idle
  // (the housekeeper looks every 50 ms while they are busy). Their slices
  // are not failed.
  for (auto& ep : eps) {
    ep->close_when_idle.store(true, std::memory_order_relaxed);
    Close(ep, /*evicted=*/false);
  }
}

std::shared_ptr<Endpoint> RailLifecycle::RailEndpoint(
    const std::shared_ptr<Peer>& peer, int local, const std::string& remote_nic,
    absl::Status* why, bool* rail_paused) {
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
      const int64_t now = ctx_->clock->NowNanos();
      if (!rail.health.connect_fault.ok() &&
          rail.health.paused_until_ns > now) {
        *why = absl::UnavailableError(
            absl::StrCat("RDMA rail ", ctx_->nics[local]->name(), " -> '",
                         peer->name(), "'/", remote_nic, " paused for another ",
                         (rail.health.paused_until_ns - now) / 1000000,
                         " ms after its connect failed: ",
                         rail.health.connect_fault.message()));
        if (rail_paused != nullptr) *rail_paused = true;
        return nullptr;
      }
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
                                      ctx_->nics[local].get(), remote_nic);
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

void RailLifecycle::StoreInsert(const std::shared_ptr<Endpoint>& ep) {
  std::vector<std::shared_ptr<Endpoint>> evicted;
  store_.Insert(ep, &evicted);
  for (auto& v : evicted) Close(v, /*evicted=*/true);
}

void RailLifecycle::TrimStore() {
  std::vector<std::shared_ptr<Endpoint>> evicted;
  store_.Trim(&evicted);
  for (auto& v : evicted) Close(v, /*evicted=*/true);
}

void RailLifecycle::PostOrPark(const std::shared_ptr<Endpoint>& ep) {
  Endpoint::PostResult result;
  {
    MutexLock lock(&ep->mu);
    result = ep->PostLocked();
  }
  AfterPost(ep, result);
}

void RailLifecycle::AfterPost(const std::shared_ptr<Endpoint>& ep,
                              Endpoint::PostResult result) {
  if (result == Endpoint::PostResult::kRefused) {
    FailEndpoint(ep, absl::UnavailableError("ibv_post_send refused"), false);
  } else if (result == Endpoint::PostResult::kNicFull) {
    completions_->Park(ep->local_nic(), ep);
    // The NIC's last completions may have been reaped between the full
    // post and the parking, with nothing left to wake the parked: look
    // again. (Bounded: each round posts, or finds the budget used.)
    Nic* nic = ep->nic();
    if (nic->posted_wrs.load(std::memory_order_acquire) <
        nic->max_posted_wrs()) {
      for (auto& s : completions_->TakeParked(ep->local_nic())) PostOrPark(s);
    }
  }
}

void RailLifecycle::NoteRailError(const Endpoint& ep) {
  const_cast<Endpoint&>(ep).suspect.store(true, std::memory_order_relaxed);
  Peer* peer = ep.peer();
  MutexLock lock(&peer->mu);
  Peer::Rail* r = peer->FindRail(ep.local_nic(), ep.remote_nic());
  if (r == nullptr) return;
  RailHealth& h = r->health;
  if (++h.errors < ctx_->options.rdma.pause_after_errors && h.proven) return;
  h.errors = 0;
  // Paused, then probed again; a rail that keeps failing (e.g. a NIC pair
  // with no route between them) is paused exponentially longer, up to 64x
  // the base pause.
  const int64_t pause =
      absl::ToInt64Nanoseconds(ctx_->options.rdma.pause_duration)
      << std::min<uint32_t>(h.pauses, 6);
  ++h.pauses;
  h.paused_until_ns = ctx_->clock->NowNanos() + pause;
  FERRY_LOG_EVERY(kWarn, "rdma", absl::Seconds(1), "rail ",
                  ctx_->nics[ep.local_nic()]->name(), " -> '", peer->name(),
                  "'/", ep.remote_nic(), " paused for ",
                  absl::FormatDuration(absl::Nanoseconds(pause)),
                  " after repeated errors");
}

void RailLifecycle::NoteRailSuccess(Endpoint* ep) {
  const bool suspect = ep->suspect.exchange(false, std::memory_order_relaxed);
  const bool first = !ep->proven.exchange(true, std::memory_order_relaxed);
  if (!suspect && !first) return;
  Peer* peer = ep->peer();
  MutexLock lock(&peer->mu);
  Peer::Rail* r = peer->FindRail(ep->local_nic(), ep->remote_nic());
  if (r == nullptr) return;
  if (suspect && r->health.pauses > 0) {
    FERRY_LOG(kInfo, "rdma", "rail ", ctx_->nics[ep->local_nic()]->name(),
              " -> '", peer->name(), "'/", ep->remote_nic(), " works again");
  }
  // A new endpoint's first success also ends the pauses' growth: a rail
  // paused for a connect fault once (its QPs ran out for a while) is not
  // paused longer the next time for it.
  if (suspect || first) r->health = RailHealth{};
  r->health.proven = true;
}

void RailLifecycle::PortDown(int nic, const absl::Status& why) {
  // Their QPs are flushed, so their slices move to other rails at once
  // rather than after the QP's retry timeout.
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (auto& ep : store_.Live()) {
    if (ep->local_nic() == nic) eps.push_back(std::move(ep));
  }
  for (auto& ep : eps) FailEndpoint(ep, why, /*flush=*/true);
}

void RailLifecycle::DeviceDead(int nic, const absl::Status& why) {
  // A dead device reports no more completions and moves no more bytes:
  // the slices posted on it are taken back and retried on the other NICs
  // at once; its endpoints are failed and dropped.
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (auto& ep : store_.Live()) {
    if (ep->local_nic() == nic) eps.push_back(std::move(ep));
  }
  for (auto& ep : store_.Draining()) {
    if (ep->local_nic() == nic) eps.push_back(std::move(ep));
  }
  for (auto& ep : eps) {
    SliceQueue posted;
    {
      MutexLock lock(&ep->mu);
      ep->SetStateLocked(Endpoint::State::kFailed);
      ep->ReclaimPostedLocked(&posted);
    }
    FailEndpoint(ep, why, /*flush=*/false);
    ep->Unload(posted);
    while (Slice* s = posted.pop_front()) host_->Retry(s, why);
    DropIfDrained(ep);
  }
}

std::vector<std::shared_ptr<Endpoint>> RailLifecycle::TakeAll() {
  std::vector<std::shared_ptr<Endpoint>> eps = store_.TakeAll();
  for (auto& peer : peers_.TakeAll()) {
    MutexLock lock(&peer->mu);
    for (Peer::Rail& r : peer->rails) {
      if (r.ep != nullptr) eps.push_back(std::move(r.ep));
      r.ep = nullptr;
    }
  }
  return eps;
}

}  // namespace ferry::rdma
