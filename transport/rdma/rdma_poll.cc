// RdmaTransport: NIC workers, completions and failover.
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

constexpr int kPollBatch = 64;
// While application threads reap completions themselves, the worker
// checks back this often (and otherwise keeps off the CQ).
constexpr int64_t kDeferUs = 200;
// Upper bound of an idle worker's sleep (for shutdown and housekeeping of
// its fds); completions and port events wake it earlier.
constexpr int64_t kIdleSleepUs = 100'000;

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

size_t RdmaTransport::Poll() {
  driver_epoch_.fetch_add(1, std::memory_order_relaxed);
  size_t n = 0;
  for (auto& p : pollers_) {
    if (!p->poll_mu.TryLock()) continue;  // Someone is at it already.
    n += PollNicLocked(p.get());
    p->poll_mu.Unlock();
  }
  return n;
}

size_t RdmaTransport::PollNicLocked(Poller* p) {
  if (p->nic->fatal()) return 0;
  ibv_wc wcs[kPollBatch];
  const int n = ibv_poll_cq(p->nic->cq(), kPollBatch, wcs);
  if (n > 0) p->nic->completions.fetch_add(n, std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) HandleCompletion(p, wcs[i]);
  // Completions freed WR budget on this NIC: post what waited for it.
  if (p->any_starved.load(std::memory_order_acquire)) {
    std::vector<std::shared_ptr<Endpoint>> starved;
    {
      MutexLock lock(&p->map_mu);
      starved.swap(p->starved);
      p->any_starved.store(false, std::memory_order_relaxed);
    }
    for (auto& ep : starved) PostOrPark(ep);
  }
  return n > 0 ? static_cast<size_t>(n) : 0;
}

void RdmaTransport::HandleCompletion(Poller* p, const ibv_wc& wc) {
  QpRef ref;
  {
    MutexLock lock(&p->map_mu);
    auto it = p->by_qpn.find(wc.qp_num);
    if (it == p->by_qpn.end()) return;  // A QP we already let go of.
    ref = it->second;
  }
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
  Poller* p = pollers_[ep->local_nic()].get();
  MutexLock lock(&p->map_mu);
  for (uint32_t qpn : qpns) {
    auto it = p->by_qpn.find(qpn);
    if (it != p->by_qpn.end() && it->second.ep == ep) p->by_qpn.erase(it);
  }
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

void RdmaTransport::OnPortChange(Poller* p, bool up) {
  FERRY_LOG(kWarn, "rdma", "port of ", p->nic->name(), " is ",
            up ? "ACTIVE again" : "down: its slices move to other NICs");
  p->nic->set_port_active(up);
  if (up) return;
  // A dead port: fail its endpoints now, flushing their QPs, so their
  // slices move to other rails at once rather than after the QP's retry
  // timeout.
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (auto& ep : store_.Live()) {
    if (ep->local_nic() == p->index) eps.push_back(std::move(ep));
  }
  const absl::Status why = absl::UnavailableError(
      absl::StrCat("port of RDMA NIC ", p->nic->name(), " went down"));
  for (auto& ep : eps) FailEndpoint(ep, why, /*flush=*/true);
}

void RdmaTransport::OnDeviceFatal(Poller* p) {
  FERRY_LOG(kError, "rdma", p->nic->name(),
            ": IBV_EVENT_DEVICE_FATAL; out of service until restart");
  p->nic->set_fatal();
  // The device is dead: it reports no more completions and moves no more
  // bytes, so the slices posted on it are taken back and retried on the
  // other NICs at once; its endpoints are failed and dropped.
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (auto& ep : store_.Live()) {
    if (ep->local_nic() == p->index) eps.push_back(std::move(ep));
  }
  for (auto& ep : store_.Draining()) {
    if (ep->local_nic() == p->index) eps.push_back(std::move(ep));
  }
  const absl::Status why = absl::UnavailableError(
      absl::StrCat("RDMA NIC ", p->nic->name(), " failed (device fatal)"));
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
  std::vector<std::shared_ptr<Endpoint>> parked;
  {
    MutexLock lock(&p->map_mu);
    parked.swap(p->starved);
    p->any_starved.store(false, std::memory_order_relaxed);
  }
}

void RdmaTransport::WaitEvents(Worker* w, int64_t timeout_us, bool channels) {
  // Per NIC its completion channel and async event fd, then the wake-up.
  constexpr size_t kMaxFds = 2 * 64 + 1;
  pollfd fds[kMaxFds];
  size_t n = 0;
  for (Poller* p : w->pollers) {
    // A dead device's channel may stay readable forever: not polled.
    const bool live = !p->nic->fatal();
    fds[n++] = {channels && live ? p->nic->channel()->fd : -1, POLLIN, 0};
    fds[n++] = {p->async_dead ? -1 : p->nic->context()->async_fd, POLLIN, 0};
  }
  fds[n++] = {w->wake_fd, POLLIN, 0};
  const timespec ts = {static_cast<time_t>(timeout_us / 1000000),
                       static_cast<long>((timeout_us % 1000000) * 1000)};
  // Real time: a bound on the sleep only (events wake it; nothing timed is
  // decided here).
  if (::ppoll(fds, n, &ts, nullptr) <= 0) return;
  for (size_t k = 0; k < w->pollers.size(); ++k) {
    Poller* p = w->pollers[k];
    Nic* nic = p->nic;
    if (fds[2 * k].revents & POLLIN) {
      ibv_cq* cq;
      void* ctx;
      if (ibv_get_cq_event(nic->channel(), &cq, &ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
      }
    }
    if (fds[2 * k + 1].revents & POLLIN) {
      ibv_async_event ev;
      if (ibv_get_async_event(nic->context(), &ev) == 0) {
        const ibv_event_type type = ev.event_type;
        ibv_ack_async_event(&ev);
        switch (type) {
          case IBV_EVENT_PORT_ERR:
            OnPortChange(p, false);
            break;
          case IBV_EVENT_PORT_ACTIVE:
            OnPortChange(p, true);
            break;
          case IBV_EVENT_DEVICE_FATAL:
            if (!nic->fatal()) OnDeviceFatal(p);
            break;
          case IBV_EVENT_GID_CHANGE:
            // Connections made from now on carry the new GID; existing
            // ones fail if the old address stops working, and are made
            // again.
            nic->RefreshGid();
            break;
          default:
            // QP and CQ events: the completions report those errors.
            break;
        }
      }
    } else if (fds[2 * k + 1].revents & (POLLERR | POLLHUP | POLLNVAL)) {
      p->async_dead = true;  // Never again in the poll set.
    }
  }
  if (fds[n - 1].revents & POLLIN) {
    uint64_t v;
    ssize_t r = ::read(w->wake_fd, &v, sizeof(v));
    (void)r;
  }
}

void RdmaTransport::WorkerLoop(Worker* w) {
  if (!options_.rdma.worker_cpus.empty()) {
    // Pin to the configured core (e.g. one near the NICs' NUMA node).
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(
        options_.rdma.worker_cpus[w->index % options_.rdma.worker_cpus.size()],
        &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  auto poll_all = [&] {
    size_t n = 0;
    for (Poller* p : w->pollers) {
      MutexLock lock(&p->poll_mu);
      n += PollNicLocked(p);
    }
    return n;
  };
  int spins = 0;
  uint64_t seen = driver_epoch_.load(std::memory_order_relaxed);
  while (!stopping_.load(std::memory_order_acquire)) {
    const uint64_t epoch = driver_epoch_.load(std::memory_order_relaxed);
    if (epoch != seen) {
      // Application threads reap completions themselves (Poll): polling
      // here as well would bounce every cache line between cores. Check
      // back shortly; port events are still handled.
      seen = epoch;
      spins = 0;
      WaitEvents(w, kDeferUs, /*channels=*/false);
      continue;
    }
    if (poll_all() > 0) {
      spins = 0;
      continue;
    }
    if (++spins < options_.rdma.spin_polls) {
      std::this_thread::yield();
      continue;
    }
    spins = 0;
    // Sleep until a completion, a wake-up or a port event. Arm first, then
    // poll once more: a completion between the last poll and arming would
    // otherwise raise no event.
    for (Poller* p : w->pollers) {
      if (!p->nic->fatal()) ibv_req_notify_cq(p->nic->cq(), 0);
    }
    if (poll_all() > 0) continue;
    WaitEvents(w, kIdleSleepUs, /*channels=*/true);
  }
}

}  // namespace ferry::rdma
