// Queue pairs: creation, the RC state machine, query, destruction.
#include <errno.h>

#include <cstring>

#include "common/secure_random.h"
#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

struct QpTable {
  ferry::Mutex mu;
  std::unordered_map<uint32_t, std::shared_ptr<Qp>> qps ABSL_GUARDED_BY(mu);
};

QpTable& Table() {
  static auto* t = new QpTable();
  return *t;
}

// Attribute masks per transition (IB spec 11.2.4.2, as in the kernel's
// ib_modify_qp_is_ok for RC).
struct Transition {
  ibv_qp_state from, to;
  int required, optional;
};

constexpr int kInitRequired =
    IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
constexpr int kRtrRequired = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                             IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                             IBV_QP_MIN_RNR_TIMER;
constexpr int kRtsRequired = IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                             IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                             IBV_QP_MAX_QP_RD_ATOMIC;
constexpr int kRtsOptional = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS |
                             IBV_QP_MIN_RNR_TIMER | IBV_QP_ALT_PATH |
                             IBV_QP_PATH_MIG_STATE;

const Transition kTransitions[] = {
    {IBV_QPS_RESET, IBV_QPS_INIT, kInitRequired, 0},
    {IBV_QPS_INIT, IBV_QPS_INIT, 0, kInitRequired},
    {IBV_QPS_INIT, IBV_QPS_RTR, kRtrRequired,
     IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX},
    {IBV_QPS_RTR, IBV_QPS_RTS, kRtsRequired, kRtsOptional},
    {IBV_QPS_RTS, IBV_QPS_RTS, 0, kRtsOptional},
};

// Returns 0 or the errno a real NIC gives for this modify.
int CheckTransition(ibv_qp_state cur, const ibv_qp_attr& a, int mask) {
  if (!(mask & IBV_QP_STATE)) {
    // Attribute-only modify within the current state.
    if (cur == IBV_QPS_INIT) return (mask & ~kInitRequired) ? EINVAL : 0;
    if (cur == IBV_QPS_RTS) return (mask & ~kRtsOptional) ? EINVAL : 0;
    return EINVAL;
  }
  if ((mask & IBV_QP_CUR_STATE) && a.cur_qp_state != cur) return EINVAL;
  const ibv_qp_state to = a.qp_state;
  if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) {
    return (mask & ~(IBV_QP_STATE | IBV_QP_CUR_STATE)) ? EINVAL : 0;
  }
  for (const Transition& t : kTransitions) {
    if (t.from != cur || t.to != to) continue;
    int attrs = mask & ~IBV_QP_STATE;
    if ((attrs & t.required) != t.required) return EINVAL;
    if (attrs & ~(t.required | t.optional)) return EINVAL;
    return 0;
  }
  return EINVAL;
}

int CheckValues(const ibv_qp_attr& a, int mask) {
  if ((mask & IBV_QP_PORT) && a.port_num != 1) return EINVAL;
  if ((mask & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return EINVAL;
  if ((mask & IBV_QP_ACCESS_FLAGS) &&
      (a.qp_access_flags &
       ~(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
         IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC))) {
    return EINVAL;
  }
  if (mask & IBV_QP_AV) {
    // RoCE: the link layer is Ethernet, so a GRH with the peer's GID is
    // mandatory. InfiniBand: the DLID routes; a GRH is optional.
    if ((!a.ah_attr.is_global && !InfiniBand()) || a.ah_attr.port_num != 1 ||
        (a.ah_attr.is_global &&
         a.ah_attr.grh.sgid_index >= GetProfile().gid_table_len)) {
      return EINVAL;
    }
  }
  const Profile& hw = GetProfile();
  // As hardware: no path MTU above the port's active MTU.
  if ((mask & IBV_QP_PATH_MTU) &&
      (a.path_mtu < IBV_MTU_256 || a.path_mtu > hw.active_mtu)) {
    return EINVAL;
  }
  if ((mask & IBV_QP_DEST_QPN) && a.dest_qp_num > 0xffffff) return EINVAL;
  if ((mask & IBV_QP_TIMEOUT) && a.timeout > 31) return EINVAL;
  if ((mask & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return EINVAL;
  if ((mask & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return EINVAL;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return EINVAL;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) &&
      a.max_rd_atomic > hw.max_qp_init_rd_atom) {
    return EINVAL;
  }
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) &&
      a.max_dest_rd_atomic > hw.max_qp_rd_atom) {
    return EINVAL;
  }
  return 0;
}

void Flush(Qp* qp, std::vector<std::pair<Cq*, ibv_wc>>* out)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  for (size_t i = 0; i < qp->sq.size(); ++i) {
    const SendWqe& w = qp->sq[i];
    ibv_wc wc{};
    wc.wr_id = w.wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.qp_num = qp->qp.qp_num;
    out->push_back({qp->send_cq, wc});
  }
  qp->sq.clear();
  qp->done_unsignaled = 0;
  for (const RecvWqe& w : qp->rq) {
    ibv_wc wc{};
    wc.wr_id = w.wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = qp->qp.qp_num;
    out->push_back({qp->recv_cq, wc});
  }
  qp->rq.clear();
}

}  // namespace

void SendQueue::Init(uint32_t depth, uint32_t max_sge, uint32_t max_inline) {
  ring_.assign(depth, SendWqe{});
  sge_pool_.assign(static_cast<size_t>(depth) * max_sge, Sge{});
  inline_pool_.clear();
  max_sge_ = max_sge;
  max_inline_ = max_inline;
  head_ = count_ = 0;
}

SendWqe& SendQueue::push_back() {
  const size_t i = (head_ + count_) % ring_.size();
  ++count_;
  SendWqe& w = ring_[i];
  w = SendWqe{};
  w.sges = &sge_pool_[i * max_sge_];
  if (inline_pool_.empty() && max_inline_ > 0) {
    inline_pool_.resize(ring_.size() * max_inline_);
  }
  w.inline_data = max_inline_ > 0 ? &inline_pool_[i * max_inline_] : nullptr;
  return w;
}

void SendQueue::pop_front() {
  head_ = (head_ + 1) % ring_.size();
  --count_;
}

void SendQueue::clear() {
  head_ = count_ = 0;
  ++epoch_;
}

std::shared_ptr<Qp> FindQp(uint32_t qpn) {
  QpTable& t = Table();
  ferry::MutexLock lock(&t.mu);
  auto it = t.qps.find(qpn);
  return it == t.qps.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<Qp>> QpsOf(const Device* dev) {
  std::vector<std::shared_ptr<Qp>> out;
  QpTable& t = Table();
  ferry::MutexLock lock(&t.mu);
  for (const auto& [qpn, qp] : t.qps) {
    if (qp->dev == dev) out.push_back(qp);
  }
  return out;
}

Clock::duration AckTimeout(uint8_t timeout) {
  if (timeout == 0) return Clock::duration::max();
  return std::chrono::nanoseconds(static_cast<int64_t>(4096) << timeout);
}

uint32_t RnrTimerMicros(uint8_t code) {
  // IB spec table 45: code 0 is 655.36 ms, then 0.01 ms doubling-ish.
  static const uint32_t kTable[32] = {
      655360, 10,    20,    30,     40,     60,     80,     120,
      160,    240,   320,   480,    640,    960,    1280,   1920,
      2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
      40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kTable[code & 31];
}

namespace {

// Moves `qp` to ERR and flushes it under qp->mu. Returns whether it was not
// in ERR before: then DisconnectQp is due once qp->mu is released.
bool EnterErrorLocked(Qp* qp, int async_event)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  if (qp->destroyed) return false;
  bool changed = false;
  if (qp->attr.qp_state != IBV_QPS_ERR) {
    qp->attr.qp_state = IBV_QPS_ERR;
    qp->qp.state = IBV_QPS_ERR;
    changed = true;
  }
  // Completions are pushed under qp->mu so none can follow
  // ibv_destroy_qp (after which the application may destroy the CQs).
  std::vector<std::pair<Cq*, ibv_wc>> flushed;
  Flush(qp, &flushed);
  for (auto& [cq, wc] : flushed) PushCompletion(cq, wc);
  // The event too: after ibv_destroy_qp the application may close the
  // context, whose event pipe this writes (TSan saw the write race with
  // ibv_close_device's close).
  if (changed && async_event >= 0) {
    ibv_async_event e{};
    e.event_type = static_cast<ibv_event_type>(async_event);
    e.element.qp = &qp->qp;
    PostAsyncEvent(reinterpret_cast<Context*>(qp->qp.context), e);
  }
  return changed;
}

}  // namespace

void EnterError(const std::shared_ptr<Qp>& qp, int async_event) {
  qp->mu.Lock();
  const bool changed = EnterErrorLocked(qp.get(), async_event);
  qp->mu.Unlock();
  if (changed) DisconnectQp(qp, /*also_accepted=*/false);
}

void EnterErrorAndUnlock(const std::shared_ptr<Qp>& qp) {
  const bool changed = EnterErrorLocked(qp.get(), -1);
  qp->mu.Unlock();
  if (changed) DisconnectQp(qp, /*also_accepted=*/false);
}

}  // namespace softrnic

using namespace softrnic;

SOFTRNIC_EXPORT ibv_qp* ibv_create_qp(ibv_pd* ibpd, ibv_qp_init_attr* init) {
  if (Dead(ibpd->context)) {
    errno = EIO;
    return nullptr;
  }
  if (init->qp_type != IBV_QPT_RC) {
    errno = EOPNOTSUPP;  // softrnic emulates reliable connected QPs only.
    return nullptr;
  }
  if (init->srq != nullptr) {
    errno = EOPNOTSUPP;  // No SRQ support (max_srq = 0).
    return nullptr;
  }
  ibv_qp_cap& cap = init->cap;
  const Profile& hw = GetProfile();
  if (init->send_cq == nullptr || init->recv_cq == nullptr ||
      cap.max_send_wr < 1 ||
      cap.max_send_wr > static_cast<uint32_t>(hw.max_qp_wr) ||
      cap.max_recv_wr > static_cast<uint32_t>(hw.max_qp_wr) ||
      cap.max_send_sge > static_cast<uint32_t>(hw.max_sge) ||
      cap.max_recv_sge > static_cast<uint32_t>(hw.max_sge) ||
      cap.max_inline_data > hw.max_inline) {
    errno = EINVAL;
    return nullptr;
  }
  auto qp = std::make_shared<Qp>();
  qp->self = qp;
  auto* ctx = reinterpret_cast<Context*>(ibpd->context);
  qp->dev = ctx->dev;
  qp->pd = reinterpret_cast<Pd*>(ibpd);
  qp->send_cq = reinterpret_cast<Cq*>(init->send_cq);
  qp->recv_cq = reinterpret_cast<Cq*>(init->recv_cq);
  // Report (and enforce) at least one SGE and the full inline budget, as
  // drivers round requested capabilities up.
  cap.max_send_sge = std::max<uint32_t>(cap.max_send_sge, 1);
  cap.max_recv_sge = std::max<uint32_t>(cap.max_recv_sge, 1);
  cap.max_inline_data = hw.max_inline;
  qp->cap = cap;
  qp->sq_sig_all = init->sq_sig_all != 0;
  qp->qp.context = ibpd->context;
  qp->qp.qp_context = init->qp_context;
  qp->qp.pd = ibpd;
  qp->qp.send_cq = init->send_cq;
  qp->qp.recv_cq = init->recv_cq;
  qp->qp.srq = nullptr;
  qp->qp.state = IBV_QPS_RESET;
  qp->qp.qp_type = IBV_QPT_RC;
  pthread_mutex_init(&qp->qp.mutex, nullptr);
  pthread_cond_init(&qp->qp.cond, nullptr);
  {
    ferry::MutexLock lock(&qp->mu);
    qp->attr.qp_state = IBV_QPS_RESET;
    qp->attr.cap = cap;
    qp->sq.Init(cap.max_send_wr, cap.max_send_sge, cap.max_inline_data);
  }
  QpTable& t = Table();
  {
    ferry::MutexLock lock(&t.mu);
    if (t.qps.size() >= static_cast<size_t>(kMaxQp)) {
      errno = ENOMEM;
      return nullptr;
    }
    // QP numbers are drawn at random, not counted: a stranger who learns
    // some (its own QPs') cannot infer the ones between them, and a
    // restarted process does not reuse the numbers its predecessor's
    // peers still hold.
    uint32_t qpn;
    do {
      ferry::SecureRandomBytes(&qpn, sizeof(qpn));
      qpn &= 0xffffff;
    } while (qpn < 2 || t.qps.count(qpn));  // QP0 and QP1 are special.
    qp->qp.qp_num = qpn;
    qp->qp.handle = qpn;
    t.qps[qpn] = qp;
  }
  qp->pd->users.fetch_add(1);
  return &qp->qp;
}

SOFTRNIC_EXPORT int ibv_modify_qp(ibv_qp* ibqp, ibv_qp_attr* a, int mask) {
  if (Dead(ibqp->context)) return EIO;
  std::shared_ptr<Qp> qp = SharedQp(ibqp);
  ibv_qp_state to;
  bool connect = false, disconnect = false, to_error = false;
  {
    ferry::MutexLock lock(&qp->mu);
    const ibv_qp_state cur = qp->attr.qp_state;
    if (int err = CheckTransition(cur, *a, mask); err != 0) return err;
    if (int err = CheckValues(*a, mask); err != 0) return err;
    to = (mask & IBV_QP_STATE) ? a->qp_state : cur;
    ibv_qp_attr& s = qp->attr;
    if (mask & IBV_QP_PKEY_INDEX) s.pkey_index = a->pkey_index;
    if (mask & IBV_QP_PORT) s.port_num = a->port_num;
    if (mask & IBV_QP_ACCESS_FLAGS) s.qp_access_flags = a->qp_access_flags;
    if (mask & IBV_QP_AV) s.ah_attr = a->ah_attr;
    if (mask & IBV_QP_PATH_MTU) s.path_mtu = a->path_mtu;
    if (mask & IBV_QP_DEST_QPN) s.dest_qp_num = a->dest_qp_num;
    if (mask & IBV_QP_RQ_PSN) s.rq_psn = a->rq_psn;
    if (mask & IBV_QP_SQ_PSN) s.sq_psn = a->sq_psn;
    if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) {
      s.max_dest_rd_atomic = a->max_dest_rd_atomic;
    }
    if (mask & IBV_QP_MAX_QP_RD_ATOMIC) s.max_rd_atomic = a->max_rd_atomic;
    if (mask & IBV_QP_MIN_RNR_TIMER) s.min_rnr_timer = a->min_rnr_timer;
    if (mask & IBV_QP_TIMEOUT) s.timeout = a->timeout;
    if (mask & IBV_QP_RETRY_CNT) s.retry_cnt = a->retry_cnt;
    if (mask & IBV_QP_RNR_RETRY) s.rnr_retry = a->rnr_retry;
    if (mask & IBV_QP_ALT_PATH) {
      s.alt_ah_attr = a->alt_ah_attr;
      s.alt_pkey_index = a->alt_pkey_index;
      s.alt_port_num = a->alt_port_num;
      s.alt_timeout = a->alt_timeout;
    }
    if (mask & IBV_QP_PATH_MIG_STATE) s.path_mig_state = a->path_mig_state;
    if (to == IBV_QPS_ERR && cur != IBV_QPS_ERR) {
      to_error = true;
    } else {
      s.qp_state = to;
      qp->qp.state = to;
    }
    if (to == IBV_QPS_RTR && cur == IBV_QPS_INIT && InfiniBand()) {
      // Switches forward by DLID, GRH or not: the subnet manager's table
      // says which port holds it. A DLID no live port holds (0 included)
      // routes nowhere; the QP's requests time out.
      if (!ResolveLid(s.ah_attr.dlid, &qp->peer_ip, &qp->peer_port)) {
        qp->peer_port = 0;
      }
      qp->sgid_v1.store(false, std::memory_order_release);
      qp->expected_msn = 0;
      connect = true;
    } else if (to == IBV_QPS_RTR && cur == IBV_QPS_INIT) {
      const uint8_t* g = s.ah_attr.grh.dgid.raw;
      // Only an IPv4-mapped GID routes (ours carry the port in 8..9); any
      // other, e.g. link-local, leaves the QP with nowhere to send: its
      // requests time out, as with a GID no switch routes.
      bool mapped = g[10] == 0xff && g[11] == 0xff;
      for (int i = 0; i < 8; ++i) mapped = mapped && g[i] == 0;
      std::memcpy(&qp->peer_ip, g + 12, 4);
      qp->peer_port = mapped ? static_cast<uint16_t>(g[8] << 8 | g[9]) : 0;
      ibv_gid sgid;
      bool v1 = false;
      qp->dev->GidAt(s.ah_attr.grh.sgid_index, &sgid, &v1);
      qp->sgid_v1.store(v1, std::memory_order_release);
      qp->expected_msn = 0;
      connect = true;
    }
    if (to == IBV_QPS_RTS && cur == IBV_QPS_RTR) {
      qp->retries_left = s.retry_cnt;
      qp->rnr_retries_left = s.rnr_retry;
      qp->next_msn = 0;
    }
    if (to == IBV_QPS_RESET) {
      // RESET discards everything without completions.
      qp->sq.clear();
      qp->rq.clear();
      qp->done_unsignaled = 0;
      qp->loop_peer.reset();
      qp->has_loop_peer = false;
      disconnect = true;
    }
  }
  if (to_error) EnterError(qp, -1);
  if (disconnect) DisconnectQp(qp, /*also_accepted=*/true);
  if (connect) ConnectQp(qp);
  return 0;
}

SOFTRNIC_EXPORT int ibv_query_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int,
                                 ibv_qp_init_attr* init) {
  if (Dead(ibqp->context)) return EIO;
  auto* qp = reinterpret_cast<Qp*>(ibqp);
  ferry::MutexLock lock(&qp->mu);
  *attr = qp->attr;
  attr->cur_qp_state = qp->attr.qp_state;
  attr->cap = qp->cap;
  if (init != nullptr) {
    std::memset(init, 0, sizeof(*init));
    init->qp_context = qp->qp.qp_context;
    init->send_cq = qp->qp.send_cq;
    init->recv_cq = qp->qp.recv_cq;
    init->cap = qp->cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = qp->sq_sig_all;
  }
  return 0;
}

SOFTRNIC_EXPORT int ibv_destroy_qp(ibv_qp* ibqp) {
  std::shared_ptr<Qp> qp = SharedQp(ibqp);
  {
    ferry::MutexLock lock(&qp->mu);
    qp->destroyed = true;
    qp->attr.qp_state = IBV_QPS_RESET;
    qp->sq.clear();
    qp->rq.clear();
    qp->loop_peer.reset();
  }
  DisconnectQp(qp, /*also_accepted=*/true);
  {
    QpTable& t = Table();
    ferry::MutexLock lock(&t.mu);
    t.qps.erase(qp->qp.qp_num);
  }
  qp->pd->users.fetch_sub(1);
  // Threads still holding the QP see `destroyed` and let go; the memory is
  // freed with the last reference.
  return 0;
}
