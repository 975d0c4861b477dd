// The requester: posting, transmission in MSN order, response handling,
// retransmission after RNR NAKs and ack timeouts, and the device timer.
#include <errno.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "transport/softrnic/datapath.h"
#include "transport/softrnic/hello_auth.h"

namespace softrnic {
namespace {

constexpr int kDialTimeoutMs = 1000;
// The timer re-checks busy QPs at least this often.
constexpr auto kTimerMaxSleep = std::chrono::milliseconds(100);

ibv_wc_opcode WcOpcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    default:
      return IBV_WC_SEND;
  }
}

FrameType RequestType(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
      return FrameType::kWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return FrameType::kWriteImm;
    case IBV_WR_RDMA_READ:
      return FrameType::kRead;
    case IBV_WR_SEND_WITH_IMM:
      return FrameType::kSendImm;
    default:
      return FrameType::kSend;
  }
}

// Whole messages ride on TCP, so a message is acknowledged only after all
// of it crossed the link: the ACK timeout gets an allowance for the
// message's size at a conservative 10 MB/s on top of IB's 4.096 us *
// 2^timeout, or large messages on slow (shaped) links would time out
// while still flowing.
constexpr double kSlowestLinkBytesPerNs = 0.01;

Clock::time_point AckDeadline(const Qp& qp, const SendWqe& w,
                              Clock::time_point now)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp.mu) {
  const Clock::duration timeout = AckTimeout(qp.attr.timeout);
  if (timeout == Clock::duration::max()) return Clock::time_point::max();
  return now + timeout +
         std::chrono::nanoseconds(
             static_cast<int64_t>(w.length / kSlowestLinkBytesPerNs));
}

// Progress restarts the timer of the oldest unacknowledged WQE, as a NIC
// restarts its retransmission timer on every ACK: only a stall of a whole
// timeout counts as a lost transmission.
void RestartFrontTimer(Qp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  if (qp->sq.empty() || qp->send_index == 0) return;
  SendWqe& w = qp->sq.front();
  w.deadline = std::max(w.deadline, AckDeadline(*qp, w, Clock::now()));
}

// Fails the front WQE with `status`, moves the QP to ERR and releases
// qp->mu.
void FailFront(const std::shared_ptr<Qp>& qp, ibv_wc_status status)
    ABSL_UNLOCK_FUNCTION(qp->mu) {
  if (!qp->sq.empty()) CompleteFront(qp.get(), status);
  EnterErrorAndUnlock(qp);
}

// WQEs before `msn` are implicitly acknowledged (the responder executes
// in order), except READs, which need their data.
void CompleteBefore(Qp* qp, uint32_t msn)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  while (qp->send_index > 0 && !qp->sq.empty() &&
         static_cast<int32_t>(qp->sq.front().msn - msn) < 0 &&
         qp->sq.front().opcode != IBV_WR_RDMA_READ) {
    CompleteFront(qp, IBV_WC_SUCCESS);
  }
}

void ResponseLoop(std::shared_ptr<Qp> qp, std::shared_ptr<Connection> conn) {
  SocketSource src(conn.get());
  uint8_t hdr[kHeaderBytes];
  while (!conn->closed()) {
    Frame f;
    if (!conn->Read(hdr, sizeof(hdr)) || !DecodeFrame(hdr, kMaxMsgSize, &f)) {
      break;
    }
    if (f.type == FrameType::kChallenge) {
      // The peer's listener wants the cluster token's proof, and this
      // process has no token: the HELLO is refused.
      static std::atomic<bool> told{false};
      if (!told.exchange(true)) {
        std::fprintf(stderr,
                     "softrnic: %s: a peer's device asks for the cluster "
                     "token and this process has none (set "
                     "FERRY_AUTH_TOKEN_FILE as the peer's is)\n",
                     qp->dev->name.c_str());
      }
      break;
    }
    bool kick = false;
    if (!HandleResponse(qp, f, &src, &kick)) break;
    if (kick) Kick(qp);
  }
  conn->Close();
  // The peer closed it or it broke: release the descriptor now. The QP
  // keeps RC semantics without it: its next transmission finds no
  // connection and is lost, and the retransmission timer dials again
  // (peer alive) or ends in IBV_WC_RETRY_EXC_ERR (peer gone).
  ferry::MutexLock lock(&qp->mu);
  if (qp->conn == conn) qp->conn.reset();
}

// Opens the outgoing connection and starts its response thread.
bool Dial(const std::shared_ptr<Qp>& qp) {
  in_addr ip;
  uint16_t port;
  uint32_t dest;
  {
    ferry::MutexLock lock(&qp->mu);
    if (qp->loopback || qp->destroyed) return qp->loopback;
    if (qp->conn != nullptr && !qp->conn->closed()) return true;
    ip = qp->peer_ip;
    port = qp->peer_port;
    dest = qp->attr.dest_qp_num;
  }
  if (!qp->dev->LinkUp() || port == 0) return false;  // port 0: unroutable.
  // Under a cluster token the listener speaks first: a CHALLENGE, which
  // the HELLO answers with its proof (hello_auth.h).
  const std::string* token = ClusterToken();
  uint8_t challenge[kHeaderBytes];
  std::shared_ptr<Connection> conn =
      Dial(qp->dev, ip, port, kDialTimeoutMs,
           token != nullptr ? challenge : nullptr, kHeaderBytes);
  if (conn == nullptr) return false;
  Frame hello{};
  hello.type = FrameType::kHello;
  hello.qpn = dest;
  hello.aux = qp->qp.qp_num;
  if (qp->sgid_v1.load(std::memory_order_acquire)) hello.flags = kFlagRoceV1;
  uint8_t out[kHeaderBytes];
  uint8_t proof[kHelloProofBytes];
  iovec iov[2] = {{out, sizeof(out)}, {proof, sizeof(proof)}};
  if (token != nullptr) {
    Frame c;
    if (!DecodeFrame(challenge, kMaxMsgSize, &c) ||
        c.type != FrameType::kChallenge) {
      conn->Close();
      return false;
    }
    hello.length = kHelloProofBytes;
    EncodeFrame(hello, out);
    HelloProof(*token, challenge, out, proof);
  } else {
    EncodeFrame(hello, out);
  }
  {
    ferry::MutexLock lock(&conn->mu);
    if (!conn->WriteAll(iov, token != nullptr ? 2 : 1)) return false;
  }
  std::shared_ptr<Connection> old;
  {
    ferry::MutexLock lock(&qp->mu);
    if (qp->destroyed) {
      conn->Close();
      return false;
    }
    old = std::move(qp->conn);
    qp->conn = conn;
  }
  if (old != nullptr) old->Close();
  if (!StartThread("srnic-resp", [qp, conn] { ResponseLoop(qp, conn); })) {
    conn->Close();  // As a dial that failed: the timer tries again.
    ferry::MutexLock lock(&qp->mu);
    if (qp->conn == conn) qp->conn.reset();
    return false;
  }
  return true;
}

}  // namespace

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

void ConnectQp(const std::shared_ptr<Qp>& qp) {
  uint32_t dest;
  bool loopback;
  {
    ferry::MutexLock lock(&qp->mu);
    qp->loopback = FindDeviceByAddress(qp->peer_ip, qp->peer_port) != nullptr;
    qp->send_index = 0;
    loopback = qp->loopback;
    dest = qp->attr.dest_qp_num;
  }
  if (loopback) {
    // Found once here, so the data path needs no table lookup.
    std::shared_ptr<Qp> peer = FindQp(dest);
    ferry::MutexLock lock(&qp->mu);
    qp->loop_peer = peer;
    qp->has_loop_peer = peer != nullptr;
    return;
  }
  Dial(qp);  // If it fails, the timer dials again when there is work.
}

void DisconnectQp(const std::shared_ptr<Qp>& qp, bool also_accepted) {
  std::shared_ptr<Connection> c, a;
  {
    ferry::MutexLock lock(&qp->mu);
    c = std::move(qp->conn);
    if (also_accepted) a = std::move(qp->accepted);
  }
  if (c != nullptr) c->Close();
  if (a != nullptr) a->Close();
}

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
      ibv_wc_status st = code == NakCode::kRemoteAccess ? IBV_WC_REM_ACCESS_ERR
                         : code == NakCode::kInvalidRequest
                             ? IBV_WC_REM_INV_REQ_ERR
                             : IBV_WC_REM_OP_ERR;
      FailFront(qp, st);
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

void ScheduleTimer(const std::shared_ptr<Qp>& qp) {
  ferry::MutexLock lock(&qp->dev->timer_mu);
  if (qp->in_timer) return;
  qp->in_timer = true;
  qp->dev->timer_qps.push_back(qp);
  qp->dev->timer_cv.Signal();
}

Clock::time_point TimerWork(const std::shared_ptr<Qp>& qp,
                            Clock::time_point now) {
  bool kick = false, redial = false;
  Clock::time_point next = Clock::time_point::max();
  {
    qp->mu.Lock();
    if (qp->destroyed || qp->attr.qp_state != IBV_QPS_RTS || qp->sq.empty()) {
      qp->mu.Unlock();
      return Clock::time_point::max();
    }
    if (now < qp->rnr_until) {
      const Clock::time_point until = qp->rnr_until;
      qp->mu.Unlock();
      return until;
    }
    if (qp->retransmit_pending) {
      qp->retransmit_pending = false;
      kick = true;
    } else if (qp->send_index == 0) {
      kick = true;  // Nothing in flight yet (e.g. an RNR wait just ended).
    } else if (qp->sq.front().deadline <= now) {
      if (qp->retries_left == 0) {
        FailFront(qp, IBV_WC_RETRY_EXC_ERR);
        return Clock::time_point::max();
      }
      --qp->retries_left;
      qp->send_index = 0;  // Go back N: retransmit everything unacked.
      redial = !qp->loopback && (qp->conn == nullptr || qp->conn->closed());
      kick = true;
    } else {
      next = qp->sq.front().deadline;
    }
    qp->mu.Unlock();
  }
  if (redial) Dial(qp);
  if (kick) {
    Kick(qp);
    ferry::MutexLock lock(&qp->mu);
    if (!qp->sq.empty()) {
      next = std::min(next, qp->sq.front().deadline);
      if (qp->rnr_until > now) next = std::min(next, qp->rnr_until);
    }
  }
  return next;
}

void TimerLoop(Device* dev) {
  dev->timer_mu.Lock();
  while (true) {
    if (dev->timer_qps.empty()) {
      dev->timer_cv.Wait(&dev->timer_mu);
      continue;
    }
    std::vector<std::weak_ptr<Qp>> qps = dev->timer_qps;
    dev->timer_mu.Unlock();
    const auto now = Clock::now();
    auto next = now + kTimerMaxSleep;
    std::vector<std::shared_ptr<Qp>> idle;
    for (auto& w : qps) {
      std::shared_ptr<Qp> qp = w.lock();
      if (qp == nullptr) continue;
      auto t = TimerWork(qp, now);
      if (t == Clock::time_point::max()) {
        idle.push_back(qp);
      } else {
        next = std::min(next, t);
      }
    }
    dev->timer_mu.Lock();
    // Drop expired QPs and idle ones that gained no work meanwhile.
    auto& v = dev->timer_qps;
    size_t kept = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      std::shared_ptr<Qp> qp = v[i].lock();
      bool drop = qp == nullptr;
      if (!drop && std::find(idle.begin(), idle.end(), qp) != idle.end()) {
        ferry::MutexLock ql(&qp->mu);
        if (qp->sq.empty() || qp->destroyed ||
            qp->attr.qp_state != IBV_QPS_RTS) {
          qp->dev->timer_mu.AssertHeld();  // qp->dev is dev.
          qp->in_timer = false;
          drop = true;
        }
      }
      if (drop) continue;
      if (kept != i) v[kept] = std::move(v[i]);
      ++kept;
    }
    v.resize(kept);
    dev->timer_cv.WaitWithTimeout(&dev->timer_mu,
                                  absl::FromChrono(next - Clock::now()));
  }
}

}  // namespace softrnic
