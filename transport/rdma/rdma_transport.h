// RdmaTransport: Ferry's multi-NIC RDMA transport on libibverbs.
//
// One Nic (context, PD, CQ, channel) per active device; every registered
// buffer is registered on every NIC and found in O(log n) through an
// interval index. Each slice picks the least loaded usable (local NIC,
// remote NIC) rail, so the slices of one request are striped over all NICs.
// Endpoints (one RC QP per rail) are created on demand by a handshake
// thread over the peer service; slices for a connecting endpoint wait in
// its queue, so no data-path thread ever blocks on a handshake. One worker
// thread per NIC posts WR chains (selectively signaled, small WRITEs
// inline) and polls the CQ, spinning briefly before it sleeps on the
// completion channel. A slice whose completion fails is retried on another
// rail; a rail with repeated errors is paused; a peer restart (new
// incarnation) rebuilds its endpoints.
//
// Thread-safe as the Transport interface requires.
#ifndef FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
#define FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "transport/rdma/endpoint.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/sieve_cache.h"
#include "transport/rdma/topology.h"
#include "transport/transport.h"

namespace ferry::rdma {

class RdmaTransport final : public Transport {
 public:
  explicit RdmaTransport(const TransportOptions& options);
  ~RdmaTransport() override;

  absl::string_view name() const override { return "rdma"; }
  absl::Status Install(const TransportEnv& env,
                       metadata::TransportEndpoint* endpoint) override;
  absl::Status RegisterMemory(const MemoryRegion& region,
                              metadata::Buffer* published) override;
  absl::Status UnregisterMemory(uintptr_t addr) override;
  size_t max_slice_bytes() const override { return options_.rdma_slice_bytes; }
  void Submit(absl::Span<Slice* const> slices) override;
  void Shutdown() override;

  // Endpoints evicted from the store so far (for tests and stats).
  uint64_t evictions() const { return evictions_.load(); }

 private:
  struct LocalMr {
    size_t length;
    std::vector<ibv_mr*> mrs;  // One per NIC, in nics_ order.
    std::vector<int> tiers;    // Topology tier of each NIC for its location.
  };
  struct Worker {
    Nic* nic = nullptr;
    int index = 0;
    int wake_fd = -1;
    std::thread thread;
    std::mutex mu;
    std::deque<std::shared_ptr<Endpoint>> ready;  // Have waiting slices.
    std::unordered_map<uint32_t, std::shared_ptr<Endpoint>> by_qpn;
  };
  using EndpointKey = std::tuple<std::string, int, std::string>;

  void Route(Slice* slice);
  // The lkey covering the slice's local range on NIC `nic_index`, or none
  // if the range is not inside one registered buffer.
  // With `tiers`, also stores the buffer's topology tier per NIC.
  std::optional<uint32_t> LocalKey(const Slice* slice, int nic_index,
                                   std::vector<int>* tiers = nullptr);
  void Retry(Slice* slice, const absl::Status& status, const EndpointKey& rail);
  void Wake(Worker* w, const std::shared_ptr<Endpoint>& ep);
  void Retire(const std::shared_ptr<Endpoint>& ep);
  void HandshakeLoop();
  void Handshake(const std::shared_ptr<Endpoint>& ep);
  void FailEndpoint(const std::shared_ptr<Endpoint>& ep,
                    const absl::Status& status);
  absl::StatusOr<std::string> OnConnect(const std::string& from,
                                        const std::string& payload);
  void WorkerLoop(Worker* w);
  bool PostWaiting(const std::shared_ptr<Endpoint>& ep);
  void HandleCompletion(Worker* w, const ibv_wc& wc);

  const TransportOptions options_;
  TransportEnv env_;
  uint64_t incarnation_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> rotate_{0};
  std::atomic<uint64_t> evictions_{0};
  // Remote NICs of the last routed segment (bounds retries per slice).
  std::atomic<size_t> last_remote_count_{1};

  std::vector<std::unique_ptr<Nic>> nics_;
  Topology topology_;
  std::vector<std::unique_ptr<Worker>> workers_;

  std::shared_mutex mr_mu_;
  std::map<uintptr_t, LocalMr> mrs_;  // Guarded by mr_mu_.

  std::mutex ep_mu_;
  // Initiator endpoints, bounded by rdma_max_endpoints with SIEVE eviction.
  SieveCache<EndpointKey, std::shared_ptr<Endpoint>> endpoints_;  // ep_mu_
  // Rail health: consecutive errors and pause deadline per (peer, local
  // NIC, remote NIC), so a dead remote NIC does not condemn a local one.
  struct RailHealth {
    uint32_t errors = 0;
    int64_t paused_until_ns = 0;
    uint32_t pauses = 0;  // Consecutive pauses: the next one lasts longer.
  };
  std::map<EndpointKey, RailHealth> health_;  // ep_mu_
  // Peers whose last handshake failed: no new endpoint before retry_after.
  struct PeerBackoff {
    uint32_t failures = 0;
    int64_t retry_after_ns = 0;
    absl::Status last_error;
  };
  std::map<std::string, PeerBackoff> backoff_;  // ep_mu_
  // QPs created for peers' connects, by (peer segment, peer NIC, our NIC).
  std::map<EndpointKey, std::shared_ptr<Endpoint>> passive_;  // ep_mu_

  std::mutex hs_mu_;
  std::condition_variable hs_cv_;
  std::deque<std::shared_ptr<Endpoint>> hs_queue_;  // Guarded by hs_mu_.
  std::thread handshake_thread_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
