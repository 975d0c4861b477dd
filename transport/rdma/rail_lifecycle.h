// RailLifecycle: the RDMA transport's peers and endpoints, from the
// first need of a rail to the drop of its drained QPs -- connect, accept,
// notices, close, fail, keepalive and deadlines.
//
// Every decision about a rail's connection is its connector's
// (connector.h), taken under the Peer's lock; this class executes it:
// ApplyLocked changes what must change with it atomically (the rail's
// endpoint, an endpoint's state and QPs) and leaves the rest -- posting,
// failing endpoints, RPCs -- to RunLater, after the lock. Handshakes and
// notices are jobs in the ControlQueue, which the control plane's threads
// hand back to RunJob; a peer's messages come in through OnExchange (on
// gRPC threads, which never wait for a drain, a post or another RPC:
// what would block is queued). Nothing here starts a thread, so the whole
// lifecycle of two engines' rails is tested on one thread
// (rail_lifecycle_test.cc).
//
// It calls the data path only through RailHost, for slices an endpoint
// gives back. Parts below it: PeerTable and EndpointStore (which it owns),
// Completions (QPs registered and parked endpoints) and ControlQueue.
//
// Thread-safe. Lock order: PeerTable, Peer::mu, EndpointStore,
// Endpoint::mu; callers may hold a NIC's poll_mu (a completion), and
// below these only a NIC's map_mu (Completions) and ControlQueue's are
// taken. RailHost is called with none of these held (a NIC's poll_mu may
// be).
#ifndef FERRY_TRANSPORT_RDMA_RAIL_LIFECYCLE_H_
#define FERRY_TRANSPORT_RDMA_RAIL_LIFECYCLE_H_

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/rdma/completions.h"
#include "transport/rdma/connector.h"
#include "transport/rdma/control_queue.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/endpoint_store.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/peer.h"
#include "transport/rdma/rdma_context.h"
#include "transport/segment_view.h"

namespace ferry::rdma {

// What the lifecycle hands back to the data path. Called with none of the
// lifecycle's locks held (a NIC's poll_mu may be, from a completion).
class RailHost {
 public:
  virtual ~RailHost() = default;
  // `slice` ran on (or waited for) an endpoint that failed: it is tried
  // on another rail, or completed with `why` if its tries or its time
  // are used up.
  virtual void Retry(Slice* slice, const absl::Status& why) = 0;
  // Slices that never ran, from an endpoint the peer closed: routed
  // again, no try charged.
  virtual void Reroute(SliceQueue* slices) = 0;
};

class RailLifecycle {
 public:
  using EndpointPtr = std::shared_ptr<Endpoint>;

  // Every pointer outlives this object; `context` is filled (Install)
  // before any other call.
  RailLifecycle(RdmaContext* context, Completions* completions,
                ControlQueue* control, RailHost* host);
  RailLifecycle(const RailLifecycle&) = delete;
  RailLifecycle& operator=(const RailLifecycle&) = delete;

  // --- The data path (rail_lifecycle.cc).
  // The Peer for the segment `view` describes; null with *why set if the
  // view is from a process of that segment which has since restarted
  // (the peer's endpoints of a run the view proves gone are failed).
  std::shared_ptr<Peer> PeerForView(const SegmentView& view, absl::Status* why);
  // The rail's endpoint, created (and its connect queued) if it has none.
  // Null with *why set while the peer is backing off after failed
  // handshakes, or while this rail is paused after its connect failed
  // (then *rail_paused is set, when given: other rails may take the
  // slices).
  EndpointPtr RailEndpoint(const std::shared_ptr<Peer>& peer, int local,
                           const std::string& remote_nic, absl::Status* why,
                           bool* rail_paused = nullptr);
  // Posts ep's waiting slices; on a refused post fails the endpoint, on a
  // full NIC budget parks it with the completion side.
  void PostOrPark(const EndpointPtr& ep);
  void AfterPost(const EndpointPtr& ep, Endpoint::PostResult result);
  // Closes the peer's endpoints: idle ones now, busy ones when idle; no
  // slice fails.
  void ClosePeer(const std::string& name);

  // --- The completion side (rail_close.cc, rail_lifecycle.cc).
  // No new slices; waiting ones go to RailHost::Retry; the endpoint leaves
  // its rail (its connector is told) and the store's live set. Its QPs
  // drain (flushed if `flush`). The peer is told (DISCONNECT) if the
  // connection was up, unless !tell_peer (it no longer answers).
  void FailEndpoint(const EndpointPtr& ep, const absl::Status& why, bool flush,
                    bool tell_peer = true);
  // Forgets a failed or closed endpoint once nothing is posted on it and
  // its linger time passed.
  void DropIfDrained(const EndpointPtr& ep);
  // A slice failed on `ep`'s rail (the rail is paused after repeated
  // errors), or one succeeded on a suspect or new rail.
  void NoteRailError(const Endpoint& ep);
  void NoteRailSuccess(Endpoint* ep);
  // NIC `nic`'s port went down: its endpoints fail, their QPs flushed.
  void PortDown(int nic, const absl::Status& why);
  // NIC `nic` is dead: its endpoints fail and their posted slices are
  // taken back and retried (it reports no more completions).
  void DeviceDead(int nic, const absl::Status& why);

  // --- The control plane (rail_lifecycle.cc; the jobs in rail_connect.cc,
  // rail_close.cc; housekeeping in rail_housekeep.cc).
  // Runs a job from the ControlQueue (on a control thread, or a test's).
  void RunJob(const ControlJob& job);
  // One round of housekeeping at `now_ns`: slices' deadlines on
  // endpoints, the connectors' deadlines, keepalive probes, closes when
  // idle, drops of drained endpoints, the store's and the table's bounds.
  // Returns how soon the next round is due: zero while anything timed is
  // under way (a slice on an endpoint, a handshake, a drain, a close);
  // else a quarter of the keepalive interval (an idle connection's probe
  // is due at most that late).
  absl::Duration Housekeep(int64_t now_ns);

  // --- A peer's messages (rail_accept.cc), on gRPC threads.
  absl::StatusOr<std::string> OnExchange(const std::string& from,
                                         const std::string& payload);

  // --- Shutdown and stats.
  // Every endpoint the store and the peer table hold; both are emptied.
  std::vector<EndpointPtr> TakeAll();
  size_t endpoints() const { return store_.size(); }
  size_t peers() const { return peers_.size(); }

 private:
  using Actions = RailConnector::Actions;
  using Job = ControlJob;

  std::shared_ptr<Peer> MakePeer(const std::string& name);
  // Inserts a new endpoint into the store and closes what it evicts.
  void StoreInsert(const EndpointPtr& ep);
  // Brings the store back within rdma.max_endpoints once endpoints that
  // were busy or unconfirmed at the last insert are idle (a READY came,
  // or at housekeeping), closing what it evicts.
  void TrimStore();

  // rail_connect.cc
  void RunConnect(const EndpointPtr& ep, uint64_t attempt, uint64_t epoch);
  absl::Status CreateQps(Nic* nic, int n, std::vector<QueuePair>* qps);
  // What ApplyLocked leaves for after the peer's lock. `qps`: the
  // connected QPs of a kActivate.
  struct Later {
    std::vector<Job> jobs;
    std::vector<std::pair<EndpointPtr, absl::Status>> fails;
    std::vector<EndpointPtr> flush;  // Of `fails`: flush their QPs.
    std::vector<EndpointPtr> posts;
    bool activated = false;
    bool trim = false;  // An endpoint was confirmed: it may be evicted now.
  };
  // Executes what a rail's connector decided. Under the peer's lock:
  // keeps the rail's endpoint in step with the connector (`created`: an
  // endpoint made for this step, if any) and moves endpoints' states; the
  // rest is left in *later for RunLater.
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

  // rail_accept.cc
  absl::StatusOr<ConnectReply> OnConnect(const std::string& from,
                                         const ConnectRequest& req);
  // A connect from this engine to its own segment: the accepting end is a
  // separate endpoint, off the rail (adopting would join a QP to itself).
  absl::StatusOr<ConnectReply> AcceptSelf(const ConnectRequest& req, int local);
  RailNoticeReply OnNotice(const std::string& from, const RailNotice& n);

  // rail_close.cc
  Job NoticeJob(Peer* peer, const Endpoint& ep, RailNotice::Kind kind,
                uint64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(peer->mu);
  void RunNotice(const Job& job);
  // Takes an idle endpoint out of service and tells the peer (`evicted`:
  // by the store, counted; else by ClosePeer). Returns false if it was not
  // idle.
  bool Close(const EndpointPtr& ep, bool evicted);
  // The peer closed `ep`'s connection: no new slices, waiting ones go
  // elsewhere, posted ones drain (flushed at the drain deadline).
  void CloseForPeer(const EndpointPtr& ep);

  RdmaContext* const ctx_;
  Completions* const completions_;
  ControlQueue* const control_;
  RailHost* const host_;
  std::atomic<uint64_t> next_endpoint_id_{1};
  PeerTable peers_;
  EndpointStore store_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_RAIL_LIFECYCLE_H_
