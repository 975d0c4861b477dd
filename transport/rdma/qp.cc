#include "transport/rdma/qp.h"

#include <errno.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry::rdma {
namespace {

// Ferry never posts receives, so an RNR NAK cannot happen; retry forever.
constexpr uint8_t kRnrRetry = 7;

absl::Status Errno(absl::string_view what, int rc) {
  return absl::UnavailableError(
      absl::StrCat(what, ": ", std::strerror(rc != 0 ? rc : errno)));
}

}  // namespace

absl::StatusOr<ibv_qp*> CreateQp(Nic* nic, uint32_t* max_inline) {
  ibv_qp_init_attr init{};
  init.send_cq = nic->cq();
  init.recv_cq = nic->cq();
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = kSendQueueDepth;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = kWantInline;
  ibv_qp* qp = ibv_create_qp(nic->pd(), &init);
  if (qp == nullptr) {
    // Some devices refuse inline data: retry without.
    init.cap.max_inline_data = 0;
    qp = ibv_create_qp(nic->pd(), &init);
  }
  if (qp == nullptr)
    return Errno(absl::StrCat("create QP on ", nic->name()), 0);
  *max_inline = init.cap.max_inline_data;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.pkey_index = 0;
  a.qp_access_flags =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                 IBV_QP_ACCESS_FLAGS)) {
    ibv_destroy_qp(qp);
    return Errno("QP to INIT", rc);
  }
  return qp;
}

void DescribeQp(ibv_qp* qp, Nic* nic, QpInfo* info) {
  info->set_nic(nic->name());
  info->set_qpn(qp->qp_num);
  const ibv_gid gid = nic->gid();
  info->set_gid(std::string(reinterpret_cast<const char*>(gid.raw), 16));
  info->set_lid(nic->lid());
  info->set_psn(qp->qp_num & 0xffffff);
}

absl::Status ConnectQp(ibv_qp* qp, Nic* nic, const QpInfo& remote,
                       const QpTimers& timers) {
  if (remote.gid().size() != 16 || remote.qpn() > 0xffffff ||
      remote.qpn() < 2 || remote.lid() > 0xffff) {
    return absl::InvalidArgumentError("bad remote QP information");
  }
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = remote.qpn();
  a.rq_psn = remote.psn() & 0xffffff;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.port_num = 1;
  a.ah_attr.dlid = static_cast<uint16_t>(remote.lid());
  std::memcpy(a.ah_attr.grh.dgid.raw, remote.gid().data(), 16);
  a.ah_attr.grh.sgid_index = static_cast<uint8_t>(nic->gid_index());
  a.ah_attr.grh.hop_limit = 64;
  if (int rc =
          ibv_modify_qp(qp, &a,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                            IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
    return Errno("QP to RTR", rc);
  }
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = timers.timeout;
  a.retry_cnt = timers.retry_count;
  a.rnr_retry = kRnrRetry;
  a.sq_psn = qp->qp_num & 0xffffff;
  a.max_rd_atomic = 16;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                 IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                 IBV_QP_MAX_QP_RD_ATOMIC)) {
    return Errno("QP to RTS", rc);
  }
  return absl::OkStatus();
}

void FlushQp(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

}  // namespace ferry::rdma
