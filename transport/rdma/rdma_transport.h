// RdmaTransport: Ferry's multi-NIC RDMA transport on libibverbs.
//
// One Nic (context, PD, CQ, completion channel) per active device. Every
// registered buffer is registered on every NIC; its handle (LocalMr) rides
// with each slice, and remote keys come from the target's SegmentView in
// O(1), so the data path does no lookup. Each slice takes the least loaded
// usable (local NIC, remote NIC) rail, preferring NICs near the buffer, so
// the slices of one request are striped over all NICs.
//
// An endpoint is a set of RC QPs on one rail, shared by both directions:
// the side that needs it first asks the peer to connect (over the peer
// service, on a connector thread, so the data path never blocks on a
// handshake); a simultaneous connect from both sides resolves to one
// endpoint (see handshake.proto). Slices for a connecting endpoint wait in
// its queue. Endpoints live in a bounded store with SIEVE eviction that
// never evicts one with work queued or in flight; an evicted endpoint is
// closed with the peer (it drains its own use first).
//
// Posting runs to completion on the submitting thread: WR chains,
// selectively signaled, small WRITEs inline, bounded per QP and per NIC.
// Completions are reaped by whichever thread polls: an application thread
// waiting for its batch (Poll), or else a worker thread (one per NIC, or
// rdma.worker_threads serving the NICs round robin), which spins briefly
// and then sleeps on the completion channels (an idle engine uses no CPU),
// and stays out of the way while application threads poll.
//
// A slice whose completion fails is retried on a rail it has not failed on;
// a rail with repeated errors is paused and probed again later, for longer
// each time; a port going down flushes its QPs at once; a peer restart
// (new incarnation) retires its endpoints; failed handshakes back off.
//
// Thread-safe as the Transport interface requires. Lock order:
// Poller::poll_mu, peers_mu_, Peer::mu, store_mu_, Endpoint::mu,
// Poller::map_mu, jobs_mu_. Sinks are called with no lock held but
// poll_mu.
//
// Implementation split by concern: rdma_transport.cc (lifecycle, memory,
// peers, stats), rdma_route.cc (rail choice, endpoints, posting),
// rdma_connect.cc (handshakes, adoption, eviction, housekeeping),
// rdma_poll.cc (workers, completions, failover).
#ifndef FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
#define FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/notification.h"
#include "common/mutex.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/local_mr.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/peer.h"
#include "transport/rdma/qp.h"
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
  absl::StatusOr<MemoryHandle> RegisterMemory(
      const MemoryRegion& region, metadata::Buffer* published) override;
  absl::Status UnregisterMemory(uintptr_t addr) override;
  size_t max_slice_bytes() const override { return options_.rdma.slice_bytes; }
  void Submit(absl::Span<Slice* const> slices) override;
  size_t Poll() override;
  void ClosePeer(const SegmentView& segment) override;
  TransportStats Stats() const override;
  void Shutdown() override;

 private:
  // Where a QP's completions go.
  struct QpRef {
    std::shared_ptr<Endpoint> ep;
    int qp = 0;
  };
  // Per NIC: its CQ's poller state and where its QPs' completions go.
  struct Poller {
    Nic* nic = nullptr;
    int index = 0;
    Mutex poll_mu;  // One thread polls the CQ at a time.
    Mutex map_mu;
    absl::flat_hash_map<uint32_t, QpRef> by_qpn ABSL_GUARDED_BY(map_mu);
    // Endpoints that had slices to post but no room in the NIC's budget.
    std::vector<std::shared_ptr<Endpoint>> starved ABSL_GUARDED_BY(map_mu);
    std::atomic<bool> any_starved{false};
  };
  // A worker thread and the NICs it serves (rdma.worker_threads).
  struct Worker {
    std::vector<Poller*> pollers;
    int index = 0;
    int wake_fd = -1;
    std::thread thread;
  };
  struct Job {
    enum class Kind { kConnect, kDisconnect };
    Kind kind;
    std::shared_ptr<Endpoint> ep;
  };

  // --- rdma_transport.cc
  absl::Status ValidateOptions() const;
  // The Peer for the segment `view` describes; null with *why set if the
  // view is from a process of that segment which has since restarted.
  std::shared_ptr<Peer> PeerForView(const SegmentView& view, absl::Status* why);
  // The Peer of segment `name`, created if needed / or null if unknown.
  std::shared_ptr<Peer> PeerNamed(const std::string& name);
  std::shared_ptr<Peer> FindPeer(const std::string& name);
  int NicIndex(absl::string_view name) const;

  // --- rdma_route.cc
  // Routes slices that share one target snapshot. `reroutes` bounds how
  // often slices bounce off endpoints that failed meanwhile.
  void RouteRun(absl::Span<Slice* const> run, absl::Time now, int reroutes);
  void RouteQueue(SliceQueue* q, absl::Time now, int reroutes);
  // The rail's endpoint, created (and its connect queued) if it has none.
  // Null with *why set while the peer is backing off after failed
  // handshakes.
  std::shared_ptr<Endpoint> RailEndpoint(const std::shared_ptr<Peer>& peer,
                                         int local,
                                         const std::string& remote_nic,
                                         absl::Status* why);
  // Inserts a new endpoint into the store and closes what it evicts.
  void StoreInsert(const std::shared_ptr<Endpoint>& ep);
  // Queues `q` on `ep` and posts what fits; slices the endpoint cannot
  // take (it failed or closed meanwhile) are routed again.
  void Enqueue(const std::shared_ptr<Endpoint>& ep, SliceQueue* q,
               uint64_t bytes, absl::Time now, int reroutes);
  // Posts ep's waiting slices; on a refused post fails the endpoint, on a
  // full NIC budget parks it with the worker.
  void PostOrPark(const std::shared_ptr<Endpoint>& ep);
  void AfterPost(const std::shared_ptr<Endpoint>& ep,
                 Endpoint::PostResult result);

  // --- rdma_connect.cc
  void QueueJob(Job job);
  void ConnectorLoop();
  void RunConnect(const std::shared_ptr<Endpoint>& ep);
  void RunDisconnect(const std::shared_ptr<Endpoint>& ep);
  absl::StatusOr<std::string> OnExchange(const std::string& from,
                                         const std::string& payload);
  absl::StatusOr<ConnectReply> OnConnect(const std::string& from,
                                         const ConnectRequest& req);
  // The rail's current endpoint a notice is about, if it comes from the
  // peer's current run (*peer is set either way).
  std::shared_ptr<Endpoint> NoticeTarget(const std::string& from,
                                         const RailNotice& n,
                                         std::shared_ptr<Peer>* peer);
  void OnReady(const std::shared_ptr<Endpoint>& ep, const RailNotice& n);
  void OnDisconnect(Peer* peer, const std::shared_ptr<Endpoint>& ep,
                    const RailNotice& n);
  absl::Status CreateQps(Nic* nic, int n, std::vector<QueuePair>* qps);
  // Installs connected QPs into a connecting endpoint, registers them for
  // completions and, if `confirmed` (the other side's QPs can receive),
  // posts its waiting slices. Returns false (and leaves the QPs to the
  // caller) if the endpoint is no longer connecting.
  bool Activate(const std::shared_ptr<Endpoint>& ep,
                std::vector<QueuePair>* qps, uint64_t epoch, bool confirmed);
  // A notice about connection `epoch` of the endpoint's rail to its peer
  // (bounded by the RPC timeout; the reply carries nothing).
  void Tell(const Endpoint& ep, RailNotice::Kind kind, uint64_t epoch);
  // Takes an evicted endpoint out of service and queues its disconnect.
  void Close(const std::shared_ptr<Endpoint>& ep);
  void HousekeeperLoop();
  void Housekeep(int64_t now_ns);

  // --- rdma_poll.cc
  void WorkerLoop(Worker* w);
  // Sleeps until an event on the worker's fds (its NICs' completion
  // channels only if `channels`) or `timeout_us`, and handles what came.
  void WaitEvents(Worker* w, int64_t timeout_us, bool channels);
  // Polls the worker's CQ once (poll_mu held); returns completions seen.
  size_t PollNicLocked(Poller* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->poll_mu);
  void HandleCompletion(Poller* p, const ibv_wc& wc);
  // No new slices; waiting ones are routed elsewhere; the endpoint leaves
  // its rail and the store. Its QPs drain (flushed if `flush`).
  void FailEndpoint(const std::shared_ptr<Endpoint>& ep,
                    const absl::Status& why, bool flush);
  // Forgets a failed or closed endpoint once nothing is posted on it.
  void DropIfDrained(const std::shared_ptr<Endpoint>& ep);
  void Retry(Slice* slice, const absl::Status& status);
  void NoteRailError(const Endpoint& ep);
  void NoteRailSuccess(Endpoint* ep);
  void OnPortChange(Poller* p, bool up);

  const TransportOptions options_;
  TransportEnv env_;
  uint64_t incarnation_ = 0;
  QpTimers timers_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_endpoint_id_{1};
  // Bumped by every Poll: application threads are reaping completions, so
  // the workers stay away.
  std::atomic<uint64_t> driver_epoch_{0};
  std::atomic<uint64_t> rotate_{0};

  std::vector<std::unique_ptr<Nic>> nics_;
  Topology topology_;
  std::vector<std::unique_ptr<Poller>> pollers_;  // One per NIC.
  std::vector<std::unique_ptr<Worker>> workers_;

  Mutex mr_mu_;
  std::map<uintptr_t, std::unique_ptr<LocalMr>> mrs_ ABSL_GUARDED_BY(mr_mu_);

  Mutex peers_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Peer>> peers_
      ABSL_GUARDED_BY(peers_mu_);

  mutable Mutex store_mu_;
  SieveCache<uint64_t, std::shared_ptr<Endpoint>> store_
      ABSL_GUARDED_BY(store_mu_);

  Mutex jobs_mu_;
  CondVar jobs_cv_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(jobs_mu_);
  std::vector<std::thread> connectors_;
  absl::Notification stop_housekeeper_;
  std::thread housekeeper_;

  std::atomic<uint64_t> connects_started_{0};
  std::atomic<uint64_t> connects_accepted_{0};
  std::atomic<uint64_t> connect_failures_{0};
  std::atomic<uint64_t> connect_races_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> retries_{0};
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
