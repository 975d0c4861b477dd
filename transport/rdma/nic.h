// Nic: one RDMA device context (device, PD, CQ, completion channel) and
// the port and GID Ferry uses on it. Thread-compatible after Open; the
// counters are atomics, written by the data path and read by the rail
// selector and Stats.
#ifndef FERRY_TRANSPORT_RDMA_NIC_H_
#define FERRY_TRANSPORT_RDMA_NIC_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::rdma {

// CQ entries per NIC (capped by the device). Every QP of the NIC shares
// the CQ, and a QP in error reports each of its posted WRs, so the data
// path keeps the WRs posted on a NIC below kCqDepth / 2 (the CQ can never
// overrun).
constexpr int kCqDepth = 1 << 16;

class Nic {
 public:
  // Opens `dev`, checks that port 1 is ACTIVE, picks the best GID (or
  // `gid_index` if >= 0) and creates PD, completion channel and CQ.
  static absl::StatusOr<std::unique_ptr<Nic>> Open(ibv_device* dev,
                                                   int gid_index);
  ~Nic();
  Nic(const Nic&) = delete;
  Nic& operator=(const Nic&) = delete;

  const std::string& name() const { return name_; }
  ibv_context* context() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  ibv_cq* cq() const { return cq_; }
  ibv_comp_channel* channel() const { return channel_; }
  const ibv_gid& gid() const { return gid_; }
  int gid_index() const { return gid_index_; }
  uint16_t lid() const { return lid_; }
  int cq_depth() const { return cq_depth_; }
  // Work requests this NIC may have posted at once (see kCqDepth).
  uint32_t max_posted_wrs() const {
    return static_cast<uint32_t>(cq_depth_ / 2);
  }

  // Bytes of slices routed to this NIC and not yet completed (rail load).
  std::atomic<uint64_t> inflight_bytes{0};
  // WRs posted and not yet completed, bounded by max_posted_wrs().
  std::atomic<uint32_t> posted_wrs{0};
  // Counters for Stats.
  std::atomic<uint64_t> slices{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> errors{0};

  bool port_active() const {
    return port_active_.load(std::memory_order_relaxed);
  }
  void set_port_active(bool up) { port_active_.store(up); }

 private:
  Nic() = default;

  std::string name_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_gid gid_{};
  int gid_index_ = 0;
  uint16_t lid_ = 0;
  int cq_depth_ = 0;
  std::atomic<bool> port_active_{true};
};

// Ranks a GID for RoCE use: routable IPv4-mapped > global IPv6 >
// link-local IPv4 > link-local IPv6; 0 for an empty entry.
int GidScore(const ibv_gid& gid);

// Lists the RDMA devices, keeping those named in `filter` (all if empty).
// NotFound with a clear message when there are none (no hardware, no
// kernel RDMA, and no softrnic on LD_LIBRARY_PATH).
absl::StatusOr<std::vector<ibv_device*>> ListDevices(
    const std::vector<std::string>& filter);

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_NIC_H_
