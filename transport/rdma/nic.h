// Nic: one RDMA device context (device, PD, CQ, completion channel) and
// the port and GID Ferry uses on it. Thread-compatible after Open; the
// counters are atomics read by the rail selector.
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

constexpr int kCqDepth = 4096;

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
  uint32_t max_inline() const { return max_inline_; }

  // Bytes of slices posted on this NIC and not yet completed.
  std::atomic<uint64_t> inflight_bytes{0};
  // Errors seen; the rail is avoided while `paused_until_ns` is ahead.
  std::atomic<uint32_t> errors{0};
  std::atomic<int64_t> paused_until_ns{0};
  bool usable(int64_t now_ns) const {
    return port_active_.load() && paused_until_ns.load() <= now_ns;
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
  uint32_t max_inline_ = 0;
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
