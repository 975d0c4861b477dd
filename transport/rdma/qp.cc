#include "transport/rdma/qp.h"

#include <errno.h>

#include <algorithm>
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

uint8_t ResponderDepth(const Nic& nic) {
  return static_cast<uint8_t>(
      std::clamp(nic.device_attr().max_qp_rd_atom, 1, 255));
}

absl::StatusOr<ibv_qp*> CreateQp(Nic* nic, const QpPosting& posting,
                                 QpCaps* caps) {
  const ibv_device_attr& dev = nic->device_attr();
  const uint32_t depth = std::min<uint32_t>(
      kSendQueueDepth, static_cast<uint32_t>(std::max(dev.max_qp_wr, 0)));
  const uint32_t unsignaled = posting.signal_every;
  if (depth < 2 * unsignaled) {
    return absl::ResourceExhaustedError(absl::StrCat(
        nic->name(), ": max_qp_wr ", dev.max_qp_wr, " is below the ",
        2 * unsignaled, " WRs a QP needs (a signaled run and room for it)"));
  }
  ibv_qp_init_attr init{};
  ibv_qp* qp = nullptr;
  uint32_t want = posting.inline_bytes;
  for (;;) {
    init = {};
    init.send_cq = nic->cq();
    init.recv_cq = nic->cq();
    init.qp_type = IBV_QPT_RC;
    init.cap = {depth, 1, 1, 1, want};
    qp = ibv_create_qp(nic->pd(), &init);
    // Devices refuse inline data above their limit (some refuse any) with
    // EINVAL; other errors (no memory, too many QPs) would not go away.
    if (qp != nullptr || want == 0 || errno != EINVAL) break;
    want /= 2;
  }
  if (qp == nullptr)
    return Errno(absl::StrCat("create QP on ", nic->name()), 0);
  // The device may grant more inline bytes than asked: use only what was
  // asked, so inline_bytes means what it says. The send queue it granted
  // (>= asked) holds a run of unsignaled WRs beside the window.
  caps->max_inline = std::min(want, init.cap.max_inline_data);
  caps->window = std::min(kMaxOutstanding,
                          std::max(init.cap.max_send_wr, depth) - unsignaled);
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
  info->set_mtu(nic->active_mtu());
  info->set_max_rd_atomic(ResponderDepth(*nic));
}

absl::Status ConnectQp(ibv_qp* qp, Nic* nic, const QpInfo& remote,
                       const QpTimers& timers, ibv_mtu* path_mtu) {
  if (remote.gid().size() != 16 || remote.qpn() > 0xffffff ||
      remote.qpn() < 2 || remote.lid() > 0xffff) {
    return absl::InvalidArgumentError("bad remote QP information");
  }
  if (remote.mtu() > IBV_MTU_4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad remote MTU enum ", remote.mtu()));
  }
  if (remote.max_rd_atomic() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad remote max_rd_atomic ", remote.max_rd_atomic()));
  }
  // Both ports must carry every packet: the smaller active MTU (a RoCE
  // port on a 1500-byte netdev is at 1024; hard-coding 4096 fails there).
  const ibv_mtu mtu =
      remote.mtu() == 0
          ? nic->active_mtu()
          : std::min(nic->active_mtu(), static_cast<ibv_mtu>(remote.mtu()));
  const bool roce = nic->link_layer() == IBV_LINK_LAYER_ETHERNET;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = mtu;
  if (path_mtu != nullptr) *path_mtu = mtu;
  a.dest_qp_num = remote.qpn();
  a.rq_psn = remote.psn() & 0xffffff;
  a.max_dest_rd_atomic = ResponderDepth(*nic);
  a.min_rnr_timer = 12;
  // RoCE routes by GID (a GRH on every packet); InfiniBand within a subnet
  // by LID, with no GRH, unless the peer has no LID.
  a.ah_attr.is_global = roce || remote.lid() == 0 ? 1 : 0;
  a.ah_attr.port_num = 1;
  a.ah_attr.dlid = static_cast<uint16_t>(remote.lid());
  a.ah_attr.sl = timers.service_level;
  if (a.ah_attr.is_global) {
    std::memcpy(a.ah_attr.grh.dgid.raw, remote.gid().data(), 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(nic->gid_index());
    a.ah_attr.grh.hop_limit = timers.hop_limit;
    a.ah_attr.grh.traffic_class = timers.traffic_class;
    a.ah_attr.grh.flow_label = timers.flow_label;
  }
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
  // As initiator: no more READs in flight than our device issues and the
  // peer's QP accepts.
  const int peer_depth = remote.max_rd_atomic() == 0
                             ? 16
                             : static_cast<int>(remote.max_rd_atomic());
  a.max_rd_atomic = static_cast<uint8_t>(std::clamp(
      std::min(nic->device_attr().max_qp_init_rd_atom, peer_depth), 1, 255));
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
