// RdmaTransport: what a completion or an async event means -- completing
// slices, failing endpoints, retrying on other rails (failover). The
// workers and the QP map that deliver them are completions.h's.
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/rdma/rdma_transport.h"

namespace ferry::rdma {
namespace {

absl::Status CompletionError(const Slice& slice, const Endpoint& ep,
                             ibv_wc_status status) {
  const std::string what =
      absl::StrCat("RDMA ", slice.op == OpCode::kWrite ? "WRITE" : "READ",
                   " of 0x", absl::Hex(slice.remote), "+", slice.length,
                   " via ", ep.nic()->name(), " -> ", ep.peer()->name(), "/",
                   ep.remote_nic(), " failed: ", ibv_wc_status_str(status));
  switch (status) {
    case IBV_WC_REM_ACCESS_ERR:
      // Same meaning and code as the TCP transport's refusal.
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          " (not inside a buffer the target registered as remote-accessible,"
          " or a stale key: the target unregistered or restarted)"));
    case IBV_WC_RETRY_EXC_ERR:
      return absl::UnavailableError(
          absl::StrCat(what, " (no acknowledgement: link or peer down)"));
    case IBV_WC_WR_FLUSH_ERR:
      return absl::UnavailableError(
          absl::StrCat(what, " (flushed: the connection failed)"));
    default:
      return absl::UnavailableError(what);
  }
}

// Completes successful slices, a group per sink.
void CompleteOk(Slice* const* slices, uint32_t n) {
  uint32_t i = 0;
  while (i < n) {
    uint32_t j = i + 1;
    while (j < n && slices[j]->sink == slices[i]->sink) ++j;
    slices[i]->sink->OnSlicesDone(slices + i, j - i);
    i = j;
  }
}

}  // namespace

size_t RdmaTransport::Poll() { return completions_.Poll(); }

void RdmaTransport::OnCompletion(const QpRef& ref, const ibv_wc& wc) {
  Endpoint* ep = ref.ep.get();
  // 32 KiB: the poller's and the application's polling threads have the
  // default stacks.
  Slice* done[kMaxCompletedSlices];
  uint32_t n = 0, last_group = 0;
  ibv_wc_status status;
  bool newly_failed = false;
  bool drained = false;
  Endpoint::PostResult post = Endpoint::PostResult::kDone;
  {
    MutexLock lock(&ep->mu);
    const Endpoint::State before = ep->state();
    bool qp_error = false;
    status = ep->CompleteLocked(ref.qp, wc, done, &n, &last_group, &qp_error);
    // A failed fence or keepalive breaks the endpoint as much as a failed
    // slice does (its QP is in error), though it fails no slice.
    newly_failed = qp_error && before != Endpoint::State::kFailed &&
                   before != Endpoint::State::kClosing;
    // Completions made room: post what waits, on this thread.
    if (ep->state() == Endpoint::State::kConnected && !ep->waiting.empty()) {
      post = ep->PostLocked();
    }
    const Endpoint::State now = ep->state();
    drained =
        (now == Endpoint::State::kFailed || now == Endpoint::State::kClosing) &&
        ep->PostedLocked() == 0;
  }
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < n; ++i) bytes += done[i]->length;
  ep->Unload(n, bytes);
  if (status == IBV_WC_SUCCESS) {
    if (!newly_failed && (ep->suspect.load(std::memory_order_relaxed) ||
                          !ep->proven.load(std::memory_order_relaxed))) {
      NoteRailSuccess(ep);
    }
    CompleteOk(done, n);
    if (newly_failed) {
      // A WR without a slice failed (a keepalive: the peer is gone, and
      // is not told -- it would only cost an RPC timeout).
      ep->nic()->errors.fetch_add(1, std::memory_order_relaxed);
      FailEndpoint(ref.ep,
                   absl::UnavailableError(absl::StrCat(
                       "RDMA connection ", ep->nic()->name(), " -> ",
                       ep->peer()->name(), "/", ep->remote_nic(),
                       " failed: ", ibv_wc_status_str(wc.status))),
                   /*flush=*/false,
                   /*tell_peer=*/wc.status != IBV_WC_RETRY_EXC_ERR);
    }
  } else {
    // In order on an RC QP: all but the last WR succeeded; its slices
    // (one, or a coalesced group) failed.
    if (last_group > 0) CompleteOk(done, last_group);
    if (n > last_group) {
      Slice* failed = done[last_group];
      const absl::Status why = CompletionError(*failed, *ep, status);
      // NicStats.errors counts slices, each of the group.
      ep->nic()->errors.fetch_add(n - last_group, std::memory_order_relaxed);
      // A flushed WR never ran: the error that broke the QP was counted.
      // A remote access error is the request's fault, not the rail's.
      if (newly_failed && status != IBV_WC_WR_FLUSH_ERR &&
          status != IBV_WC_REM_ACCESS_ERR) {
        NoteRailError(*ep);
      }
      if (newly_failed) {
        FailEndpoint(ref.ep, why, /*flush=*/false,
                     /*tell_peer=*/status != IBV_WC_RETRY_EXC_ERR);
      }
      for (uint32_t i = last_group; i < n; ++i) {
        Retry(done[i],
              i == last_group ? why : CompletionError(*done[i], *ep, status));
      }
    }
  }
  AfterPost(ref.ep, post);
  if (drained) DropIfDrained(ref.ep);
}

void RdmaTransport::FailEndpoint(const std::shared_ptr<Endpoint>& ep,
                                 const absl::Status& why, bool flush,
                                 bool tell_peer) {
  FERRY_LOG_EVERY(kWarn, "rdma", absl::Seconds(1), "endpoint to '",
                  ep->peer()->name(), "' on ", nics_[ep->local_nic()]->name(),
                  " -> ", ep->remote_nic(), " disconnected: ", why.message());
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
  while (Slice* s = waiting.pop_front()) Retry(s, why);
  RunLater(&later, /*inline_ok=*/true);  // A DISCONNECT notice at most.
  DropIfDrained(ep);
}

void RdmaTransport::DropIfDrained(const std::shared_ptr<Endpoint>& ep) {
  std::vector<uint32_t> qpns;
  {
    MutexLock lock(&ep->mu);
    const Endpoint::State st = ep->state();
    if ((st != Endpoint::State::kFailed && st != Endpoint::State::kClosing) ||
        ep->PostedLocked() != 0 || clock_->NowNanos() < ep->drop_after_ns) {
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
  completions_.Untrack(ep->local_nic(), qpns, *ep);
}

void RdmaTransport::Retry(Slice* slice, const absl::Status& status) {
  retries_.fetch_add(1, std::memory_order_relaxed);
  FERRY_LOG_EVERY(kInfo, "rdma", absl::Seconds(1),
                  "slice retried on another rail: ", status.message());
  ++slice->attempts;
  SetSliceFailedOn(slice, SliceRail(slice));
  const SegmentView& view = *slice->target;
  const int t = view.FindTransportIndex(name());
  const uint32_t remote =
      t < 0 ? 1 : std::max(1, view.descriptor().transports(t).devices_size());
  // Enough tries to use every rail once, at least max_attempts. A remote
  // access error gets one more rail (another NIC's key might be good);
  // more would only break more QPs.
  uint32_t limit = std::max<uint32_t>(
      options_.rdma.max_attempts, static_cast<uint32_t>(nics_.size()) * remote);
  if (status.code() == absl::StatusCode::kInvalidArgument) limit = 2;
  const absl::Time now = clock_->Now();
  if (stopping_.load() || slice->attempts >= limit) {
    slice->Complete(status);
    return;
  }
  if (now >= slice->deadline) {
    slice->Complete(
        absl::DeadlineExceededError(absl::StrCat(kPastDeadline,
                                                 "; "
                                                 "last error: ",
                                                 status.message())));
    return;
  }
  Slice* one[] = {slice};
  RouteRun(one, now, 0);
}

void RdmaTransport::NoteRailError(const Endpoint& ep) {
  const_cast<Endpoint&>(ep).suspect.store(true, std::memory_order_relaxed);
  Peer* peer = ep.peer();
  MutexLock lock(&peer->mu);
  Peer::Rail* r = peer->FindRail(ep.local_nic(), ep.remote_nic());
  if (r == nullptr) return;
  RailHealth& h = r->health;
  if (++h.errors < options_.rdma.pause_after_errors && h.proven) return;
  h.errors = 0;
  // Paused, then probed again; a rail that keeps failing (e.g. a NIC pair
  // with no route between them) is paused exponentially longer, up to 64x
  // the base pause.
  const int64_t pause = absl::ToInt64Nanoseconds(options_.rdma.pause_duration)
                        << std::min<uint32_t>(h.pauses, 6);
  ++h.pauses;
  h.paused_until_ns = clock_->NowNanos() + pause;
  FERRY_LOG_EVERY(
      kWarn, "rdma", absl::Seconds(1), "rail ", nics_[ep.local_nic()]->name(),
      " -> '", peer->name(), "'/", ep.remote_nic(), " paused for ",
      absl::FormatDuration(absl::Nanoseconds(pause)), " after repeated errors");
}

void RdmaTransport::NoteRailSuccess(Endpoint* ep) {
  const bool suspect = ep->suspect.exchange(false, std::memory_order_relaxed);
  const bool first = !ep->proven.exchange(true, std::memory_order_relaxed);
  if (!suspect && !first) return;
  Peer* peer = ep->peer();
  MutexLock lock(&peer->mu);
  Peer::Rail* r = peer->FindRail(ep->local_nic(), ep->remote_nic());
  if (r == nullptr) return;
  if (suspect && r->health.pauses > 0) {
    FERRY_LOG(kInfo, "rdma", "rail ", nics_[ep->local_nic()]->name(), " -> '",
              peer->name(), "'/", ep->remote_nic(), " works again");
  }
  if (suspect) r->health = RailHealth{};
  r->health.proven = true;
}

void RdmaTransport::OnPortChange(int nic, bool up) {
  Nic* n = nics_[nic].get();
  FERRY_LOG(kWarn, "rdma", "port of ", n->name(), " is ",
            up ? "ACTIVE again" : "down: its slices move to other NICs");
  n->set_port_active(up);
  if (up) return;
  // A dead port: fail its endpoints now, flushing their QPs, so their
  // slices move to other rails at once rather than after the QP's retry
  // timeout.
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (auto& ep : store_.Live()) {
    if (ep->local_nic() == nic) eps.push_back(std::move(ep));
  }
  const absl::Status why = absl::UnavailableError(
      absl::StrCat("port of RDMA NIC ", n->name(), " went down"));
  for (auto& ep : eps) FailEndpoint(ep, why, /*flush=*/true);
}

void RdmaTransport::OnDeviceFatal(int nic) {
  Nic* n = nics_[nic].get();
  FERRY_LOG(kError, "rdma", n->name(),
            ": IBV_EVENT_DEVICE_FATAL; out of service until restart");
  n->set_fatal();
  // The device is dead: it reports no more completions and moves no more
  // bytes, so the slices posted on it are taken back and retried on the
  // other NICs at once; its endpoints are failed and dropped.
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (auto& ep : store_.Live()) {
    if (ep->local_nic() == nic) eps.push_back(std::move(ep));
  }
  for (auto& ep : store_.Draining()) {
    if (ep->local_nic() == nic) eps.push_back(std::move(ep));
  }
  const absl::Status why = absl::UnavailableError(
      absl::StrCat("RDMA NIC ", n->name(), " failed (device fatal)"));
  for (auto& ep : eps) {
    SliceQueue posted;
    {
      MutexLock lock(&ep->mu);
      ep->SetStateLocked(Endpoint::State::kFailed);
      ep->ReclaimPostedLocked(&posted);
    }
    FailEndpoint(ep, why, /*flush=*/false);
    ep->Unload(posted);
    while (Slice* s = posted.pop_front()) Retry(s, why);
    DropIfDrained(ep);
  }
  // Endpoints parked for this NIC's WR budget: it frees none any more (and
  // the poller skips a fatal NIC), so the list would hold them for good.
  completions_.TakeParked(nic);
}

}  // namespace ferry::rdma
