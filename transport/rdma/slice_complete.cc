// SlicePath: what a completion or an async event means -- completing
// slices, failing endpoints, retrying on other rails (failover). The
// workers and the QP map that deliver them are completions.h's.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "transport/rdma/slice_path.h"

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

void SlicePath::OnCompletion(const QpRef& ref, const ibv_wc& wc) {
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
      rails_->NoteRailSuccess(ep);
    }
    CompleteOk(done, n);
    if (newly_failed) {
      // A WR without a slice failed (a keepalive: the peer is gone, and
      // is not told -- it would only cost an RPC timeout).
      ep->nic()->errors.fetch_add(1, std::memory_order_relaxed);
      rails_->FailEndpoint(ref.ep,
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
        rails_->NoteRailError(*ep);
      }
      if (newly_failed) {
        rails_->FailEndpoint(ref.ep, why, /*flush=*/false,
                             /*tell_peer=*/status != IBV_WC_RETRY_EXC_ERR);
      }
      for (uint32_t i = last_group; i < n; ++i) {
        Retry(done[i],
              i == last_group ? why : CompletionError(*done[i], *ep, status));
      }
    }
  }
  rails_->AfterPost(ref.ep, post);
  if (drained) rails_->DropIfDrained(ref.ep);
}

void SlicePath::Retry(Slice* slice, const absl::Status& status) {
  ctx_->counters.retries.fetch_add(1, std::memory_order_relaxed);
  FERRY_LOG_EVERY(kInfo, "rdma", absl::Seconds(1),
                  "slice retried on another rail: ", status.message());
  ++slice->attempts;
  SetSliceFailedOn(slice, SliceRail(slice));
  const SegmentView& view = *slice->target;
  const int t = view.FindTransportIndex("rdma");
  const uint32_t remote =
      t < 0 ? 1 : std::max(1, view.descriptor().transports(t).devices_size());
  // Enough tries to use every rail once, at least max_attempts. A remote
  // access error gets one more rail (another NIC's key might be good);
  // more would only break more QPs.
  uint32_t limit =
      std::max<uint32_t>(ctx_->options.rdma.max_attempts,
                         static_cast<uint32_t>(ctx_->nics.size()) * remote);
  if (status.code() == absl::StatusCode::kInvalidArgument) limit = 2;
  const absl::Time now = ctx_->clock->Now();
  if (ctx_->stopping.load() || slice->attempts >= limit) {
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

void SlicePath::OnPortChange(int nic, bool up) {
  Nic* n = ctx_->nics[nic].get();
  FERRY_LOG(kWarn, "rdma", "port of ", n->name(), " is ",
            up ? "ACTIVE again" : "down: its slices move to other NICs");
  n->set_port_active(up);
  if (up) return;
  rails_->PortDown(nic, absl::UnavailableError(absl::StrCat(
                            "port of RDMA NIC ", n->name(), " went down")));
}

void SlicePath::OnDeviceFatal(int nic) {
  Nic* n = ctx_->nics[nic].get();
  FERRY_LOG(kError, "rdma", n->name(),
            ": IBV_EVENT_DEVICE_FATAL; out of service until restart");
  n->set_fatal();
  rails_->DeviceDead(
      nic, absl::UnavailableError(
               absl::StrCat("RDMA NIC ", n->name(), " failed (device fatal)")));
  // Endpoints parked for this NIC's WR budget: it frees none any more (and
  // the poller skips a fatal NIC), so the list would hold them for good.
  completions_->TakeParked(nic);
}

}  // namespace ferry::rdma
