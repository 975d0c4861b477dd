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
// housekeeping interval, 50 ms while anything is timed (an idle engine's
// housekeeper sleeps up to 250 ms and a submission wakes it: ControlPlane);
// R: the peer RPC timeout (rpc_timeout, which is the transport's
// connect_timeout, 3 s); Q: the QP retry time, 4.096 us * 2^rdma.qp_timeout *
// (rdma.qp_retry_count + 1), about 0.54 s at the defaults (14, 7); K:
// rdma.keepalive_interval, 2 s.
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
// request 16; control threads ControlPlane::kControlThreads (4: a silent peer
// holds one for up to R per handshake, so four silent peers at once delay
// others' handshakes by up to R); one connect at a time to a peer not reached
// yet, four at a time otherwise; notices to a peer that did not answer
// one are skipped for R. Threads: one worker per NIC (or
// rdma.worker_threads), the control threads, one housekeeper;
// TransportStats::threads counts them.
//
// Thread-safe as the Transport interface requires. Lock order: a NIC's
// poll_mu (Completions), then RailLifecycle's (PeerTable, Peer::mu,
// EndpointStore, Endpoint::mu), a NIC's map_mu (Completions); the
// leaves, under which no other lock is taken: ControlQueue's, MrTable's
// two and the housekeeper's. Sinks are called with no lock held but
// poll_mu. gRPC threads (RailLifecycle::OnExchange) never wait for a
// drain, a post or another RPC: what would block is queued for the
// control threads.
//
// This class is a facade: it checks the options, opens the NICs, wires
// the parts and owns their order of shutdown. The parts, each with its
// own header, state and tests, calls going one way (down the list, or
// up only through the interfaces named, and ControlPlane's two callbacks
// into RailLifecycle: RunJob and Housekeep):
//   SlicePath (slice_path.h): the data path -- routing, posting,
//     completions, failover; implements RailHost and CompletionHandler.
//   RailLifecycle (rail_lifecycle.h): peers and endpoints -- connect,
//     accept, notices, close, fail, housekeeping; runs no thread.
//   ControlPlane (control_plane.h): the control threads and the
//     housekeeper, over ControlQueue (control_queue.h, what runs next).
//   Completions (completions.h): the QP map, parked endpoints, workers
//     and async events.
//   Below them: RailConnector (connector.h, the set-up state machines),
//   handshake.h (message validation), EndpointStore, PeerTable,
//   RailRouter (rail choice), MrTable (registered memory on every NIC),
//   Nic, qp.h, and RdmaContext (what they all read).
#ifndef FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
#define FERRY_TRANSPORT_RDMA_RDMA_TRANSPORT_H_

#include <memory>

#include "absl/time/time.h"
#include "transport/gpu_staging.h"
#include "transport/rdma/completions.h"
#include "transport/rdma/control_plane.h"
#include "transport/rdma/control_queue.h"
#include "transport/rdma/mr_table.h"
#include "transport/rdma/rail_lifecycle.h"
#include "transport/rdma/rdma_context.h"
#include "transport/rdma/slice_path.h"
#include "transport/rdma/topology.h"
#include "transport/transport.h"

namespace ferry::rdma {

class RdmaTransport final : public Transport {
 public:
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
  size_t max_slice_bytes() const override {
    return ctx_.options.rdma.slice_bytes;
  }
  void Submit(absl::Span<Slice* const> slices) override;
  size_t Poll() override { return completions_.Poll(); }
  void ClosePeer(const SegmentView& segment) override {
    rails_.ClosePeer(segment.name());
  }
  TransportStats Stats() const override;
  void Shutdown() override;

 private:
  absl::Status ValidateOptions() const;
  // Opens the NICs (rdma.devices) and the topology, and describes the
  // NICs in `endpoint`.
  absl::Status OpenNics(descriptor::TransportEndpoint* endpoint);
  // Submit while some GPU memory is staged: staged slices to gpu_staging_.
  void SubmitSomeStaged(absl::Span<Slice* const> slices);

  // Declared so that each part is built after, and destroyed before, what
  // it points to: path_ only stores its pointers; the threads of
  // completions_ and control_ call path_ and rails_.
  RdmaContext ctx_;
  Topology topology_;
  ControlQueue queue_;
  SlicePath path_{&ctx_, &rails_, &completions_};
  // The QP map, the NICs' parked endpoints and the worker threads; they
  // report to path_.
  Completions completions_{
      &path_,
      {ctx_.options.rdma.worker_threads, ctx_.options.rdma.worker_cpus,
       ctx_.options.rdma.spin_polls}};
  RailLifecycle rails_{&ctx_, &completions_, &queue_, &path_};
  ControlPlane control_{&queue_};

  MrTable mrs_{ctx_.nics, topology_, ctx_.options.rdma,
               [this](int device) { return gpu_staging_->Prepare(device); }};

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
