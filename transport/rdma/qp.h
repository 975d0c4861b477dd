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

// The RC transport timer (IB: ACK timeout 4.096 us * 2^timeout, retries).
struct QpTimers {
  uint8_t timeout = 14;
  uint8_t retry_count = 7;
};

// Creates an RC QP on `nic` (send and receive CQ: the NIC's) and moves it
// to INIT. *max_inline is the inline size the device granted.
absl::StatusOr<ibv_qp*> CreateQp(Nic* nic, uint32_t* max_inline);
// INIT -> RTR -> RTS towards `remote`; InvalidArgument if `remote` is
// malformed (it comes from the wire).
absl::Status ConnectQp(ibv_qp* qp, Nic* nic, const QpInfo& remote,
                       const QpTimers& timers);
// Fills `info` with this QP's addressing.
void DescribeQp(ibv_qp* qp, Nic* nic, QpInfo* info);
// Moves the QP to ERR: every posted WR completes with a flush error.
void FlushQp(ibv_qp* qp);

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_QP_H_
