// Endpoint: the RC QPs of one rail -- a local NIC and one NIC of a peer
// segment -- shared by both directions, with the slices waiting for it
// (while it connects, or while its QPs are full) and the slices posted on
// it. Several QPs per endpoint let a NIC work on one rail in parallel;
// chains of slices alternate between them.
//
// Its rail's RailConnector (connector.h) decides its life; RailLifecycle
// carries that out: kConnecting until the QPs are installed, kConnected,
// then kClosing or kFailed, draining, and dropped. Any thread posts on it
// (Submit runs to completion on the caller's thread); pollers complete
// its slices. `mu` guards the QPs and the queues; the atomics are read
// without it by the rail selector, the store and the housekeeper.
#ifndef FERRY_TRANSPORT_RDMA_ENDPOINT_H_
#define FERRY_TRANSPORT_RDMA_ENDPOINT_H_

#include <infiniband/verbs.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/qp.h"
#include "transport/transport.h"

namespace ferry::rdma {

class Peer;

// The RDMA transport's use of Slice::scratch: word 0 holds the rail
// carrying the slice (plus one, so 0 is none) and its remote key, word 1
// the rails it failed on (bit per rail; rails past 63 are not recorded).
// How a slice past its deadline ends (DeadlineExceeded), wherever that is
// found: routing, posting, the housekeeper, a retry.
inline constexpr char kPastDeadline[] =
    "RDMA transfer did not complete before its deadline";

inline int SliceRail(const Slice* s) {
  return static_cast<int>(static_cast<uint32_t>(s->scratch[0])) - 1;
}
inline uint32_t SliceRkey(const Slice* s) {
  return static_cast<uint32_t>(s->scratch[0] >> 32);
}
inline void SetSliceRoute(Slice* s, int rail, uint32_t rkey) {
  s->scratch[0] = (uint64_t{rkey} << 32) | static_cast<uint32_t>(rail + 1);
}
// Whether `next` continues `s` in local and remote memory (same opcode,
// local registration and remote buffer): one work request can move both
// once they share a rail (Endpoint::PostLocked coalesces such slices).
inline bool ContinuesInMemory(const Slice* s, const Slice* next) {
  return next->op == s->op && next->local_handle == s->local_handle &&
         next->target == s->target && next->remote_buffer == s->remote_buffer &&
         static_cast<const char*>(s->local) + s->length == next->local &&
         s->remote + s->length == next->remote;
}
inline bool SliceFailedOn(const Slice* s, int rail) {
  return rail < 64 && ((s->scratch[1] >> rail) & 1);
}
inline uint64_t SliceFailedRails(const Slice* s) { return s->scratch[1]; }
inline void SetSliceFailedOn(Slice* s, int rail) {
  if (rail >= 0 && rail < 64) s->scratch[1] |= uint64_t{1} << rail;
}

// A FIFO of slices linked through Slice::next; allocation-free.
class SliceQueue {
 public:
  bool empty() const { return head_ == nullptr; }
  size_t size() const { return size_; }
  Slice* front() const { return head_; }
  // Sum of the slices' lengths (walks the queue).
  uint64_t bytes() const;
  void push_back(Slice* s);
  void push_front(Slice* s);
  Slice* pop_front();
  // Moves all of `other` to the back of this queue.
  void Append(SliceQueue* other);

 private:
  Slice* head_ = nullptr;
  Slice* tail_ = nullptr;
  size_t size_ = 0;
};

// Slices that continue each other in memory, routed to one endpoint one
// after another, are posted as one work request of at most this many
// slices and bytes (a request's 64 KiB slices on one rail become 1 MiB
// WRs, as perftest posts them). Failover, routing and completion stay per
// slice; only the WR is shared.
constexpr uint32_t kMaxCoalescedSlices = 16;
constexpr uint64_t kMaxCoalescedBytes = 1 << 20;
// Slices one completion can complete (every WR of a QP, each a group).
constexpr uint32_t kMaxCompletedSlices = kMaxOutstanding * kMaxCoalescedSlices;

// Puts the slices of a WR's group (linked through Slice::next) back at the
// front of `q`, in their order.
void PushGroupFront(Slice* group, SliceQueue* q);

// One RC QP of an endpoint and the slices posted on it, in order: WR
// wr_id = seq, and the group of slices it moves (the first, the others
// linked through Slice::next) sits at posted[seq % kMaxOutstanding] for
// seq in [head, next).
struct QueuePair {
  ibv_qp* qp = nullptr;
  uint32_t max_inline = 0;          // WRITE WRs up to this long go inline.
  uint32_t signal_every = 16;       // QpPosting::signal_every.
  ibv_mtu path_mtu = IBV_MTU_1024;  // Set by ConnectQp.
  // WRs posted at most (<= kMaxOutstanding): what the device's send queue
  // depth allows (QpCaps).
  uint32_t window = kMaxOutstanding;
  std::array<Slice*, kMaxOutstanding> posted{};
  uint64_t head = 1;
  uint64_t next = 1;
  uint32_t since_signal = 0;

  uint32_t count() const { return static_cast<uint32_t>(next - head); }
};

// Destroys QPs that set-up made but no endpoint took (a refused or
// superseded handshake); clears `qps`.
void DestroyQps(std::vector<QueuePair>* qps);

// Endpoint objects alive in this process (for leak checks in tests).
int64_t EndpointsAlive();

class Endpoint {
 public:
  enum class State : uint8_t {
    kConnecting,  // Slices queue up; the connector is at work.
    kConnected,   // QPs usable.
    kClosing,     // Evicted: no new slices; drains, then goes.
    kFailed,      // A QP failed or set-up failed: no new slices; drains.
  };

  // `off_rail`: the accepting end of a connection from this engine to its
  // own segment, which is not its rail's endpoint (the initiating end is).
  Endpoint(uint64_t id, std::shared_ptr<Peer> peer, uint64_t peer_incarnation,
           int local_nic, Nic* nic, std::string remote_nic,
           bool off_rail = false)
      : id_(id),
        peer_(std::move(peer)),
        peer_incarnation_(peer_incarnation),
        local_nic_(local_nic),
        nic_(nic),
        remote_nic_(std::move(remote_nic)),
        off_rail_(off_rail) {
    alive_.fetch_add(1, std::memory_order_relaxed);
  }
  // Destroys the QPs (they must be drained).
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  uint64_t id() const { return id_; }
  Peer* peer() const { return peer_.get(); }
  uint64_t peer_incarnation() const { return peer_incarnation_; }
  int local_nic() const { return local_nic_; }
  Nic* nic() const { return nic_; }
  const std::string& remote_nic() const { return remote_nic_; }
  bool off_rail() const { return off_rail_; }

  State state() const { return state_.load(std::memory_order_acquire); }

  // Connected, confirmed by its initiator (see `confirmed`) and without
  // slices queued or posted: what the store may evict and Close may close.
  bool Idle() const {
    return state() == State::kConnected &&
           confirmed.load(std::memory_order_acquire) &&
           busy.load(std::memory_order_acquire) == 0;
  }

  enum class PostResult {
    kDone,     // Nothing left to post, or the QPs are full (completions
               // will make room and post the rest).
    kNicFull,  // The NIC's WR budget is used up: post again once it frees.
    kRefused,  // The device refused a post: the endpoint is kFailed and
               // the unposted slices are back at the front of `waiting`.
  };
  // Posts waiting slices, oldest first, in chains of up to 32 per QP,
  // while the QPs and the NIC (Nic::max_posted_wrs) have room.
  PostResult PostLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Takes the slices that `wc` (a completion of QP `qp`) completes, in
  // order, into done[0, *n) (room for kMaxCompletedSlices): on an RC QP a
  // completion means every WR posted before it is done as well. The last
  // WR's slices are done[*last_group, *n). Returns the status of that WR
  // (the ones before it succeeded); *qp_error says
  // whether the completion was an error, which moves the endpoint to
  // kFailed -- also when it was a WR without a slice (a fence or a
  // keepalive), whose failure says nothing against the slices before it.
  ibv_wc_status CompleteLocked(int qp, const ibv_wc& wc, Slice** done,
                               uint32_t* n, uint32_t* last_group,
                               bool* qp_error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Posts a keepalive: a signaled zero-length RDMA WRITE (it touches no
  // memory; a dead peer fails it with retry-exceeded, or a NAK). False if
  // there is no room or the device refused it.
  bool PostKeepaliveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // No completion will come for what is posted: the device is dead
  // (IBV_EVENT_DEVICE_FATAL) or the QPs were destroyed (shutdown). Takes
  // every posted slice off the QPs into *out (keepalives and fences have
  // none), and returns the WRs' budget.
  void ReclaimPostedLocked(SliceQueue* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Slices posted on all QPs.
  uint32_t PostedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The housekeeper's way in: takes `mu` and returns true, or false if it
  // stayed held for a few milliseconds. A post can block (softrnic writes
  // the frames on the posting thread, and a peer that stopped reading
  // fills the socket: up to its send timeout per frame; hardware never
  // blocks there), and a housekeeper waiting behind it would enforce no
  // deadline meanwhile, on any endpoint. So it never waits long: if one
  // post held `mu` all that time and a slice on its QP -- in the chain or
  // posted before it -- is past its deadline at `now_ns`, it flushes
  // every QP of the endpoint first, which ends the post (its socket is
  // shut) and makes the poster's next chains fail at once instead of
  // blocking in turn; their slices end by their deadline as they
  // complete. The housekeeper's next round does the rest.
  bool LockUnlessPosting(int64_t now_ns)
      ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true, mu);

  // Adds `n` slices of `bytes` routed here to the endpoint's load and its
  // NIC's; Unload takes them off when they leave (completed, failed or
  // moved).
  void Load(uint32_t n, uint64_t bytes) {
    busy.fetch_add(n, std::memory_order_relaxed);
    inflight_bytes.fetch_add(bytes, std::memory_order_relaxed);
    nic_->inflight_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }
  void Unload(uint32_t n, uint64_t bytes) {
    busy.fetch_sub(n, std::memory_order_relaxed);
    inflight_bytes.fetch_sub(bytes, std::memory_order_relaxed);
    nic_->inflight_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  }
  void Unload(const SliceQueue& q) {
    Unload(static_cast<uint32_t>(q.size()), q.bytes());
  }

  void SetStateLocked(State s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    state_.store(s, std::memory_order_release);
  }

  Mutex mu;
  std::vector<QueuePair> qps ABSL_GUARDED_BY(mu);
  SliceQueue waiting ABSL_GUARDED_BY(mu);
  // Epoch of the connection (see handshake.proto).
  uint64_t epoch ABSL_GUARDED_BY(mu) = 0;
  // QPs this side accepted are usable only once the initiator says its QPs
  // can receive (a READY message): a NIC drops packets for a QP that is
  // not yet in RTR. Posting waits for it (or its deadline, the
  // connector's). Until then the endpoint is not evicted either: the
  // initiator may be about to use it. Written under `mu`; read without it
  // by the store.
  std::atomic<bool> confirmed{true};
  // Out of service (kClosing / kFailed): posted work past this is flushed
  // (the peer closed it and we drain our own use), and the QPs are kept
  // at least until drop_after_ns (we closed it: the peer drains its use).
  int64_t drain_deadline_ns ABSL_GUARDED_BY(mu) = 0;
  int64_t drop_after_ns ABSL_GUARDED_BY(mu) = 0;

  // Slices waiting or posted (the store never evicts a busy endpoint).
  std::atomic<uint32_t> busy{0};
  // Bytes of slices routed here and not completed (rail load).
  std::atomic<uint64_t> inflight_bytes{0};
  // Used since the store's hand last passed (SIEVE's visited bit).
  std::atomic<bool> used{false};
  // Drained or removed from the EndpointStore (set under its lock): it
  // never goes back to the live set, whatever a racing insert says.
  mutable std::atomic<bool> left_store{false};
  // Used since the housekeeper last looked (keepalive), and when it last
  // saw it used (housekeeper only).
  std::atomic<bool> active{true};
  int64_t last_active_ns = 0;
  // The peer's backoff generation when this endpoint was admitted
  // (ConnectBackoff::generation; set before the endpoint is shared).
  uint64_t backoff_gen = 0;
  // ClosePeer: close it as soon as it is idle.
  std::atomic<bool> close_when_idle{false};
  // The rail has errors on record: the next success clears them.
  std::atomic<bool> suspect{false};
  // A slice succeeded here (and the rail is marked proven).
  std::atomic<bool> proven{false};

 private:
  // Posts a signaled zero-length WRITE on `q`; false if refused.
  bool PostFence(QueuePair* q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The data path's ibv_post_send in progress, for LockUnlessPosting to
  // read without `mu`: 0 when none, else (d << 8) | (k + 1), d the
  // earliest deadline (in ms, rounded up) of the slices on QP k, the
  // chain's and those posted before it. One word, so it never tears.
  std::atomic<uint64_t> posting_{0};

  size_t next_qp_ ABSL_GUARDED_BY(mu) = 0;
  std::atomic<State> state_{State::kConnecting};
  const uint64_t id_;
  const std::shared_ptr<Peer> peer_;
  const uint64_t peer_incarnation_;
  const int local_nic_;
  Nic* const nic_;
  const std::string remote_nic_;
  const bool off_rail_;

  friend int64_t EndpointsAlive();
  static std::atomic<int64_t> alive_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_ENDPOINT_H_
