// The requester's retransmission timer: each WQE's ack deadline, and the
// device's timer thread, which retransmits after RNR waits and ack
// timeouts (go back N) and fails a QP whose retries are spent.
#include <algorithm>
#include <chrono>
#include <vector>

#include "transport/softrnic/datapath.h"
#include "transport/softrnic/requester.h"

namespace softrnic {
namespace {

// The timer re-checks busy QPs at least this often.
constexpr auto kTimerMaxSleep = std::chrono::milliseconds(100);

// Whole messages ride on TCP, so a message is acknowledged only after all
// of it crossed the link: the ACK timeout gets an allowance for the
// message's size at a conservative 10 MB/s on top of IB's 4.096 us *
// 2^timeout, or large messages on slow (shaped) links would time out
// while still flowing.
constexpr double kSlowestLinkBytesPerNs = 0.01;

// Where the front WQE, whose ACK timeout expired, is. Its deadline was
// set when its frame entered the socket; a socket holds megabytes, and on
// a slow or shared link they take longer to leave than the timeout allows
// for one message (and TCP itself may stall on a loss for its own
// retransmission timeout). A frame the connection still holds is queued,
// not lost: TCP delivers it in order or the connection breaks, so
// resending it would only queue a copy behind it. Likewise a delivered
// request whose answer is arriving (a READ's response data) is answered,
// not lost: resending it would make the responder send it all again.
enum class FrontWire {
  kGone,    // Delivered and not being answered, or no live connection
            // knows it.
  kMoving,  // Still in the connection, which moved bytes out since the
            // last look; or delivered, and bytes came in since.
  kStalled  // Still in the connection, which moved nothing out since.
};

FrontWire WhereIsFront(Qp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu) {
  const SendWqe& w = qp->sq.front();
  const Connection* conn = qp->conn.get();
  if (w.wire_conn == 0 || conn == nullptr || conn->closed() ||
      conn->id() != w.wire_conn) {
    return FrontWire::kGone;
  }
  const int64_t got = conn->BytesAcked();
  if (got < 0) return FrontWire::kGone;
  const auto acked = static_cast<uint64_t>(got);
  const uint64_t read = conn->bytes_read();
  // A connection's first look counts as movement: one timeout more, once
  // per connection.
  const bool fresh = conn->id() != qp->timer_conn;
  const bool moved_out = fresh || acked > qp->timer_acked;
  const bool moved_in = fresh || read > qp->timer_read;
  if (moved_out) qp->timer_acked = acked;
  qp->timer_read = read;
  qp->timer_conn = conn->id();
  if (acked >= w.wire_end)
    return moved_in ? FrontWire::kMoving : FrontWire::kGone;
  return moved_out ? FrontWire::kMoving : FrontWire::kStalled;
}

}  // namespace

Clock::time_point AckDeadline(const Qp& qp, const SendWqe& w,
                              Clock::time_point now) {
  const Clock::duration timeout = AckTimeout(qp.attr.timeout);
  if (timeout == Clock::duration::max()) return Clock::time_point::max();
  return now + timeout +
         std::chrono::nanoseconds(
             static_cast<int64_t>(w.length / kSlowestLinkBytesPerNs));
}

void ScheduleTimer(const std::shared_ptr<Qp>& qp) {
  ferry::MutexLock lock(&qp->dev->timer_mu);
  if (qp->in_timer) return;
  qp->in_timer = true;
  qp->dev->timer_qps.push_back(qp);
  qp->dev->timer_cv.Signal();
}

Clock::time_point TimerWork(const std::shared_ptr<Qp>& qp,
                            Clock::time_point now) {
  bool kick = false, redial = false;
  Clock::time_point next = Clock::time_point::max();
  {
    qp->mu.Lock();
    if (qp->destroyed || qp->attr.qp_state != IBV_QPS_RTS || qp->sq.empty()) {
      qp->mu.Unlock();
      return Clock::time_point::max();
    }
    if (now < qp->rnr_until) {
      const Clock::time_point until = qp->rnr_until;
      qp->mu.Unlock();
      return until;
    }
    if (qp->retransmit_pending) {
      qp->retransmit_pending = false;
      kick = true;
    } else if (qp->send_index == 0) {
      kick = true;  // Nothing in flight yet (e.g. an RNR wait just ended).
    } else if (SendWqe& front = qp->sq.front(); front.deadline <= now) {
      const FrontWire where = WhereIsFront(qp.get());
      if (where == FrontWire::kMoving) {
        // Queued behind bytes that are leaving: as a NIC's timer, which
        // runs from the packet's transmission, this one waits for it.
        front.deadline = AckDeadline(*qp, front, now);
        next = front.deadline;
      } else if (qp->retries_left == 0) {
        ++qp->dev->ack_timeouts;
        FailFront(qp, IBV_WC_RETRY_EXC_ERR);
        return Clock::time_point::max();
      } else if (where == FrontWire::kStalled) {
        // A try spent (a dead path still ends the QP in as many timeouts
        // as before), but nothing resent: the stream still holds it.
        --qp->retries_left;
        front.deadline = AckDeadline(*qp, front, now);
        next = front.deadline;
      } else {
        ++qp->dev->ack_timeouts;
        --qp->retries_left;
        qp->send_index = 0;  // Go back N: retransmit everything unacked.
        redial = !qp->loopback && (qp->conn == nullptr || qp->conn->closed());
        kick = true;
      }
    } else {
      next = qp->sq.front().deadline;
    }
    qp->mu.Unlock();
  }
  if (redial) DialPeer(qp);
  if (kick) {
    Kick(qp);
    ferry::MutexLock lock(&qp->mu);
    if (!qp->sq.empty()) {
      next = std::min(next, qp->sq.front().deadline);
      if (qp->rnr_until > now) next = std::min(next, qp->rnr_until);
    }
  }
  return next;
}

void TimerLoop(Device* dev) {
  dev->timer_mu.Lock();
  while (true) {
    if (dev->timer_qps.empty()) {
      dev->timer_cv.Wait(&dev->timer_mu);
      continue;
    }
    std::vector<std::weak_ptr<Qp>> qps = dev->timer_qps;
    dev->timer_mu.Unlock();
    const auto now = Clock::now();
    auto next = now + kTimerMaxSleep;
    std::vector<std::shared_ptr<Qp>> idle;
    for (auto& w : qps) {
      std::shared_ptr<Qp> qp = w.lock();
      if (qp == nullptr) continue;
      auto t = TimerWork(qp, now);
      if (t == Clock::time_point::max()) {
        idle.push_back(qp);
      } else {
        next = std::min(next, t);
      }
    }
    dev->timer_mu.Lock();
    // Drop expired QPs and idle ones that gained no work meanwhile.
    auto& v = dev->timer_qps;
    size_t kept = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      std::shared_ptr<Qp> qp = v[i].lock();
      bool drop = qp == nullptr;
      if (!drop && std::find(idle.begin(), idle.end(), qp) != idle.end()) {
        ferry::MutexLock ql(&qp->mu);
        if (qp->sq.empty() || qp->destroyed ||
            qp->attr.qp_state != IBV_QPS_RTS) {
          qp->dev->timer_mu.AssertHeld();  // qp->dev is dev.
          qp->in_timer = false;
          drop = true;
        }
      }
      if (drop) continue;
      if (kept != i) v[kept] = std::move(v[i]);
      ++kept;
    }
    v.resize(kept);
    dev->timer_cv.WaitWithTimeout(&dev->timer_mu,
                                  absl::FromChrono(next - Clock::now()));
  }
}

}  // namespace softrnic
