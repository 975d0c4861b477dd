// The same-process fast path. When both QPs of a connection live in this
// process there is no wire: the requester's thread executes the responder's
// side itself. Doing that one frame at a time (Kick's general loop) costs
// several lock round trips per work request; this path takes each QP's
// lock once per batch of up to kBatch WQEs, and only for the common case --
// RDMA WRITE and READ with valid keys while nothing is in flight. Anything
// else stops the batch before it is executed, and the general path then
// handles it with the full RC semantics (NAKs, error states, RNR, delays),
// so both paths give the same results.
#include <cstring>

#include "transport/softrnic/datapath.h"

namespace softrnic {
namespace {

constexpr int kBatch = 32;
// WQEs with more SGEs take the general path.
constexpr uint32_t kMaxFastSge = 4;

// A WQE copied out of the send queue, so the batch can run without the
// requester's lock (a flush may reuse the queue's slots meanwhile).
struct Work {
  ibv_wr_opcode opcode;
  uint32_t msn;
  uint32_t length;
  uint32_t rkey;
  uint64_t remote_addr;
  bool is_inline;
  uint32_t num_sge;
  Sge sges[kMaxFastSge];
  uint8_t inline_data[kMaxInline];
};

bool Copy(const SendWqe& w, Work* out) {
  if (w.local_error ||
      (w.opcode != IBV_WR_RDMA_WRITE && w.opcode != IBV_WR_RDMA_READ) ||
      (!w.is_inline && w.num_sge > kMaxFastSge)) {
    return false;
  }
  out->opcode = w.opcode;
  out->msn = w.msn;
  out->length = w.length;
  out->rkey = w.rkey;
  out->remote_addr = w.remote_addr;
  out->is_inline = w.is_inline;
  out->num_sge = w.is_inline ? 0 : w.num_sge;
  if (w.is_inline) {
    std::memcpy(out->inline_data, w.inline_data, w.length);
  } else {
    std::copy(w.sges, w.sges + w.num_sge, out->sges);
  }
  return true;
}

// Executes a prefix of `work` at `peer` as its responder would, and
// returns its length: it stops before the first WQE whose keys, bounds,
// rights or sequence number would not pass, leaving it untouched.
int Execute(Qp* qp, Qp* peer, Work* work, int n) {
  HeldMrs held;  // Released after the peer's lock (declared before it).
  ferry::MutexLock lock(&peer->mu);
  const ibv_qp_state st = peer->attr.qp_state;
  if (peer->destroyed || (st != IBV_QPS_RTR && st != IBV_QPS_RTS)) return 0;
  const int qp_access = peer->attr.qp_access_flags;
  int done = 0;
  for (; done < n; ++done) {
    const Work& w = work[done];
    if (w.msn != peer->expected_msn) break;
    held.MakeRoom();
    const bool read = w.opcode == IBV_WR_RDMA_READ;
    Mr* rmr = nullptr;
    if (w.length > 0) {
      const int need = read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE;
      if (!(qp_access & need)) break;
      rmr = held.Get(w.rkey, peer->pd, w.remote_addr, w.length, need);
      if (rmr == nullptr) break;
    }
    Mr* lmrs[kMaxFastSge] = {};
    bool ok = true;
    for (uint32_t i = 0; i < w.num_sge && ok; ++i) {
      lmrs[i] = held.Get(w.sges[i].lkey, qp->pd, w.sges[i].addr,
                         w.sges[i].length, read ? IBV_ACCESS_LOCAL_WRITE : 0);
      ok = lmrs[i] != nullptr;
    }
    if (ok && rmr != nullptr) {
      DmaScope dma;
      uint8_t* remote = HostAddr(rmr, w.remote_addr);
      if (w.is_inline) {
        std::memcpy(remote, w.inline_data, w.length);
      }
      for (uint32_t i = 0; i < w.num_sge; ++i) {
        uint8_t* local = HostAddr(lmrs[i], w.sges[i].addr);
        if (read) {
          std::memcpy(local, remote, w.sges[i].length);
        } else {
          std::memcpy(remote, local, w.sges[i].length);
        }
        remote += w.sges[i].length;
      }
    }
    if (!ok) break;
    peer->expected_msn = w.msn + 1;
    peer->rnr_nak_outstanding = peer->seq_nak_outstanding = false;
  }
  return done;
}

}  // namespace

bool ExecuteLoopback(const std::shared_ptr<Qp>& qp) {
  Work work[kBatch];
  while (true) {
    std::shared_ptr<Qp> peer;
    uint64_t epoch;
    int n = 0;
    {
      ferry::MutexLock lock(&qp->mu);
      if (qp->destroyed || qp->attr.qp_state != IBV_QPS_RTS || !qp->loopback ||
          !qp->has_loop_peer) {
        return false;
      }
      if (qp->sq.empty()) return true;
      // Something is in flight or waiting out an RNR NAK: the general
      // path owns the queue until it drains.
      if (qp->send_index != 0 || qp->retransmit_pending) return false;
      peer = qp->loop_peer.lock();
      if (peer == nullptr) return false;
      epoch = qp->sq.epoch();
      while (n < kBatch && static_cast<size_t>(n) < qp->sq.size() &&
             Copy(qp->sq[n], &work[n])) {
        ++n;
      }
    }
    // Anything the general path must handle: links, injected delays, and
    // a peer of the other RoCE version (whose drops it emulates).
    if (n == 0 || !qp->dev->LinkUp() || !peer->dev->LinkUp() ||
        qp->dev->delay_us.load(std::memory_order_relaxed) != 0 ||
        peer->sgid_v1.load(std::memory_order_acquire) !=
            qp->sgid_v1.load(std::memory_order_acquire)) {
      return false;
    }
    const int done = Execute(qp.get(), peer.get(), work, n);
    {
      ferry::MutexLock lock(&qp->mu);
      // Flushed or destroyed meanwhile: the flush reported every WQE.
      if (qp->sq.epoch() != epoch || qp->destroyed ||
          qp->attr.qp_state != IBV_QPS_RTS) {
        return false;
      }
      ibv_wc wcs[kBatch];
      int nwc = 0;
      for (int k = 0; k < done; ++k) {
        CompleteFront(qp.get(), IBV_WC_SUCCESS, wcs, &nwc);
      }
      if (done > 0) {
        qp->retries_left = qp->attr.retry_cnt;
        qp->rnr_retries_left = qp->attr.rnr_retry;
      }
      // Pushed under qp->mu, so none can follow ibv_destroy_qp.
      if (nwc > 0 && !qp->destroyed) PushCompletions(qp->send_cq, wcs, nwc);
    }
    if (done < n) return false;
  }
}

}  // namespace softrnic
