// Verbs set-up of Ferry's RC QPs: creation (to INIT), connection (RTR,
// RTS) with exactly the attribute masks each transition needs (as
// rdma-core's rc_pingpong), and the addressing a peer needs to connect.
#ifndef FERRY_TRANSPORT_RDMA_QP_H_
#define FERRY_TRANSPORT_RDMA_QP_H_

#include <infiniband/verbs.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/nic.h"

namespace ferry::rdma {

// WRs in flight per QP; the send queue is twice as deep so selective
// signaling can never overflow it.
constexpr uint32_t kMaxOutstanding = 256;
constexpr uint32_t kSendQueueDepth = 2 * kMaxOutstanding;
// Every kSignalEvery-th WR (and the last of each chain) is signaled.
constexpr uint32_t kSignalEvery = 16;
static_assert(kSendQueueDepth >= kMaxOutstanding + kSignalEvery,
              "unsignaled WRs must always fit in the send queue");
// Inline data asked for at creation (devices may grant less, or none).
constexpr uint32_t kWantInline = 64;

// What a QP is connected with: the RC transport timer (IB: ACK timeout
// 4.096 us * 2^timeout, retries) and the addressing of its packets
// (RdmaOptions).
struct QpTimers {
  uint8_t timeout = 14;
  uint8_t retry_count = 7;
  uint8_t traffic_class = 106;
  uint8_t service_level = 0;
  uint8_t hop_limit = 64;
  uint32_t flow_label = 0;
};

// What the device granted a new QP (ibv_create_qp may give more than asked,
// or less where the device's limits are lower).
struct QpCaps {
  uint32_t max_inline = 0;  // Inline bytes per WR.
  uint32_t window = 0;      // WRs the data path may have posted at once.
};

// Creates an RC QP on `nic` (send and receive CQ: the NIC's) and moves it
// to INIT. Its send queue is kSendQueueDepth deep, or what the device's
// max_qp_wr allows (the window shrinks to match); ResourceExhausted if the
// device cannot hold a window of at least one signaled chain.
absl::StatusOr<ibv_qp*> CreateQp(Nic* nic, QpCaps* caps);
// INIT -> RTR -> RTS towards `remote`, with the path MTU the smaller of
// both ports' active MTUs and the READ depth both devices allow;
// InvalidArgument if `remote` is malformed (it comes from the wire).
absl::Status ConnectQp(ibv_qp* qp, Nic* nic, const QpInfo& remote,
                       const QpTimers& timers);
// The READs this side accepts in flight as responder: the device's
// max_qp_rd_atom (at least 1, at most 255).
uint8_t ResponderDepth(const Nic& nic);
// Fills `info` with this QP's addressing.
void DescribeQp(ibv_qp* qp, Nic* nic, QpInfo* info);
// Moves the QP to ERR: every posted WR completes with a flush error.
void FlushQp(ibv_qp* qp);

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_QP_H_
