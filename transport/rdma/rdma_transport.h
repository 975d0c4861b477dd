// RdmaTransport: Ferry's multi-NIC RDMA transport on libibverbs.
//
// One Nic (context, PD, CQ, completion channel) per active device. Every
// registered buffer is registered on every NIC; its handle (LocalMr) rides
// with each slice, and remote keys come from the target's SegmentView in
// O(1), so the data path does no lookup. Each slice takes the least loaded
// usable (local NIC, remote NIC) rail, preferring NICs near the buffer, so
// the slices of one request are striped over all NICs.
//
// An endpoint is a set of RC QPs on one rail, shared by both directions.
// Each rail's connection set-up is a state machine (RailConnector,
// connector.h) that decides and that this class executes: the side that
// needs a rail first asks the peer to connect (over the PeerChannel, on a
// control thread, so the data path never blocks on a handshake); a
// simultaneous connect from both sides resolves to one endpoint (see
// handshake.proto). Slices for a connecting endpoint wait in its queue.
// Endpoints live in a bounded store (endpoint_store.h) that never evicts
// one with work queued or in flight; an evicted endpoint is closed with
// the peer. Peer records live in a bounded table (peer.h).
//
// Posting runs to completion on the submitting thread: WR chains,
// selectively signaled, small WRITEs inline, bounded per QP and per NIC.
// Completions are reaped by whichever thread polls: an application thread
// waiting for its batch (Poll), or else a worker thread (one per NIC, or
// rdma.worker_threads serving the NICs round robin), which spins briefly
// and then sleeps on the completion channels and the devices' async-event
// fds (an idle engine uses no CPU), and stays out of the way while
// application threads poll.
//
// FAILURE MODEL -- what a request sees for each fault, and how quickly.
// T: EngineOptions::transfer_timeout (each slice's deadline); H: the
// housekeeping interval, 50 ms; R: the peer RPC timeout (rpc_timeout, which
// is the transport's connect_timeout, 3 s); Q: the QP retry time, 4.096 us
// * 2^rdma.qp_timeout * (rdma.qp_retry_count + 1), about 0.54 s at the
// defaults (14, 7); K: rdma.keepalive_interval, 2 s.
//
//   * Every request ends, COMPLETED, FAILED or TIMEOUT, by T + H plus the
//     time to flush a QP and reap the flush (a few ms): slices waiting on
//     an endpoint (connecting, or full) are failed by the housekeeper at
//     their deadline, and a QP whose oldest posted slice is past its
//     deadline is flushed -- a posted slice ends only when the NIC says it
//     is done with the memory, so the caller may free it at once. A post
//     that blocks (softrnic's, when the peer stopped reading) holds the
//     housekeeper up a few ms at most: past a deadline it flushes the
//     endpoint's QPs, which ends the post (Endpoint::LockUnlessPosting),
//     and slices past their deadline by then are not posted to the next
//     rail. rdma_fault_test checks T + 1 s for each fault below.
//   * Peer killed: its QPs stop answering, posted WRs fail after Q
//     (softrnic: at once, the connection is refused) and are retried on
//     other rails; new handshakes are refused (see "unreachable"). FAILED
//     with Unavailable, or TIMEOUT.
//   * Peer stopped (SIGSTOP) or its link black-holed: posted WRs fail
//     after Q and are retried; handshakes wait up to R, and the slices
//     waiting on them end at T: TIMEOUT (DeadlineExceeded, with the last
//     error).
//   * Peer unreachable or refusing: the handshakes of the first contact
//     fail (Unavailable, naming the peer and the cause); then the peer is
//     backed off, 50 ms doubling to 1.6 s, with one probe handshake at a
//     time after that: meanwhile requests fail at once with
//     "RDMA peer 'name' unreachable (retrying in N ms): <cause>", counted
//     in TransportStats::fast_failures. No retry loop runs inside the
//     transport: a slice is tried at most max(rdma.max_attempts, rails)
//     times.
//   * Local port down (IBV_EVENT_PORT_ERR): the NIC's QPs are flushed at
//     once and their slices move to other NICs; with none left, requests
//     fail at once: Unavailable "no usable RDMA rail".
//   * Local device fatal (IBV_EVENT_DEVICE_FATAL): like a port down, and
//     the NIC is out of service for the rest of the run
//     (NicStats::fatal); its posted slices are taken back and retried
//     elsewhere (a dead device moves no more bytes).
//   * GID change (IBV_EVENT_GID_CHANGE): the GID is read again; connections
//     made afterwards use it (existing ones fail if the old address stops
//     working, and are made again).
//   * Peer restarted: its endpoints are failed as soon as its new
//     incarnation is seen (its descriptor, request or reply); requests
//     with the old descriptor fail with FailedPrecondition ("RefreshSegment
//     and resubmit"), which makes the engine fetch the new one.
//   * Peer died with idle endpoints (e.g. a killed initiator): an endpoint
//     idle for K is probed with a zero-length RDMA WRITE; a dead peer fails
//     it, and the endpoint, its QPs (and softrnic's sockets) are gone
//     within K + H + Q.
//   * Remote access error (a bad or stale key, an unregistered range):
//     InvalidArgument; one more rail is tried; the rail's health is not
//     charged.
//   * A peer's control messages are validated completely (handshake.h)
//     before use; a bad one is refused with InvalidArgument and changes
//     nothing.
//   * Endpoint evicted, or ClosePeer: the peer is told (DISCONNECT) and
//     answers at once; it stops using the connection, moves what waited on
//     it to a new one and lets its posted work drain (flushed after R / 2);
//     we keep our QPs that long, or drop them at once if the peer had
//     nothing posted. No slice fails because of a close. An engine that
//     shuts down sends the DISCONNECTs already queued (for up to 200 ms)
//     and no others: its peers' keepalives find the rest within K + H + Q.
//
// LIMITS (defaults): endpoints rdma.max_endpoints (4096; busy ones are
// never evicted, so the store may exceed it until they are idle -- a
// READY and the housekeeper trim it; closed and failed ones count until
// their QPs are gone); peer records rdma.max_peers (1024; ones with
// endpoints are never dropped); rails per peer 64 x 64; QPs per connect
// request 16; control threads kControlThreads (4: a silent peer holds one
// for up to R per handshake, so four silent peers at once delay others'
// handshakes by up to R); one connect at a time to a peer not reached
// yet, four at a time otherwise; notices to a peer that did not answer
// one are skipped for R. Threads: one worker per NIC (or
// rdma.worker_threads), the control threads, one housekeeper;
// TransportStats::threads counts them.
//
// Thread-safe as the Transport interface requires. Lock order:
// a NIC's poll_mu (Completions), PeerTable (peers), Peer::mu,
// EndpointStore, Endpoint::mu, a NIC's map_mu (Completions); the leaves, under
// which no other lock is taken: ControlQueue's, MrTable's two and
// housekeeper_mu_. Sinks are called with no lock held but poll_mu. gRPC threads
// (OnExchange) never wait for a drain, a post or another RPC: what would block
// is queued for the control threads.
//
// Implementation split by concern. Parts with their own state, lock and
// tests: connector.{h,cc} (the set-up state machines, no threads),
// handshake.{h,cc} (message validation), control_queue.{h,cc} (the
// control threads' jobs and their admission, no threads), completions.{h,cc}
// (the QP map, endpoints parked for a NIC's budget, the worker threads and
// async events; it reports to this class, never the other way),
// mr_table.{h,cc} (registered memory on every NIC), endpoint_store.{h,cc},
// peer.{h,cc} (peer records and table), rail_router.h (rail choice). This class
// wires them and runs the threads; its members are defined by concern in
// rdma_transport.cc (lifecycle, peers, stats), rdma_route.cc (rail
// choice, endpoints, posting), rdma_connect.cc (executing the connectors'
// actions, the initiating handshake), rdma_accept.cc (the accepting
// handshake, on gRPC threads), rdma_close.cc (notices and closes),
// rdma_housekeep.cc (deadlines, keepalive) and rdma_poll.cc (workers,
// completions, failover, async events).
#ifndef FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
#define FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "transport/gpu_staging.h"
#include "transport/rdma/completions.h"
#include "transport/rdma/connector.h"
#include "transport/rdma/control_queue.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/endpoint_store.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/local_mr.h"
#include "transport/rdma/mr_table.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/peer.h"
#include "transport/rdma/qp.h"
#include "transport/rdma/topology.h"
#include "transport/transport.h"

namespace ferry::rdma {

class RdmaTransport final : public Transport, private CompletionHandler {
 public:
  // Threads running handshakes, notices and closes (never the data path).
  static constexpr int kControlThreads = 4;
  // How long Shutdown lets queued notices (DISCONNECTs of closed
  // endpoints) go out.
  static constexpr absl::Duration kFarewell = absl::Milliseconds(200);

  explicit RdmaTransport(const TransportOptions& options);
  ~RdmaTransport() override;

  absl::string_view name() const override { return "rdma"; }
  absl::Status Install(const TransportEnv& env,
                       descriptor::TransportEndpoint* endpoint) override;
  absl::StatusOr<MemoryHandle> RegisterMemory(
      const MemoryRegion& region, descriptor::Buffer* published) override;
  absl::Status UnregisterMemory(uintptr_t addr) override;
  size_t max_slice_bytes() const override { return options_.rdma.slice_bytes; }
  void Submit(absl::Span<Slice* const> slices) override;
  size_t Poll() override;
  void ClosePeer(const SegmentView& segment) override;
  TransportStats Stats() const override;
  void Shutdown() override;

 private:
  using EndpointPtr = std::shared_ptr<Endpoint>;
  using Actions = RailConnector::Actions;

  using Job = ControlJob;

  // --- rdma_transport.cc
  absl::Status ValidateOptions() const;
  // The Peer for the segment `view` describes; null with *why set if the
  // view is from a process of that segment which has since restarted.
  std::shared_ptr<Peer> PeerForView(const SegmentView& view, absl::Status* why);
  std::shared_ptr<Peer> MakePeer(const std::string& name);
  int NicIndex(absl::string_view name) const;
  int ThreadsRunning() const;

  // --- rdma_route.cc
  // Routes slices that share one target snapshot. `reroutes` bounds how
  // often slices bounce off endpoints that failed meanwhile.
  void RouteRun(absl::Span<Slice* const> run, absl::Time now, int reroutes);
  // Submit while some GPU memory is staged: staged slices to gpu_staging_.
  void SubmitSomeStaged(absl::Span<Slice* const> slices);
  void RouteQueue(SliceQueue* q, absl::Time now, int reroutes);
  // The rail's endpoint, created (and its connect queued) if it has none.
  // Null with *why set while the peer is backing off after failed
  // handshakes.
  EndpointPtr RailEndpoint(const std::shared_ptr<Peer>& peer, int local,
                           const std::string& remote_nic, absl::Status* why);
  // Inserts a new endpoint into the store and closes what it evicts.
  void StoreInsert(const EndpointPtr& ep);
  // Brings the store back within rdma.max_endpoints once endpoints that
  // were busy or unconfirmed at the last insert are idle (a READY came,
  // or at housekeeping), closing what it evicts.
  void TrimStore();
  // Queues `q` on `ep` and posts what fits; slices the endpoint cannot
  // take (it failed or closed meanwhile) are routed again.
  void Enqueue(const EndpointPtr& ep, SliceQueue* q, uint64_t bytes,
               absl::Time now, int reroutes);
  // Posts ep's waiting slices; on a refused post fails the endpoint, on a
  // full NIC budget parks it with the worker.
  void PostOrPark(const EndpointPtr& ep);
  void AfterPost(const EndpointPtr& ep, Endpoint::PostResult result);

  // --- rdma_connect.cc
  void QueueJob(Job job) { control_.Push(std::move(job)); }
  void ControlLoop();
  void RunConnect(const EndpointPtr& ep, uint64_t attempt, uint64_t epoch);
  void RunNotice(const Job& job);
  absl::StatusOr<std::string> OnExchange(const std::string& from,
                                         const std::string& payload);
  absl::StatusOr<ConnectReply> OnConnect(const std::string& from,
                                         const ConnectRequest& req);
  // A connect from this engine to its own segment: the accepting end is a
  // separate endpoint, off the rail (adopting would join a QP to itself).
  absl::StatusOr<ConnectReply> AcceptSelf(const ConnectRequest& req, int local);
  RailNoticeReply OnNotice(const std::string& from, const RailNotice& n);
  absl::Status CreateQps(Nic* nic, int n, std::vector<QueuePair>* qps);
  // Executes what a rail's connector decided. Under the peer's lock:
  // keeps the rail's endpoint in step with the connector (`created`: an
  // endpoint made for this step, if any) and moves endpoints' states; the
  // rest -- posting, failing, RPCs -- is left in *later for RunLater,
  // after the lock. `qps`: the connected QPs of a kActivate.
  struct Later {
    std::vector<Job> jobs;
    std::vector<std::pair<EndpointPtr, absl::Status>> fails;
    std::vector<EndpointPtr> flush;  // Of `fails`: flush their QPs.
    std::vector<EndpointPtr> posts;
    bool activated = false;
    bool trim = false;  // An endpoint was confirmed: it may be evicted now.
  };
  void ApplyLocked(Peer* peer, Peer::Rail* rail, const Actions& acts,
                   const EndpointPtr& created, std::vector<QueuePair>* qps,
                   Later* later) ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer->mu);
  // `inline_ok`: the caller may fail endpoints and post on this thread (a
  // control thread); otherwise (a gRPC thread) that is queued.
  void RunLater(Later* later, bool inline_ok);
  // Installs connected QPs into `ep` (state kConnected) and registers them
  // for completions; false (QPs left to the caller) if `ep` is no longer
  // connecting.
  bool InstallLocked(const EndpointPtr& ep, std::vector<QueuePair>* qps,
                     uint64_t epoch, bool confirmed);
  Job NoticeJob(Peer* peer, const Endpoint& ep, RailNotice::Kind kind,
                uint64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer->mu);
  // Takes an idle endpoint out of service and tells the peer (`evicted`:
  // by the store, counted; else by ClosePeer). Returns false if it was not
  // idle.
  bool Close(const EndpointPtr& ep, bool evicted);
  // The peer closed `ep`'s connection: no new slices, waiting ones go
  // elsewhere, posted ones drain (flushed at the drain deadline).
  void CloseForPeer(const EndpointPtr& ep);
  void HousekeeperLoop();
  void Housekeep(int64_t now_ns);

  // --- rdma_poll.cc: what the completion side reports (completions.h).
  void OnCompletion(const QpRef& ref, const ibv_wc& wc) override;
  void PostParked(const EndpointPtr& ep) override { PostOrPark(ep); }
  void OnPortChange(int nic, bool up) override;
  void OnDeviceFatal(int nic) override;
  // No new slices; waiting ones are routed elsewhere; the endpoint leaves
  // its rail (its connector is told) and the store's live set. Its QPs
  // drain (flushed if `flush`). The peer is told (DISCONNECT) if the
  // connection was up, unless !tell_peer (it no longer answers).
  void FailEndpoint(const EndpointPtr& ep, const absl::Status& why, bool flush,
                    bool tell_peer = true);
  // Forgets a failed or closed endpoint once nothing is posted on it and
  // its linger time passed.
  void DropIfDrained(const EndpointPtr& ep);
  void Retry(Slice* slice, const absl::Status& status);
  void NoteRailError(const Endpoint& ep);
  void NoteRailSuccess(Endpoint* ep);

  const TransportOptions options_;
  TransportEnv env_;
  // env_.clock: every deadline, back-off, pause, linger and keepalive of
  // the transport is read from it (set by Install, before any thread).
  Clock* clock_ = RealClock();
  uint64_t incarnation_ = 0;
  QpTimers timers_;
  const QpPosting posting_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_endpoint_id_{1};
  std::atomic<uint64_t> rotate_{0};

  std::vector<std::unique_ptr<Nic>> nics_;
  Topology topology_;
  // The QP map, the NICs' parked endpoints and the worker threads.
  Completions completions_{
      this,
      {options_.rdma.worker_threads, options_.rdma.worker_cpus,
       options_.rdma.spin_polls}};

  MrTable mrs_{nics_, topology_, options_.rdma,
               [this](int device) { return gpu_staging_->Prepare(device); }};

  PeerTable peers_;
  EndpointStore store_;

  ControlQueue control_;
  std::vector<std::thread> control_threads_;
  // The housekeeper's timed wait is on clock_, so a simulated clock drives
  // it (an absl::Notification's timeout would be real time).
  Mutex housekeeper_mu_;
  CondVar housekeeper_cv_;
  bool stop_housekeeper_ ABSL_GUARDED_BY(housekeeper_mu_) = false;
  std::thread housekeeper_;

  std::atomic<uint64_t> connects_started_{0};
  std::atomic<uint64_t> connects_accepted_{0};
  std::atomic<uint64_t> connect_failures_{0};
  std::atomic<uint64_t> connect_races_{0};
  std::atomic<uint64_t> evictions_{0};
  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> fast_failures_{0};

  // Staged slices go back through Submit as host memory, their buffers
  // registered as host memory is.
  struct StagedPath final : StagingPath {
    explicit StagedPath(RdmaTransport* t) : transport(t) {}
    void SubmitStaged(Slice* slice) override {
      transport->Submit(absl::MakeConstSpan(&slice, 1));
    }
    absl::StatusOr<MemoryHandle> RegisterStagingBuffer(uint8_t* buffer,
                                                       size_t bytes) override;
    void UnregisterStagingBuffer(uint8_t* buffer) override;
    RdmaTransport* transport;
  };
  StagedPath staging_path_{this};
  // Last: destroyed first, while what it unregisters from is alive.
  std::unique_ptr<GpuStaging> gpu_staging_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
