// The responder: accepts peers' connections and executes their requests on
// local memory, checking keys, bounds and access rights first.
#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "transport/softrnic/datapath.h"

namespace softrnic {
namespace {

constexpr int kHelloTimeoutSec = 10;

Frame Reply(FrameType type, const Frame& req) {
  Frame r{};
  r.type = type;
  r.qpn = req.qpn;
  r.msn = req.msn;
  return r;
}

Frame Nak(const Frame& req, NakCode code, uint32_t msn) {
  Frame r = Reply(FrameType::kNak, req);
  r.msn = msn;
  r.aux = static_cast<uint32_t>(code);
  return r;
}

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
      return src->Read(nullptr, left);
    }
    bool ok = src->Read(HostAddr(mr, s.addr), k);
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
    if (payload > 0 && !src->Read(nullptr, payload)) resp.io_error = true;
    return resp;
  };
  qp->mu.Lock();
  const ibv_qp_state st = qp->attr.qp_state;
  if (qp->destroyed || (st != IBV_QPS_RTR && st != IBV_QPS_RTS)) {
    qp->mu.Unlock();
    return drop(r);  // A real responder silently drops these too.
  }
  if (f.msn != qp->expected_msn) {
    const uint32_t expected = qp->expected_msn;
    if (static_cast<int32_t>(f.msn - expected) < 0) {
      // Duplicate of an executed request (a retransmission): acknowledge
      // again without re-executing, except READ, which is idempotent.
      if (f.type != FrameType::kRead) {
        qp->mu.Unlock();
        r.send = true;
        r.frame = Reply(FrameType::kAck, f);
        return drop(r);
      }
    } else {
      // A gap: ask once for a retransmission from the expected MSN; while
      // an RNR NAK is outstanding the requester retransmits anyway.
      bool nak = !qp->seq_nak_outstanding && !qp->rnr_nak_outstanding;
      qp->seq_nak_outstanding = true;
      qp->mu.Unlock();
      if (nak) {
        r.send = true;
        r.frame = Nak(f, NakCode::kSequence, expected);
      }
      return drop(r);
    }
  }
  const bool duplicate_read = f.msn != qp->expected_msn;
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
          r.frame = Nak(f, NakCode::kRemoteAccess, f.msn);
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
          r.frame = Nak(f, NakCode::kRnr, f.msn);
          r.frame.rkey = timer;
          return drop(r);
        }
        wqe = std::move(qp->rq.front());
        qp->rq.pop_front();
      }
      qp->mu.Unlock();
      bool ok = true;
      if (mr != nullptr) {
        ok = src->Read(HostAddr(mr, f.remote_addr), f.length);
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
      r.frame = Reply(FrameType::kAck, f);
      return r;
    }
    case FrameType::kSend:
    case FrameType::kSendImm: {
      if (qp->rq.empty()) {
        qp->rnr_nak_outstanding = true;
        uint8_t timer = qp->attr.min_rnr_timer;
        qp->mu.Unlock();
        r.send = true;
        r.frame = Nak(f, NakCode::kRnr, f.msn);
        r.frame.rkey = timer;
        return drop(r);
      }
      RecvWqe wqe = std::move(qp->rq.front());
      qp->rq.pop_front();
      if (f.length > wqe.length) {
        PushRecv(qp.get(), wqe, IBV_WC_LOC_LEN_ERR, 0, f, false, IBV_WC_RECV);
        qp->mu.Unlock();
        EnterError(qp, -1);
        r.send = true;
        r.frame = Nak(f, NakCode::kInvalidRequest, f.msn);
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
        qp->mu.Unlock();
        EnterError(qp, -1);
        r.send = true;
        r.frame = Nak(f, NakCode::kRemoteOp, f.msn);
        return r;
      }
      qp->expected_msn = f.msn + 1;
      qp->rnr_nak_outstanding = qp->seq_nak_outstanding = false;
      DeferRecv(&r, qp.get(), wqe, f.length, f, f.type == FrameType::kSendImm,
                IBV_WC_RECV);
      qp->mu.Unlock();
      r.send = true;
      r.frame = Reply(FrameType::kAck, f);
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
        r.frame = Nak(f, NakCode::kRemoteAccess, f.msn);
        return r;
      }
      if (!duplicate_read) {
        qp->expected_msn = f.msn + 1;
        qp->rnr_nak_outstanding = qp->seq_nak_outstanding = false;
      }
      qp->mu.Unlock();
      r.send = true;
      r.frame = Reply(FrameType::kReadResp, f);
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
namespace {

void ServeConnection(Device* dev, int fd) {
  auto conn = std::make_shared<Connection>(dev, fd);
  Track(dev, conn);
  timeval tv{kHelloTimeoutSec, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  uint8_t hdr[kHeaderBytes];
  Frame hello;
  if (!ReadFully(fd, hdr, sizeof(hdr)) ||
      !DecodeFrame(hdr, kMaxMsgSize, &hello) ||
      hello.type != FrameType::kHello) {
    conn->Close();
    return;
  }
  std::shared_ptr<Qp> qp = FindQp(hello.qpn);
  if (qp == nullptr || qp->dev != dev) {
    uint8_t out[kHeaderBytes];
    EncodeFrame(Nak(hello, NakCode::kNoQp, 0), out);
    iovec iov{out, sizeof(out)};
    ferry::MutexLock lock(&conn->mu);
    conn->WriteAll(&iov, 1);
    conn->Close();
    return;
  }
  tv = {0, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  {
    uint8_t out[kHeaderBytes];
    EncodeFrame(Reply(FrameType::kHelloAck, hello), out);
    iovec iov{out, sizeof(out)};
    ferry::MutexLock lock(&conn->mu);
    if (!conn->WriteAll(&iov, 1)) return;
  }
  SocketSource src(fd);
  while (!conn->closed()) {
    Frame f;
    if (!ReadFully(fd, hdr, sizeof(hdr)) ||
        !DecodeFrame(hdr, kMaxMsgSize, &f) || f.qpn != hello.qpn) {
      break;
    }
    if (f.type != FrameType::kSend && f.type != FrameType::kSendImm &&
        f.type != FrameType::kWrite && f.type != FrameType::kWriteImm &&
        f.type != FrameType::kRead) {
      break;
    }
    if (!dev->LinkUp()) break;
    Response r = ProcessRequest(qp, f, &src);
    if (r.io_error) {
      if (r.mr != nullptr) ReleaseMr(r.mr);
      break;
    }
    if (!r.send) {
      DeliverRecvCompletion(qp, r);
      continue;
    }
    uint8_t out[kHeaderBytes];
    EncodeFrame(r.frame, out);
    iovec iov[2] = {{out, sizeof(out)},
                    {const_cast<uint8_t*>(r.data), r.frame.length}};
    bool ok;
    {
      ferry::MutexLock lock(&conn->mu);
      ok = conn->WriteAll(iov, r.data != nullptr ? 2 : 1);
    }
    if (r.mr != nullptr) ReleaseMr(r.mr);
    DeliverRecvCompletion(qp, r);
    if (!ok) break;
  }
  conn->Close();
}

}  // namespace

void AcceptLoop(Device* dev, int listen_fd) {
  while (true) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE ||
          errno == ENFILE) {
        if (errno == EMFILE || errno == ENFILE) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        continue;
      }
      return;
    }
    if (!dev->LinkUp()) {
      ::close(fd);  // A port that is down answers nothing.
      continue;
    }
    TuneSocket(fd);
    std::thread([dev, fd] { ServeConnection(dev, fd); }).detach();
  }
}

}  // namespace softrnic
