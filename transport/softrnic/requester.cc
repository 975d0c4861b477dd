// The requester's posting and transmission: work requests are checked and
// queued at post time, and Kick sends every WQE not yet sent, in MSN order,
// over the QP's connection or straight to a same-process peer.
#include "transport/softrnic/requester.h"

#include <errno.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <thread>

#include "transport/softrnic/datapath.h"
#include "transport/softrnic/wire_verbs.h"

namespace softrnic {

int PostSend(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  if (Dead(ibqp->context)) {
    *bad_wr = wr;
    return EIO;
  }
  std::shared_ptr<Qp> qp = SharedQp(ibqp);
  int err = 0;
  {
    HeldMrs held;  // Post-time lkey checks, one acquire per key per chain.
    ferry::MutexLock lock(&qp->mu);
    for (; wr != nullptr; wr = wr->next) {
      const ibv_qp_state st = qp->attr.qp_state;
      if (st == IBV_QPS_ERR) {
        ibv_wc wc{};
        wc.wr_id = wr->wr_id;
        wc.status = IBV_WC_WR_FLUSH_ERR;
        wc.opcode = WcOpcode(wr->opcode);
        wc.qp_num = qp->qp.qp_num;
        PushCompletion(qp->send_cq, wc);
        continue;
      }
      if (st != IBV_QPS_RTS) {
        err = EINVAL;
        break;
      }
      if (wr->opcode != IBV_WR_RDMA_WRITE &&
          wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM &&
          wr->opcode != IBV_WR_SEND && wr->opcode != IBV_WR_SEND_WITH_IMM &&
          wr->opcode != IBV_WR_RDMA_READ) {
        err = EINVAL;
        break;
      }
      if (wr->num_sge < 0 ||
          static_cast<uint32_t>(wr->num_sge) > qp->cap.max_send_sge) {
        err = EINVAL;
        break;
      }
      if (qp->sq.size() + qp->done_unsignaled >= qp->cap.max_send_wr ||
          qp->sq.size() >= qp->cap.max_send_wr) {
        err = ENOMEM;
        break;
      }
      uint64_t total = 0;
      for (int i = 0; i < wr->num_sge; ++i) total += wr->sg_list[i].length;
      if (total > kMaxMsgSize) {
        err = EINVAL;
        break;
      }
      const bool is_read = wr->opcode == IBV_WR_RDMA_READ;
      const bool is_inline = (wr->send_flags & IBV_SEND_INLINE) != 0;
      if (is_inline && (is_read || total > qp->cap.max_inline_data)) {
        err = EINVAL;
        break;
      }
      SendWqe& w = qp->sq.push_back();
      w.wr_id = wr->wr_id;
      w.opcode = wr->opcode;
      w.signaled = (wr->send_flags & IBV_SEND_SIGNALED) != 0;
      w.solicited = (wr->send_flags & IBV_SEND_SOLICITED) != 0;
      w.length = static_cast<uint32_t>(total);
      if (wr->opcode != IBV_WR_SEND && wr->opcode != IBV_WR_SEND_WITH_IMM) {
        w.remote_addr = wr->wr.rdma.remote_addr;
        w.rkey = wr->wr.rdma.rkey;
      }
      if (wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ||
          wr->opcode == IBV_WR_SEND_WITH_IMM) {
        w.imm = wr->imm_data;
      }
      if (is_inline) {
        // The application may reuse the buffer as soon as we return.
        w.is_inline = true;
        size_t off = 0;
        for (int i = 0; i < wr->num_sge; ++i) {
          std::memcpy(w.inline_data + off,
                      reinterpret_cast<const void*>(wr->sg_list[i].addr),
                      wr->sg_list[i].length);
          off += wr->sg_list[i].length;
        }
      } else {
        held.MakeRoom();
        for (int i = 0; i < wr->num_sge; ++i) {
          const ibv_sge& s = wr->sg_list[i];
          if (s.length == 0) continue;
          if (held.Get(s.lkey, qp->pd, s.addr, s.length,
                       is_read ? IBV_ACCESS_LOCAL_WRITE : 0) == nullptr) {
            w.local_error = true;
          }
          w.sges[w.num_sge++] = {s.addr, s.length, s.lkey};
        }
      }
      w.msn = qp->next_msn++;
    }
  }
  if (err != 0) *bad_wr = wr;
  Kick(qp);
  return err;
}

int PostRecv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  if (Dead(ibqp->context)) {
    *bad_wr = wr;
    return EIO;
  }
  auto* qp = reinterpret_cast<Qp*>(ibqp);
  ferry::MutexLock lock(&qp->mu);
  for (; wr != nullptr; wr = wr->next) {
    const ibv_qp_state st = qp->attr.qp_state;
    if (st == IBV_QPS_RESET) {
      *bad_wr = wr;
      return EINVAL;
    }
    if (st == IBV_QPS_ERR) {
      ibv_wc wc{};
      wc.wr_id = wr->wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = qp->qp.qp_num;
      PushCompletion(qp->recv_cq, wc);
      continue;
    }
    if (wr->num_sge < 0 ||
        static_cast<uint32_t>(wr->num_sge) > qp->cap.max_recv_sge) {
      *bad_wr = wr;
      return EINVAL;
    }
    if (qp->rq.size() >= qp->cap.max_recv_wr) {
      *bad_wr = wr;
      return ENOMEM;
    }
    RecvWqe r;
    r.wr_id = wr->wr_id;
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; ++i) {
      const ibv_sge& s = wr->sg_list[i];
      r.sges.push_back({s.addr, s.length, s.lkey});
      total += s.length;
    }
    r.length = static_cast<uint32_t>(std::min<uint64_t>(total, kMaxMsgSize));
    qp->rq.push_back(std::move(r));
  }
  return 0;
}

void Kick(const std::shared_ptr<Qp>& qp) {
  ferry::MutexLock send_lock(&qp->send_mu);
  // Same-process peers: execute whole batches directly; whatever the
  // batch path declines (errors, SENDs, faults, delays) goes the general
  // way below, frame by frame.
  if (ExecuteLoopback(qp)) return;
  while (true) {
    Frame f{};
    std::array<uint8_t, kMaxInline> inline_copy;
    iovec iov[kMaxSge + 1];
    int niov = 0;
    Mr* held[kMaxSge];
    int nheld = 0;
    std::shared_ptr<Connection> conn;
    std::shared_ptr<Qp> peer;
    bool loopback, has_loop_peer;
    {
      qp->mu.Lock();
      const auto now = Clock::now();
      if (qp->destroyed || qp->attr.qp_state != IBV_QPS_RTS ||
          now < qp->rnr_until || qp->send_index >= qp->sq.size()) {
        qp->mu.Unlock();
        break;
      }
      SendWqe& w = qp->sq[qp->send_index];
      if (w.local_error) {
        // Only the front can fail: earlier WQEs complete first, in order.
        if (qp->send_index != 0) {
          qp->mu.Unlock();
          break;
        }
        FailFront(qp, IBV_WC_LOC_PROT_ERR);
        return;
      }
      f.type = RequestType(w.opcode);
      f.flags = w.solicited ? kFlagSolicited : 0;
      f.qpn = qp->attr.dest_qp_num;
      f.msn = w.msn;
      f.length = w.length;
      f.rkey = w.rkey;
      f.remote_addr = w.remote_addr;
      f.imm = w.imm;
      iov[niov++] = {nullptr, kHeaderBytes};
      if (w.opcode != IBV_WR_RDMA_READ) {
        if (w.is_inline) {
          std::memcpy(inline_copy.data(), w.inline_data, w.length);
          if (w.length > 0) iov[niov++] = {inline_copy.data(), w.length};
        } else {
          for (uint32_t i = 0; i < w.num_sge; ++i) {
            const Sge& s = w.sges[i];
            Mr* mr = AcquireMr(s.lkey, qp->pd, s.addr, s.length, 0);
            if (mr == nullptr) {  // Deregistered after posting.
              for (int k = 0; k < nheld; ++k) ReleaseMr(held[k]);
              nheld = 0;
              w.local_error = true;
              break;
            }
            held[nheld++] = mr;
            iov[niov++] = {HostAddr(mr, s.addr), s.length};
          }
          if (w.local_error) {
            qp->mu.Unlock();
            continue;
          }
        }
      }
      w.deadline = AckDeadline(*qp, w, now);
      ++qp->send_index;
      loopback = qp->loopback;
      has_loop_peer = qp->has_loop_peer;
      conn = qp->conn;
      // Only this thread (under send_mu) writes requests to `conn`, so its
      // byte count is where this frame will start.
      // (Not when the write below is skipped: a frame never written must
      // not pass for one queued in the connection.)
      w.wire_conn = 0;
      if (!loopback && conn != nullptr && !conn->closed() &&
          qp->dev->LinkUp()) {
        uint64_t frame = 0;
        for (int i = 0; i < niov; ++i) frame += iov[i].iov_len;
        w.wire_end = conn->bytes_written() + frame;
        w.wire_conn = conn->id();
      }
      if (loopback) {
        peer = has_loop_peer ? qp->loop_peer.lock() : nullptr;
      }
      qp->mu.Unlock();
    }
    if (loopback) {
      if (peer == nullptr && !has_loop_peer) peer = FindQp(f.qpn);
      if (uint32_t us = qp->dev->delay_us.load(std::memory_order_relaxed);
          us > 0) {
        // Injected delay applies in-process too, as on the wire.
        std::this_thread::sleep_for(std::chrono::microseconds(us));
      }
      // A QP drops packets of the other RoCE version.
      if (peer != nullptr && qp->dev->LinkUp() && peer->dev->LinkUp() &&
          peer->sgid_v1.load(std::memory_order_acquire) ==
              qp->sgid_v1.load(std::memory_order_acquire)) {
        GatherSource src;
        for (int i = 1; i < niov; ++i) {
          src.Add(static_cast<const uint8_t*>(iov[i].iov_base), iov[i].iov_len);
        }
        Response r = ProcessRequest(peer, f, &src);
        if (r.send) {
          GatherSource rsrc;
          if (r.data != nullptr) rsrc.Add(r.data, r.frame.length);
          bool kick = false;
          HandleResponse(qp, r.frame, &rsrc, &kick);
        }
        if (r.mr != nullptr) ReleaseMr(r.mr);
        DeliverRecvCompletion(peer, r);
      }
      // Otherwise the request is lost; the ack timeout retries it.
    } else if (conn != nullptr && !conn->closed() && qp->dev->LinkUp()) {
      uint8_t hdr[kHeaderBytes];
      EncodeFrame(f, hdr);
      iov[0].iov_base = hdr;
      ferry::MutexLock lock(&conn->mu);
      conn->WriteAll(iov, niov, held, nheld);
    }
    for (int k = 0; k < nheld; ++k) ReleaseMr(held[k]);
  }
  // Unacknowledged work needs the retransmission timer.
  bool need_timer;
  {
    ferry::MutexLock lock(&qp->mu);
    need_timer =
        !qp->destroyed && qp->attr.qp_state == IBV_QPS_RTS && !qp->sq.empty();
  }
  if (need_timer) ScheduleTimer(qp);
}

}  // namespace softrnic
