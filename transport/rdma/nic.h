// Nic: one RDMA device context (device, PD, CQ, completion channel) and
// the port and GID Ferry uses on it. Thread-safe after Open: the GID is
// re-read on IBV_EVENT_GID_CHANGE under its own lock; the counters and
// states are atomics, written by the data path and the worker and read by
// the rail selector and Stats.
#ifndef FERRY_TRANSPORT_RDMA_NIC_H_
#define FERRY_TRANSPORT_RDMA_NIC_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "ferry/options.h"

namespace ferry::rdma {

// CQ entries per NIC (capped by the device). Every QP of the NIC shares
// the CQ, and a QP in error reports each of its posted WRs, so the data
// path keeps the WRs posted on a NIC below kCqDepth / 2 (the CQ can never
// overrun).
constexpr int kCqDepth = 1 << 16;

// Size of a NIC's probe page (Nic::RegisterProbePage).
constexpr size_t kProbePageBytes = 4096;

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
  // The GID (and its index) new connections use.
  ibv_gid gid() const {
    MutexLock lock(&gid_mu_);
    return gid_;
  }
  int gid_index() const {
    MutexLock lock(&gid_mu_);
    return gid_index_;
  }
  // Why that GID: its type and kind, or "as configured".
  std::string gid_reason() const {
    MutexLock lock(&gid_mu_);
    return gid_reason_;
  }
  // Re-reads the GID table (IBV_EVENT_GID_CHANGE): the entry asked for at
  // Open, or the best one now. Returns whether the GID changed.
  bool RefreshGid();
  uint16_t lid() const { return lid_; }
  int cq_depth() const { return cq_depth_; }
  // From ibv_query_port / ibv_query_device at Open: what QPs on this NIC
  // are set up with (never constants that fit one device).
  ibv_mtu active_mtu() const { return active_mtu_; }
  uint8_t link_layer() const { return link_layer_; }
  const ibv_device_attr& device_attr() const { return attr_; }
  // The probe page: kProbePageBytes that any peer may RDMA WRITE and READ
  // to check this rail end to end (tools/doctor --peer=SEGMENT), so that a
  // check never touches application memory. Registered by
  // RegisterProbePage (the transport does, at Install); 0/0 until then.
  // Its contents mean nothing: concurrent probes may overwrite each other.
  absl::Status RegisterProbePage();
  uint64_t probe_addr() const { return reinterpret_cast<uint64_t>(probe_); }
  uint32_t probe_rkey() const {
    return probe_mr_ != nullptr ? probe_mr_->rkey : 0;
  }

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
  std::atomic<uint64_t> work_requests{0};
  std::atomic<uint64_t> completions{0};

  // Usable for new slices: port ACTIVE and the device alive.
  bool port_active() const {
    return port_active_.load(std::memory_order_relaxed);
  }
  void set_port_active(bool up) { port_active_.store(up && !fatal()); }
  // IBV_EVENT_DEVICE_FATAL: the device is dead for the rest of the run.
  bool fatal() const { return fatal_.load(std::memory_order_acquire); }
  void set_fatal() {
    fatal_.store(true, std::memory_order_release);
    port_active_.store(false);
  }

 private:
  Nic() = default;

  std::string name_;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  void* probe_ = nullptr;
  ibv_mr* probe_mr_ = nullptr;
  mutable Mutex gid_mu_;
  ibv_gid gid_ ABSL_GUARDED_BY(gid_mu_){};
  int gid_index_ ABSL_GUARDED_BY(gid_mu_) = 0;
  std::string gid_reason_ ABSL_GUARDED_BY(gid_mu_);
  int requested_gid_index_ = -1;
  uint16_t lid_ = 0;
  int cq_depth_ = 0;
  ibv_mtu active_mtu_ = IBV_MTU_1024;
  uint8_t link_layer_ = IBV_LINK_LAYER_UNSPECIFIED;
  ibv_device_attr attr_{};
  std::atomic<bool> port_active_{true};
  std::atomic<bool> fatal_{false};
};

// The GID of port 1 to use: entry `requested` (>= 0), or on RoCE the
// best-ranked (GidScore) RoCE v2 entry, never a RoCE v1 one; elsewhere the
// best-ranked. NotFound if there is none worth using; a requested entry
// past the table is InvalidArgument, an empty one FailedPrecondition (a
// requested RoCE v1 entry is used, and `why` says what it reaches).
// `why` (optional) says which kind of entry was chosen.
absl::Status PickGid(ibv_context* ctx, int requested, ibv_gid* gid, int* index,
                     std::string* why = nullptr);

// Ranks a GID for RoCE use: routable IPv4-mapped > global IPv6 >
// link-local IPv4 > link-local IPv6; 0 for an empty entry.
int GidScore(const ibv_gid& gid);

// Lists the RDMA devices, keeping those named in `filter` (all if empty).
// NotFound with a clear message when there are none (no hardware, no
// kernel RDMA, and no softrnic on LD_LIBRARY_PATH).
absl::StatusOr<std::vector<ibv_device*>> ListDevices(
    const std::vector<std::string>& filter);

// After an ibv_reg_mr that failed with ENOMEM: if the locked-memory limit
// (RLIMIT_MEMLOCK) binds this process, what it is and how to raise it
// ("; ..."), else "". Each of `nics` devices pins its own registration.
std::string MemlockAdvice(size_t nics);

// How to raise RLIMIT_MEMLOCK, for that error and the doctor.
inline constexpr char kRaiseMemlock[] =
    "raise it: 'ulimit -l unlimited' in the shell, LimitMEMLOCK=infinity "
    "for a systemd service, '--ulimit memlock=-1' for docker, a 'memlock "
    "unlimited' line in /etc/security/limits.conf";

// RdmaOptions::gid_index, or else the environment's MC_GID_INDEX (as
// Mooncake TE reads it), or -1 (pick by type).
int EffectiveGidIndex(const RdmaOptions& options);

// The bytes an MTU enum stands for (IBV_MTU_4096: 4096).
int MtuBytes(ibv_mtu mtu);

// The IP address a GID carries (RoCE: the netdev's address), or "" for a
// GID that carries none (InfiniBand, link-local, empty).
std::string GidAddress(const ibv_gid& gid);

// The IP address behind the first ACTIVE device of `options.devices` (all
// if empty), from the GID it would use: what a host whose first RDMA NIC
// is RoCE advertises by default. NotFound if no device has one.
absl::StatusOr<std::string> FirstNicAddress(const RdmaOptions& options);

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_NIC_H_
