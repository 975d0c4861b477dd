#include "transport/rdma/endpoint.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/time/time.h"
#include "transport/rdma/local_mr.h"

namespace ferry::rdma {

void DestroyQps(std::vector<QueuePair>* qps) {
  for (QueuePair& q : *qps) {
    if (q.qp != nullptr) ibv_destroy_qp(q.qp);
  }
  qps->clear();
}
namespace {

// Whether `next` continues `s` in both local and remote memory, with the
// same keys and opcode: one work request can move both.
bool Adjacent(const Slice* s, const Slice* next) {
  return ContinuesInMemory(s, next) && SliceRkey(next) == SliceRkey(s);
}

// The deadline of the oldest slice posted on `q` (null entries are fences
// and keepalives); InfiniteFuture if none.
absl::Time OldestPostedDeadline(const QueuePair& q) {
  for (uint64_t seq = q.head; seq < q.next; ++seq) {
    if (const Slice* s = q.posted[seq % kMaxOutstanding]; s != nullptr) {
      return s->deadline;
    }
  }
  return absl::InfiniteFuture();
}

// Endpoint::posting_'s word for a post on QP `k` (below 16:
// rdma.qps_per_endpoint is at most 16) whose slices' earliest deadline is
// `deadline_ns`.
uint64_t PostingWord(size_t k, int64_t deadline_ns) {
  constexpr uint64_t kMaxMs = (uint64_t{1} << 56) - 1;
  const uint64_t ms =
      deadline_ns <= 0
          ? 0
          : std::min<uint64_t>(
                kMaxMs,
                (static_cast<uint64_t>(deadline_ns) + 999999) / 1000000);
  return (ms << 8) | (k + 1);
}

// How long the housekeeper tries an endpoint's lock before it leaves the
// endpoint to its next round (and flushes a post that held it throughout
// past a deadline). Bounds its round at this per endpoint held that long.
constexpr auto kLockPatience = std::chrono::milliseconds(5);
constexpr int kLockSpins = 64;

}  // namespace

void SliceQueue::push_back(Slice* s) {
  s->next = nullptr;
  if (tail_ == nullptr) {
    head_ = tail_ = s;
  } else {
    tail_->next = s;
    tail_ = s;
  }
  ++size_;
}

void PushGroupFront(Slice* group, SliceQueue* q) {
  Slice* members[kMaxCoalescedSlices];
  uint32_t n = 0;
  for (Slice* s = group; s != nullptr; s = s->next) members[n++] = s;
  while (n > 0) q->push_front(members[--n]);
}

void SliceQueue::push_front(Slice* s) {
  s->next = head_;
  head_ = s;
  if (tail_ == nullptr) tail_ = s;
  ++size_;
}

Slice* SliceQueue::pop_front() {
  Slice* s = head_;
  if (s == nullptr) return nullptr;
  head_ = s->next;
  if (head_ == nullptr) tail_ = nullptr;
  s->next = nullptr;
  --size_;
  return s;
}

uint64_t SliceQueue::bytes() const {
  uint64_t sum = 0;
  for (const Slice* s = head_; s != nullptr; s = s->next) sum += s->length;
  return sum;
}

void SliceQueue::Append(SliceQueue* other) {
  if (other->empty()) return;
  if (tail_ == nullptr) {
    head_ = other->head_;
  } else {
    tail_->next = other->head_;
  }
  tail_ = other->tail_;
  size_ += other->size_;
  other->head_ = other->tail_ = nullptr;
  other->size_ = 0;
}

std::atomic<int64_t> Endpoint::alive_{0};

int64_t EndpointsAlive() { return Endpoint::alive_.load(); }

Endpoint::~Endpoint() {
  for (QueuePair& q : qps) {
    if (q.qp != nullptr) ibv_destroy_qp(q.qp);
  }
  alive_.fetch_sub(1, std::memory_order_relaxed);
}

uint32_t Endpoint::PostedLocked() const {
  uint32_t n = 0;
  for (const QueuePair& q : qps) n += q.count();
  return n;
}

bool Endpoint::LockUnlessPosting(int64_t now_ns)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // Most holders are brief (routing, completions, a post: microseconds on
  // hardware, a chain's frames on softrnic): try for a while first. Real
  // time, not the engine's clock: this is how long to spin on a lock.
  // A few yields catch the brief holders; then short sleeps, so that a
  // held lock does not cost the housekeeper a core for kLockPatience.
  const uint64_t seen = posting_.load(std::memory_order_acquire);
  const auto until = std::chrono::steady_clock::now() + kLockPatience;
  for (int i = 0;; ++i) {
    if (mu.TryLock()) return true;
    if (std::chrono::steady_clock::now() >= until) break;
    if (i < kLockSpins) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  // Still held, by the same post all along (not a run of short ones) that
  // carries a slice past its deadline: that post is blocked.
  const uint64_t word = posting_.load(std::memory_order_acquire);
  if (word != 0 && word == seen &&
      word >> 8 <=
          static_cast<uint64_t>(std::max<int64_t>(now_ns, 0) / 1000000)) {
    // qps is written once, under `mu`, before the first post (whose store
    // to posting_ this load acquired); only Shutdown clears its entries,
    // after joining the housekeeper. Flushing a QP is safe beside a post
    // (verbs are thread-safe): the post's frames stop at once.
    for (const QueuePair& q : qps) {
      if (q.qp != nullptr) FlushQp(q.qp);
    }
  }
  return false;
}

Endpoint::PostResult Endpoint::PostLocked() {
  if (state() != State::kConnected || qps.empty() ||
      !confirmed.load(std::memory_order_relaxed)) {
    return PostResult::kDone;
  }
  const int nic = local_nic_;
  const uint32_t nic_cap = nic_->max_posted_wrs();
  while (!waiting.empty()) {
    // The next QP with room, round robin.
    QueuePair* q = nullptr;
    for (size_t k = 0; k < qps.size() && q == nullptr; ++k) {
      QueuePair& c = qps[(next_qp_ + k) % qps.size()];
      if (c.count() < c.window) {
        q = &c;
        next_qp_ = (next_qp_ + k + 1) % qps.size();
      }
    }
    if (q == nullptr) return PostResult::kDone;  // Completions make room.
    uint32_t n = std::min<uint32_t>({kMaxChain, q->window - q->count(),
                                     static_cast<uint32_t>(waiting.size())});
    // Reserve room in the NIC's CQ budget for the whole chain.
    const uint32_t before =
        nic_->posted_wrs.fetch_add(n, std::memory_order_relaxed);
    if (before + n > nic_cap) {
      const uint32_t room = before < nic_cap ? nic_cap - before : 0;
      nic_->posted_wrs.fetch_sub(n - room, std::memory_order_relaxed);
      n = room;
      if (n == 0) return PostResult::kNicFull;
    }
    ibv_send_wr wrs[kMaxChain];
    ibv_sge sges[kMaxChain];
    // Compared as absl::Time per slice, converted once per chain.
    absl::Time earliest = OldestPostedDeadline(*q);
    for (uint32_t i = 0; i < n; ++i) {
      Slice* s = waiting.pop_front();
      earliest = std::min(earliest, s->deadline);
      // Slices that continue it in memory (a request's slices routed to
      // this rail one after another) join its work request: one WQE, one
      // completion, one frame on the wire instead of one per slice. Linked
      // through `next`; the group completes or fails as one.
      uint64_t length = s->length;
      uint32_t group = 1;
      for (Slice* last = s;
           group < kMaxCoalescedSlices && !waiting.empty() &&
           length + waiting.front()->length <= kMaxCoalescedBytes &&
           Adjacent(last, waiting.front());
           ++group) {
        last->next = waiting.pop_front();
        last = last->next;
        length += last->length;
      }
      const auto* mr = static_cast<const LocalMr*>(s->local_handle);
      sges[i] = {reinterpret_cast<uint64_t>(s->local),
                 static_cast<uint32_t>(length), mr->lkeys[nic]};
      ibv_send_wr& wr = wrs[i];
      wr = {};
      const uint64_t seq = q->next++;
      q->posted[seq % kMaxOutstanding] = s;
      wr.wr_id = seq;
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.opcode =
          s->op == OpCode::kWrite ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
      wr.wr.rdma.remote_addr = s->remote;
      wr.wr.rdma.rkey = SliceRkey(s);
      // Inline data is copied by the CPU into the WQE, which GPU memory
      // refuses: a GPU buffer's bytes go by DMA whatever their size.
      if (s->op == OpCode::kWrite && length <= q->max_inline && !mr->gpu) {
        wr.send_flags |= IBV_SEND_INLINE;
      }
      // Coalescing may have taken the slices the chain was sized for:
      // then this WR ends it, and the unused CQ budget goes back.
      if (i + 1 < n && waiting.empty()) {
        nic_->posted_wrs.fetch_sub(n - (i + 1), std::memory_order_relaxed);
        n = i + 1;
      }
      // Selective signaling, and the chain's last WR always, so every
      // posted slice completes without waiting for later traffic.
      if (++q->since_signal >= q->signal_every || i + 1 == n) {
        wr.send_flags |= IBV_SEND_SIGNALED;
        q->since_signal = 0;
      }
      wr.next = i + 1 < n ? &wrs[i + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    posting_.store(PostingWord(static_cast<size_t>(q - qps.data()),
                               absl::ToUnixNanos(earliest)),
                   std::memory_order_release);
    const int rc = ibv_post_send(q->qp, wrs, &bad);
    posting_.store(0, std::memory_order_release);
    if (rc != 0) {
      // Nothing from `bad` on was posted: take those back, newest first,
      // so `waiting` keeps their order.
      uint32_t unposted = 0;
      for (ibv_send_wr* w = bad; w != nullptr; w = w->next) ++unposted;
      for (uint32_t k = 0; k < unposted; ++k) {
        const uint64_t seq = --q->next;
        PushGroupFront(q->posted[seq % kMaxOutstanding], &waiting);
      }
      nic_->posted_wrs.fetch_sub(unposted, std::memory_order_relaxed);
      // The posted part may end with an unsignaled WR, whose success would
      // never be reported: close it with a signaled, empty fence WR (its
      // completion, or its flush, covers everything before it), and if
      // even that is refused, flush the QP.
      if (unposted < n && !PostFence(q)) FlushQp(q->qp);
      nic_->work_requests.fetch_add(n - unposted, std::memory_order_relaxed);
      SetStateLocked(State::kFailed);
      return PostResult::kRefused;
    }
    nic_->work_requests.fetch_add(n, std::memory_order_relaxed);
  }
  return PostResult::kDone;
}

bool Endpoint::PostFence(QueuePair* q) {
  if (q->count() >= q->window) return false;
  ibv_send_wr wr{};
  const uint64_t seq = q->next++;
  q->posted[seq % kMaxOutstanding] = nullptr;  // No slice.
  wr.wr_id = seq;
  wr.opcode = IBV_WR_RDMA_WRITE;  // Zero bytes: touches no memory.
  wr.send_flags = IBV_SEND_SIGNALED;
  q->since_signal = 0;
  nic_->posted_wrs.fetch_add(1, std::memory_order_relaxed);
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(q->qp, &wr, &bad) == 0) return true;
  --q->next;
  nic_->posted_wrs.fetch_sub(1, std::memory_order_relaxed);
  return false;
}

ibv_wc_status Endpoint::CompleteLocked(int qp, const ibv_wc& wc, Slice** done,
                                       uint32_t* n, uint32_t* last_group,
                                       bool* qp_error) {
  *n = 0;
  *last_group = 0;
  *qp_error = false;
  QueuePair& q = qps[qp];
  // A stale or foreign wr_id completes nothing.
  if (wc.wr_id < q.head || wc.wr_id >= q.next) return IBV_WC_SUCCESS;
  const uint32_t count = static_cast<uint32_t>(wc.wr_id - q.head + 1);
  // A failed fence or keepalive says nothing against the slices before it
  // (each of them that failed had its own completion).
  const bool no_slice = q.posted[wc.wr_id % kMaxOutstanding] == nullptr;
  for (uint32_t i = 0; i < count; ++i) {
    *last_group = *n;
    for (Slice* s = q.posted[q.head % kMaxOutstanding]; s != nullptr;) {
      Slice* next = s->next;
      s->next = nullptr;
      done[(*n)++] = s;
      s = next;
    }
    ++q.head;
  }
  nic_->posted_wrs.fetch_sub(count, std::memory_order_relaxed);
  if (wc.status != IBV_WC_SUCCESS) {
    *qp_error = true;
    SetStateLocked(State::kFailed);
  }
  return no_slice ? IBV_WC_SUCCESS : wc.status;
}

bool Endpoint::PostKeepaliveLocked() {
  if (state() != State::kConnected || qps.empty()) return false;
  QueuePair* q = &qps[next_qp_ % qps.size()];
  next_qp_ = (next_qp_ + 1) % qps.size();
  if (q->qp == nullptr || nic_->posted_wrs.load(std::memory_order_relaxed) >=
                              nic_->max_posted_wrs()) {
    return false;
  }
  return PostFence(q);
}

void Endpoint::ReclaimPostedLocked(SliceQueue* out) {
  for (QueuePair& q : qps) {
    for (uint64_t seq = q.head; seq < q.next; ++seq) {
      for (Slice* s = q.posted[seq % kMaxOutstanding]; s != nullptr;) {
        Slice* next = s->next;
        out->push_back(s);
        s = next;
      }
    }
    nic_->posted_wrs.fetch_sub(static_cast<uint32_t>(q.next - q.head),
                               std::memory_order_relaxed);
    q.head = q.next;
  }
}

}  // namespace ferry::rdma
