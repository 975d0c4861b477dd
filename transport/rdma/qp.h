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
// WRs posted with one ibv_post_send. The last WR of a chain is always
// signaled, so a signaling interval above this is never reached.
constexpr uint32_t kMaxChain = 32;
static_assert(kSendQueueDepth >= kMaxOutstanding + kMaxChain,
              "unsignaled WRs must always fit in the send queue");

// How a QP's WRs are posted (RdmaOptions::signal_every, inline_bytes).
struct QpPosting {
  // Every signal_every-th WR (and the last of each chain) is signaled;
  // 1..kMaxChain.
  uint32_t signal_every = 16;
  // WRITE WRs up to this many bytes go inline, within what the device
  // grants; 0: none.
  uint32_t inline_bytes = 64;
};

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
  // Inline bytes per WR: the smaller of what was asked and what the device
  // granted (devices may round up; Ferry inlines only what it asked for).
  uint32_t max_inline = 0;
  uint32_t window = 0;  // WRs the data path may have posted at once.
};

// Creates an RC QP on `nic` (send and receive CQ: the NIC's) and moves it
// to INIT. Its send queue is kSendQueueDepth deep, or what the device's
// max_qp_wr allows (the window shrinks to match); ResourceExhausted if the
// device cannot hold a window of at least one signaled run beside a run
// of `posting.signal_every` unsignaled WRs. Asks for
// `posting.inline_bytes` of inline data, halving the ask while the device
// refuses it (devices state their limit only by refusing).
absl::StatusOr<ibv_qp*> CreateQp(Nic* nic, const QpPosting& posting,
                                 QpCaps* caps);
// INIT -> RTR -> RTS towards `remote`, with the path MTU the smaller of
// both ports' active MTUs (stored in `*path_mtu` if not null) and the
// READ depth both devices allow; InvalidArgument if `remote` is malformed
// (it comes from the wire).
absl::Status ConnectQp(ibv_qp* qp, Nic* nic, const QpInfo& remote,
                       const QpTimers& timers, ibv_mtu* path_mtu = nullptr);
// The READs this side accepts in flight as responder: the device's
// max_qp_rd_atom (at least 1, at most 255).
uint8_t ResponderDepth(const Nic& nic);
// Fills `info` with this QP's addressing.
void DescribeQp(ibv_qp* qp, Nic* nic, QpInfo* info);
// Moves the QP to ERR: every posted WR completes with a flush error.
void FlushQp(ibv_qp* qp);

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_QP_H_
