// The RDMA transport's control plane queue: the work that the data path
// and gRPC threads hand off so that they never wait for a handshake, an
// RPC, a drain or a post -- connects, notices to peers, closes the peer
// asked for, endpoint failures and deferred posts.
//
// It decides what runs next: the oldest job that may. A connect waits
// while its peer already has as many running as it may -- one until the
// peer has been reached, kMaxConnectsPerPeer after -- so that an
// unreachable peer holds one control thread, not one per rail. Once the
// farewell began (Shutdown), only the notices already queued still go out
// (a peer learns at once that its connections are closed), until the
// farewell's deadline.
//
// It runs no thread: ControlPlane's threads (or a test) call Take and Done.
// So the choice is tested without threads (control_queue_test.cc).
// Thread-safe. Lock order: after every lock of the transport (nothing is
// called under mu_).
#ifndef FERRY_TRANSPORT_RDMA_CONTROL_QUEUE_H_
#define FERRY_TRANSPORT_RDMA_CONTROL_QUEUE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/peer.h"

namespace ferry::rdma {

// One piece of work for a control thread.
struct ControlJob {
  enum class Kind {
    kConnect,  // Send attempt `attempt` of `ep` claiming `epoch`.
    kNotice,   // Tell `peer` `notice` about connection `epoch` of the rail
               // (`local`, `remote_nic`), of its run `incarnation` (a
               // DISCONNECT of ours: `ep`, dropped early if the peer had
               // nothing posted).
    kClose,    // The peer closed `ep`'s connection: drain and drop it.
    kFail,     // Fail `ep` with `why` (flush if `flush`).
    kPost,     // `ep` may send: post what waits.
  };
  Kind kind = Kind::kConnect;
  std::shared_ptr<Endpoint> ep;
  std::shared_ptr<Peer> peer;
  uint64_t attempt = 0;
  uint64_t epoch = 0;
  RailNotice::Kind notice = RailNotice::READY;
  int local = 0;
  std::string remote_nic;
  uint64_t incarnation = 0;
  absl::Status why;
  bool flush = false;
};

class ControlQueue {
 public:
  // Connects running at once to one peer that has been reached.
  static constexpr int kMaxConnectsPerPeer = 4;

  ControlQueue() = default;
  ControlQueue(const ControlQueue&) = delete;
  ControlQueue& operator=(const ControlQueue&) = delete;

  // The clock of the farewell's deadline. Before any Take.
  void SetClock(Clock* clock) { clock_ = clock; }

  // Queues `job`; a connect's `ep` must be set (its peer is what limits it).
  void Push(ControlJob job);

  // The oldest job that may run now, marked running (see Done); waits for
  // one. nullopt when the calling control thread should exit: the farewell
  // has its deadline and no notice is left, or the deadline passed.
  std::optional<ControlJob> Take();
  // Take without waiting: nullopt also when no job may run now, with
  // *over telling the two apart.
  std::optional<ControlJob> TryTake(bool* over);
  // A job from Take ended: a connect frees its place for its peer.
  void Done(const ControlJob& job);

  // Shutdown: from now on only notices run, until `deadline`. With an
  // infinite one (while peer requests in progress may still queue a
  // notice) the threads wait for more; once it is finite they exit when
  // none is left.
  void BeginFarewell(absl::Time deadline);
  // After the control threads are gone: the endpoints of the jobs that
  // never ran (the queue is emptied).
  std::vector<std::shared_ptr<Endpoint>> TakeEndpoints();

  // Jobs queued, and connects running to `peer` (for tests).
  size_t size() const;
  int connects_running(const Peer* peer) const;

 private:
  // Takes the job Take would (mu_ held); nullopt with *over set when the
  // caller should exit.
  std::optional<ControlJob> TakeLocked(bool* over)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool MayStartConnectLocked(const Peer* peer) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* clock_ = RealClock();
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<ControlJob> jobs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<const Peer*, int> connects_running_ ABSL_GUARDED_BY(mu_);
  bool farewell_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time farewell_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_CONTROL_QUEUE_H_
