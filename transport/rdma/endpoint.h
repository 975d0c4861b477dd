// Endpoint: one RC QP from a local NIC to one NIC of a peer segment, with
// the slices waiting for it (while it connects) and the slices posted on it.
//
// Threads: the handshake thread moves it through kConnecting; the NIC's
// worker thread posts and completes its slices. `mu` guards the queues and
// the state.
#ifndef FERRY_TRANSPORT_RDMA_ENDPOINT_H_
#define FERRY_TRANSPORT_RDMA_ENDPOINT_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/nic.h"
#include "transport/transport.h"

namespace ferry::rdma {

// WRs in flight per QP; the send queue is twice as deep so selective
// signaling can never overflow it.
constexpr uint32_t kMaxOutstanding = 256;
constexpr uint32_t kSendQueueDepth = 2 * kMaxOutstanding;
// Every kSignalEvery-th WR (and the last of each chain) is signaled.
constexpr uint32_t kSignalEvery = 16;
static_assert(kSendQueueDepth >= kMaxOutstanding + kSignalEvery,
              "unsignaled WRs must always fit in the send queue");

// Creates an RC QP on `nic` and moves it to INIT.
absl::StatusOr<ibv_qp*> CreateQp(Nic* nic, uint32_t* max_inline);
// INIT -> RTR -> RTS towards `remote`.
absl::Status ConnectQp(ibv_qp* qp, Nic* nic, const QpInfo& remote);
// Fills `info` with this QP's addressing.
void DescribeQp(ibv_qp* qp, Nic* nic, QpInfo* info);

struct PostedSlice {
  Slice* slice;
  uint64_t seq;  // wr_id of its WR.
  uint32_t rkey;
};

class Endpoint {
 public:
  enum class State { kConnecting, kConnected, kFailed };

  Endpoint(Nic* nic, int nic_index, std::string peer_segment,
           std::string remote_nic)
      : nic_(nic),
        nic_index_(nic_index),
        peer_segment_(std::move(peer_segment)),
        remote_nic_(std::move(remote_nic)) {}
  ~Endpoint();

  Nic* nic() const { return nic_; }
  int nic_index() const { return nic_index_; }
  const std::string& peer_segment() const { return peer_segment_; }
  const std::string& remote_nic() const { return remote_nic_; }

  std::mutex mu;
  State state = State::kConnecting;
  ibv_qp* qp = nullptr;
  uint32_t max_inline = 0;
  uint64_t peer_incarnation = 0;
  std::string peer_rpc;  // Peer service address, for the handshake.
  std::deque<std::pair<Slice*, uint32_t>> waiting;  // (slice, rkey)
  std::deque<PostedSlice> posted;
  uint64_t next_seq = 1;
  uint32_t since_signal = 0;
  std::atomic<uint64_t> inflight_bytes{0};

 private:
  Nic* const nic_;
  const int nic_index_;
  const std::string peer_segment_;
  const std::string remote_nic_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_ENDPOINT_H_
