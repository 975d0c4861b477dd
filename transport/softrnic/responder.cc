// The responder's execution of requests: a peer's SEND, WRITE and READ run
// on local memory in MSN order, with keys, bounds and access rights checked
// first, and each gets its answer (ACK, NAK or READ data). The connections
// they arrive on are listener.cc's.
#include <algorithm>
#include <memory>

#include "transport/softrnic/datapath.h"
#include "transport/softrnic/wire_verbs.h"

namespace softrnic {
namespace {

ibv_wc RecvWc(Qp* qp, const RecvWqe& w, ibv_wc_status status, uint32_t len,
              const Frame& f, bool with_imm, ibv_wc_opcode op)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  ibv_wc wc{};
  wc.wr_id = w.wr_id;
  wc.status = status;
  wc.opcode = op;
  wc.byte_len = len;
  wc.qp_num = qp->qp.qp_num;
  wc.src_qp = qp->attr.dest_qp_num;
  if (with_imm) {
    wc.imm_data = f.imm;
    wc.wc_flags = IBV_WC_WITH_IMM;
  }
  return wc;
}

void PushRecv(Qp* qp, const RecvWqe& w, ibv_wc_status status, uint32_t len,
              const Frame& f, bool with_imm, ibv_wc_opcode op)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  PushCompletion(qp->recv_cq, RecvWc(qp, w, status, len, f, with_imm, op),
                 (f.flags & kFlagSolicited) != 0);
}

void DeferRecv(Response* r, Qp* qp, const RecvWqe& w, uint32_t len,
               const Frame& f, bool with_imm, ibv_wc_opcode op)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  r->has_recv_wc = true;
  r->recv_solicited = (f.flags & kFlagSolicited) != 0;
  r->recv_wc = RecvWc(qp, w, IBV_WC_SUCCESS, len, f, with_imm, op);
}

// Scatters `len` payload bytes into the receive WQE's buffers.
bool Scatter(Qp* qp, const RecvWqe& w, uint32_t len, PayloadSource* src,
             bool* prot_error) {
  uint32_t left = len;
  for (const Sge& s : w.sges) {
    if (left == 0) break;
    uint32_t k = std::min(left, s.length);
    Mr* mr = AcquireMr(s.lkey, qp->pd, s.addr, k, IBV_ACCESS_LOCAL_WRITE);
    if (mr == nullptr) {
      *prot_error = true;
      return src->Read(nullptr, left, nullptr);
    }
    bool ok = src->Read(HostAddr(mr, s.addr), k, mr);
    ReleaseMr(mr);
    if (!ok) return false;
    left -= k;
  }
  return true;
}

}  // namespace

Response ProcessRequest(const std::shared_ptr<Qp>& qp, const Frame& f,
                        PayloadSource* src) {
  Response r;
  const bool has_payload = HasPayload(f.type);
  const uint32_t payload = has_payload ? f.length : 0;
  auto drop = [&](Response resp) {
    if (payload > 0 && !src->Read(nullptr, payload, nullptr)) {
      resp.io_error = true;
    }
    return resp;
  };
  qp->mu.Lock();
  const ibv_qp_state st = qp->attr.qp_state;
  if (qp->destroyed || (st != IBV_QPS_RTR && st != IBV_QPS_RTS)) {
    qp->mu.Unlock();
    return drop(r);  // A real responder silently drops these too.
  }
  const uint32_t expected = qp->expected_msn;
  const MsnOrder order = ClassifyMsn(f.msn, expected);
  if (order == MsnOrder::kDuplicate && f.type != FrameType::kRead) {
    // Duplicate of an executed request (a retransmission): acknowledge
    // again without re-executing, except READ, which is idempotent.
    qp->mu.Unlock();
    r.send = true;
    r.frame = ReplyTo(FrameType::kAck, f);
    return drop(r);
  }
  if (order == MsnOrder::kGap) {
    // A gap: ask once for a retransmission from the expected MSN; while
    // an RNR NAK is outstanding the requester retransmits anyway.
    bool nak = !qp->seq_nak_outstanding && !qp->rnr_nak_outstanding;
    qp->seq_nak_outstanding = true;
    qp->mu.Unlock();
    if (nak) {
      r.send = true;
      r.frame = NakTo(f, NakCode::kSequence, expected);
    }
    return drop(r);
  }
  const bool duplicate_read = order == MsnOrder::kDuplicate;
  const int qp_access = qp->attr.qp_access_flags;
  switch (f.type) {
    case FrameType::kWrite:
    case FrameType::kWriteImm: {
      const bool imm = f.type == FrameType::kWriteImm;
      Mr* mr = nullptr;
      if (f.length > 0) {
        if (qp_access & IBV_ACCESS_REMOTE_WRITE) {
          mr = AcquireMr(f.rkey, qp->pd, f.remote_addr, f.length,
                         IBV_ACCESS_REMOTE_WRITE);
        }
        if (mr == nullptr) {
          qp->mu.Unlock();
          EnterError(qp, IBV_EVENT_QP_ACCESS_ERR);
          r.send = true;
          r.frame = NakTo(f, NakCode::kRemoteAccess, f.msn);
          return drop(r);
        }
      }
      RecvWqe wqe;
      if (imm) {
        if (qp->rq.empty()) {
          qp->rnr_nak_outstanding = true;
          uint8_t timer = qp->attr.min_rnr_timer;
          qp->mu.Unlock();
          if (mr != nullptr) ReleaseMr(mr);
          r.send = true;
          r.frame = NakTo(f, NakCode::kRnr, f.msn);
          r.frame.rkey = timer;
          return drop(r);
        }
        wqe = std::move(qp->rq.front());
        qp->rq.pop_front();
      }
      qp->mu.Unlock();
      bool ok = true;
      if (mr != nullptr) {
        ok = src->Read(HostAddr(mr, f.remote_addr), f.length, mr);
        ReleaseMr(mr);
      }
      if (!ok) {
        r.io_error = true;
        return r;
      }
      ferry::MutexLock lock(&qp->mu);
      qp->expected_msn = f.msn + 1;
      qp->rnr_nak_outstanding = qp->seq_nak_outstanding = false;
      if (imm) {
        DeferRecv(&r, qp.get(), wqe, f.length, f, true,
                  IBV_WC_RECV_RDMA_WITH_IMM);
      }
      r.send = true;
      r.frame = ReplyTo(FrameType::kAck, f);
      return r;
    }
    case FrameType::kSend:
    case FrameType::kSendImm: {
      if (qp->rq.empty()) {
        qp->rnr_nak_outstanding = true;
        uint8_t timer = qp->attr.min_rnr_timer;
        qp->mu.Unlock();
        r.send = true;
        r.frame = NakTo(f, NakCode::kRnr, f.msn);
        r.frame.rkey = timer;
        return drop(r);
      }
      RecvWqe wqe = std::move(qp->rq.front());
      qp->rq.pop_front();
      if (f.length > wqe.length) {
        PushRecv(qp.get(), wqe, IBV_WC_LOC_LEN_ERR, 0, f, false, IBV_WC_RECV);
        EnterErrorAndUnlock(qp);
        r.send = true;
        r.frame = NakTo(f, NakCode::kInvalidRequest, f.msn);
        return drop(r);
      }
      qp->mu.Unlock();
      bool prot_error = false;
      if (!Scatter(qp.get(), wqe, f.length, src, &prot_error)) {
        r.io_error = true;
        return r;
      }
      qp->mu.Lock();
      if (prot_error) {
        if (!qp->destroyed) {
          PushRecv(qp.get(), wqe, IBV_WC_LOC_PROT_ERR, 0, f, false,
                   IBV_WC_RECV);
        }
        EnterErrorAndUnlock(qp);
        r.send = true;
        r.frame = NakTo(f, NakCode::kRemoteOp, f.msn);
        return r;
      }
      qp->expected_msn = f.msn + 1;
      qp->rnr_nak_outstanding = qp->seq_nak_outstanding = false;
      DeferRecv(&r, qp.get(), wqe, f.length, f, f.type == FrameType::kSendImm,
                IBV_WC_RECV);
      qp->mu.Unlock();
      r.send = true;
      r.frame = ReplyTo(FrameType::kAck, f);
      return r;
    }
    case FrameType::kRead: {
      Mr* mr = nullptr;
      if (f.length > 0 && (qp_access & IBV_ACCESS_REMOTE_READ)) {
        mr = AcquireMr(f.rkey, qp->pd, f.remote_addr, f.length,
                       IBV_ACCESS_REMOTE_READ);
      }
      if (f.length > 0 && mr == nullptr) {
        qp->mu.Unlock();
        EnterError(qp, IBV_EVENT_QP_ACCESS_ERR);
        r.send = true;
        r.frame = NakTo(f, NakCode::kRemoteAccess, f.msn);
        return r;
      }
      if (!duplicate_read) {
        qp->expected_msn = f.msn + 1;
        qp->rnr_nak_outstanding = qp->seq_nak_outstanding = false;
      }
      qp->mu.Unlock();
      r.send = true;
      r.frame = ReplyTo(FrameType::kReadResp, f);
      r.frame.length = f.length;
      r.mr = mr;
      r.data = mr != nullptr ? HostAddr(mr, f.remote_addr) : nullptr;
      return r;
    }
    default:
      break;
  }
  qp->mu.Unlock();
  r.io_error = true;  // Not a request: protocol violation.
  return r;
}

void DeliverRecvCompletion(const std::shared_ptr<Qp>& qp, const Response& r) {
  if (!r.has_recv_wc) return;
  ferry::MutexLock lock(&qp->mu);
  if (!qp->destroyed) PushCompletion(qp->recv_cq, r.recv_wc, r.recv_solicited);
}

}  // namespace softrnic
