// Fuzz target: what a softrnic device takes from the network, run through
// the real code against real QPs and MRs of an in-process device (any
// bytes). Input:
//   byte 0      flags: bits 0-1 the responder MR's rights (full, no remote
//               write, no remote read, local only), bit 2 responder in RTS
//               (else RTR), bit 3 receives posted, bit 4 the requester side
//               (else the responder side)
//   requester   byte 1: work requests to post (0-7), then 3 bytes each:
//               opcode, length / 64 (two bytes)
//   then frames 40-byte headers (wire.h), each followed by the payload its
//               type carries (as much as the input has)
// The responder side parses the first frame as the HELLO the listener
// checks, then each frame as the accepted connection's thread does, and
// executes requests with ProcessRequest; the requester side hands each
// frame to HandleResponse, as a QP's response thread does with what its
// peer sends. Zero header fields are replaced by the fixture's values
// (QPN, peer QPN, rkey; a remote address below 2^32 becomes an offset into
// the MR), so inputs reach deep paths without guessing keys. Nothing may
// crash, touch memory outside the MRs (ASan), or hang.
#include <fcntl.h>
#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "transport/softrnic/connection.h"
#include "transport/softrnic/datapath.h"
#include "transport/softrnic/softrnic.h"
#include "transport/softrnic/wire.h"

namespace softrnic {
namespace {

constexpr size_t kMrBytes = 64 * 1024;

volatile uint32_t sink;  // Keeps the READ response's bytes read.

uint32_t GetBe32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
         (uint32_t{p[2]} << 8) | p[3];
}

void PutBe32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}

ibv_context* Context() {
  static ibv_context* ctx = [] {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    ibv_context* c = n > 0 ? ibv_open_device(list[0]) : nullptr;
    ibv_free_device_list(list);
    if (c == nullptr) std::abort();  // The fuzz target cannot run at all.
    // Drained after every input; must not block.
    ::fcntl(c->async_fd, F_SETFL, O_NONBLOCK);
    return c;
  }();
  return ctx;
}

// A registered heap buffer of exactly kMrBytes: ASan sees any byte outside.
struct Region {
  explicit Region(ibv_pd* pd, int access) : data(new uint8_t[kMrBytes]()) {
    mr = ibv_reg_mr(pd, data.get(), kMrBytes, access);
  }
  ~Region() {
    if (mr != nullptr) ibv_dereg_mr(mr);
  }
  std::unique_ptr<uint8_t[]> data;
  ibv_mr* mr = nullptr;
};

int Connect(ibv_qp* qp, uint32_t dest, const ibv_gid& dgid, bool rts,
            uint8_t rnr_retry) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                 IBV_QP_ACCESS_FLAGS)) {
    return rc;
  }
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dest;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 1;
  a.ah_attr.is_global = 1;
  a.ah_attr.port_num = 1;
  a.ah_attr.grh.dgid = dgid;
  if (int rc =
          ibv_modify_qp(qp, &a,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                            IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
    return rc;
  }
  if (!rts) return 0;
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 0;  // No retransmission: the fuzzer's frames are all it gets.
  a.retry_cnt = 7;
  a.rnr_retry = rnr_retry;
  a.max_rd_atomic = 1;
  return ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                           IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                           IBV_QP_MAX_QP_RD_ATOMIC);
}

// Reads frames from the input.
class Frames {
 public:
  Frames(const uint8_t* p, size_t n, uint32_t qpn, uint32_t aux, uint32_t rkey,
         uint64_t base)
      : p_(p), n_(n), qpn_(qpn), aux_(aux), rkey_(rkey), base_(base) {}

  // The next decoded header, or false (input exhausted or invalid).
  bool Next(Frame* f) {
    if (n_ < kHeaderBytes) return false;
    uint8_t h[kHeaderBytes];
    std::memcpy(h, p_, kHeaderBytes);
    p_ += kHeaderBytes;
    n_ -= kHeaderBytes;
    if (GetBe32(h + 8) == 0) PutBe32(h + 8, qpn_);
    if (GetBe32(h + 36) == 0) PutBe32(h + 36, aux_);
    if (GetBe32(h + 20) == 0) PutBe32(h + 20, rkey_);
    if (GetBe32(h + 24) == 0) {
      const uint64_t addr = base_ + GetBe32(h + 28);
      PutBe32(h + 24, static_cast<uint32_t>(addr >> 32));
      PutBe32(h + 28, static_cast<uint32_t>(addr));
    }
    return DecodeFrame(h, kMaxMsgSize, f);
  }

  // Up to `len` payload bytes, as a source.
  void Payload(uint32_t len, GatherSource* src) {
    const size_t k = std::min<size_t>(len, n_);
    src->Add(p_, k);
    p_ += k;
    n_ -= k;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  const uint32_t qpn_, aux_, rkey_;
  const uint64_t base_;
};

void ServeFrames(Device* dev, const std::shared_ptr<Qp>& qp, Frames* in) {
  Frame hello;
  if (!in->Next(&hello) || hello.type != FrameType::kHello) return;
  // From the QP's peer address, 127.0.0.1 (RunOne's dgid).
  std::shared_ptr<Qp> taken;
  if (CheckHello(dev, hello, htonl(INADDR_LOOPBACK), &taken) !=
          HelloCheck::kTake ||
      taken != qp) {
    return;
  }
  Frame f;
  while (in->Next(&f) && IsRequestFor(f, hello.qpn)) {
    GatherSource src;
    if (HasPayload(f.type)) in->Payload(f.length, &src);
    Response r = ProcessRequest(qp, f, &src);
    if (r.data != nullptr) {
      // The READ response leaves from MR memory: all of it must be inside.
      uint32_t sum = 0;
      for (uint32_t i = 0; i < r.frame.length; ++i) sum += r.data[i];
      sink = sum;
    }
    if (r.mr != nullptr) ReleaseMr(r.mr);
    if (r.io_error) break;
    DeliverRecvCompletion(qp, r);
  }
}

void RespondFrames(const std::shared_ptr<Qp>& qp, Frames* in) {
  Frame f;
  while (in->Next(&f)) {
    GatherSource src;
    if (f.type == FrameType::kReadResp) in->Payload(f.length, &src);
    bool kick = false;
    if (!HandleResponse(qp, f, &src, &kick)) break;
    if (kick) Kick(qp);
  }
}

void RunOne(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const uint8_t flags = data[0];
  ++data;
  --size;
  ibv_context* ctx = Context();
  Device* dev = reinterpret_cast<softrnic::Context*>(ctx)->dev;
  static constexpr int kRights[4] = {
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
      IBV_ACCESS_LOCAL_WRITE,
  };
  const bool requester = (flags & 16) != 0;

  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 256, nullptr, nullptr, 0);
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = 8;
  init.cap.max_recv_wr = 8;
  init.cap.max_send_sge = 2;
  init.cap.max_recv_sge = 2;
  ibv_qp* ibqp = ibv_create_qp(pd, &init);
  if (pd == nullptr || cq == nullptr || ibqp == nullptr) std::abort();
  {
    Region region(pd, kRights[flags & 3]);
    std::shared_ptr<Qp> qp = SharedQp(ibqp);
    // The peer: an address with no listener, so nothing leaves and only
    // the input answers.
    ibv_gid dgid{};
    dgid.raw[10] = dgid.raw[11] = 0xff;
    dgid.raw[12] = 127;
    dgid.raw[15] = 1;
    const uint32_t peer_qpn = 0x123456;
    const bool rts = requester || (flags & 4) != 0;
    if (Connect(ibqp, peer_qpn, dgid, rts, /*rnr_retry=*/flags >> 5) == 0) {
      if (flags & 8) {
        for (int i = 0; i < 4; ++i) {
          ibv_sge sge{reinterpret_cast<uintptr_t>(region.data.get()) +
                          i * (kMrBytes / 4),
                      static_cast<uint32_t>(kMrBytes / 4), region.mr->lkey};
          ibv_recv_wr wr{};
          wr.wr_id = 100 + i;
          wr.sg_list = &sge;
          wr.num_sge = 1;
          ibv_recv_wr* bad = nullptr;
          ibv_post_recv(ibqp, &wr, &bad);
        }
      }
      if (requester && size >= 1) {
        const int n = data[0] & 7;
        ++data;
        --size;
        for (int i = 0; i < n && size >= 3; ++i) {
          static constexpr ibv_wr_opcode kOps[5] = {
              IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_SEND,
              IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM};
          const uint32_t len = std::min<uint32_t>(
              (uint32_t{data[1]} << 8 | data[2]) * 64, kMrBytes);
          ibv_sge sge{reinterpret_cast<uintptr_t>(region.data.get()), len,
                      region.mr->lkey};
          ibv_send_wr wr{};
          wr.wr_id = i;
          wr.sg_list = &sge;
          wr.num_sge = 1;
          wr.opcode = kOps[data[0] % 5];
          wr.send_flags = (data[0] & 8) ? IBV_SEND_SIGNALED : 0;
          wr.wr.rdma.remote_addr = 0x10000;
          wr.wr.rdma.rkey = 0x77;
          ibv_send_wr* bad = nullptr;
          ibv_post_send(ibqp, &wr, &bad);
          data += 3;
          size -= 3;
        }
      }
      Frames in(data, size, ibqp->qp_num, peer_qpn, region.mr->rkey,
                reinterpret_cast<uintptr_t>(region.data.get()));
      if (requester) {
        RespondFrames(qp, &in);
      } else {
        ServeFrames(dev, qp, &in);
      }
    }
    ibv_destroy_qp(ibqp);
  }
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_async_event ev;
  while (ibv_get_async_event(ctx, &ev) == 0) ibv_ack_async_event(&ev);
}

}  // namespace
}  // namespace softrnic

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  softrnic::RunOne(data, size);
  return 0;
}
