// The requester's acknowledgement path: what comes back for its requests.
// ACKs and READ responses complete WQEs in order; NAKs fail the front WQE,
// or rewind the send queue for retransmission (sequence NAK, or RNR NAK
// after its wait).
#include <algorithm>

#include "transport/softrnic/datapath.h"
#include "transport/softrnic/requester.h"
#include "transport/softrnic/wire_verbs.h"

namespace softrnic {
namespace {

// Progress restarts the timer of the oldest unacknowledged WQE, as a NIC
// restarts its retransmission timer on every ACK: only a stall of a whole
// timeout counts as a lost transmission.
void RestartFrontTimer(Qp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  if (qp->sq.empty() || qp->send_index == 0) return;
  SendWqe& w = qp->sq.front();
  w.deadline = std::max(w.deadline, AckDeadline(*qp, w, Clock::now()));
}

// WQEs before `msn` are implicitly acknowledged (the responder executes
// in order), except READs, which need their data.
void CompleteBefore(Qp* qp, uint32_t msn)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  while (qp->send_index > 0 && !qp->sq.empty() &&
         MsnBefore(qp->sq.front().msn, msn) &&
         qp->sq.front().opcode != IBV_WR_RDMA_READ) {
    CompleteFront(qp, IBV_WC_SUCCESS);
  }
}

// Handles a NAK at requester `qp`; releases qp->mu.
bool HandleNak(const std::shared_ptr<Qp>& qp, const Frame& f, bool* kick)
    ABSL_UNLOCK_FUNCTION(qp->mu) {
  CompleteBefore(qp.get(), f.msn);
  const auto code = static_cast<NakCode>(f.aux);
  const bool at_front =
      !qp->sq.empty() && qp->send_index > 0 && qp->sq.front().msn == f.msn;
  switch (code) {
    case NakCode::kRemoteAccess:
    case NakCode::kInvalidRequest:
    case NakCode::kRemoteOp: {
      if (!at_front) break;
      FailFront(qp, NakStatus(code));
      return true;
    }
    case NakCode::kRnr: {
      if (!at_front) break;
      if (qp->rnr_retries_left == 0) {
        FailFront(qp, IBV_WC_RNR_RETRY_EXC_ERR);
        return true;
      }
      if (qp->attr.rnr_retry != 7) --qp->rnr_retries_left;  // 7: forever.
      qp->send_index = 0;
      qp->rnr_until =
          Clock::now() + std::chrono::microseconds(RnrTimerMicros(f.rkey & 31));
      qp->retransmit_pending = true;
      qp->mu.Unlock();
      ScheduleTimer(qp);
      return true;
    }
    case NakCode::kSequence: {
      size_t i = 0;
      while (i < qp->send_index && qp->sq[i].msn != f.msn) ++i;
      if (i < qp->send_index) {
        qp->send_index = i;
        *kick = true;
      }
      break;
    }
    case NakCode::kNoQp:
      qp->mu.Unlock();
      return false;  // No such QP at the peer: drop the connection.
    default:
      qp->mu.Unlock();
      return false;  // Not a NAK code: a protocol violation.
  }
  qp->mu.Unlock();
  return true;
}

}  // namespace

void FailFront(const std::shared_ptr<Qp>& qp, ibv_wc_status status) {
  if (!qp->sq.empty()) CompleteFront(qp.get(), status);
  EnterErrorAndUnlock(qp);
}

void CompleteFront(Qp* qp, ibv_wc_status status, ibv_wc* batch, int* n) {
  SendWqe& w = qp->sq.front();
  const bool signaled = w.signaled || qp->sq_sig_all;
  if (status != IBV_WC_SUCCESS || signaled) {
    ibv_wc wc{};
    wc.wr_id = w.wr_id;
    wc.status = status;
    wc.opcode = WcOpcode(w.opcode);
    wc.byte_len = w.length;
    wc.qp_num = qp->qp.qp_num;
    if (batch != nullptr && status == IBV_WC_SUCCESS) {
      batch[(*n)++] = wc;
    } else if (!qp->destroyed) {
      PushCompletion(qp->send_cq, wc);
    }
    // A signaled completion retires the slots of the unsignaled WQEs
    // before it (the application learns they are done only now).
    qp->done_unsignaled = 0;
  } else {
    ++qp->done_unsignaled;
  }
  qp->sq.pop_front();
  if (qp->send_index > 0) --qp->send_index;
}

bool HandleResponse(const std::shared_ptr<Qp>& qp, const Frame& f,
                    PayloadSource* src, bool* kick) {
  const uint32_t payload = f.type == FrameType::kReadResp ? f.length : 0;
  auto drain = [&]() {
    return payload == 0 || src->Read(nullptr, payload, nullptr);
  };
  qp->mu.Lock();
  if (qp->destroyed || qp->attr.qp_state != IBV_QPS_RTS) {
    qp->mu.Unlock();
    return drain();
  }
  switch (f.type) {
    case FrameType::kHelloAck:
      qp->mu.Unlock();
      return true;
    case FrameType::kAck: {
      CompleteBefore(qp.get(), f.msn + 1);
      qp->retries_left = qp->attr.retry_cnt;
      qp->rnr_retries_left = qp->attr.rnr_retry;
      RestartFrontTimer(qp.get());
      qp->mu.Unlock();
      return true;
    }
    case FrameType::kReadResp: {
      CompleteBefore(qp.get(), f.msn);
      if (qp->send_index == 0 || qp->sq.empty() ||
          qp->sq.front().msn != f.msn ||
          qp->sq.front().opcode != IBV_WR_RDMA_READ) {
        qp->mu.Unlock();
        return drain();  // A duplicate response to a retransmission.
      }
      SendWqe& w = qp->sq.front();
      if (f.length != w.length) {
        qp->mu.Unlock();
        return false;
      }
      Sge sges[kMaxSge];
      const uint32_t nsge = w.num_sge;
      std::copy(w.sges, w.sges + nsge, sges);
      const uint32_t msn = w.msn;
      qp->mu.Unlock();
      uint32_t left = f.length;
      bool prot_error = false;
      for (uint32_t i = 0; i < nsge; ++i) {
        const Sge& s = sges[i];
        if (left == 0) break;
        uint32_t k = std::min(left, s.length);
        Mr* mr = AcquireMr(s.lkey, qp->pd, s.addr, k, IBV_ACCESS_LOCAL_WRITE);
        bool ok = mr != nullptr ? src->Read(HostAddr(mr, s.addr), k, mr)
                                : src->Read(nullptr, k, nullptr);
        if (mr == nullptr) prot_error = true;
        if (mr != nullptr) ReleaseMr(mr);
        if (!ok) return false;
        left -= k;
      }
      qp->mu.Lock();
      if (!qp->sq.empty() && qp->sq.front().msn == msn) {
        if (prot_error) {
          FailFront(qp, IBV_WC_LOC_PROT_ERR);
          return true;
        }
        CompleteFront(qp.get(), IBV_WC_SUCCESS);
        qp->retries_left = qp->attr.retry_cnt;
        qp->rnr_retries_left = qp->attr.rnr_retry;
        RestartFrontTimer(qp.get());
      }
      qp->mu.Unlock();
      return true;
    }
    case FrameType::kNak:
      return HandleNak(qp, f, kick);
    default:
      qp->mu.Unlock();
      return false;
  }
}

}  // namespace softrnic
