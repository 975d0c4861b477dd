// What the requester's files share, and nothing else uses. The requester
// is split by concern:
//   requester.cc             posting, and transmission in MSN order (Kick);
//   requester_connection.cc  the outgoing connection and its response
//                            thread;
//   requester_acks.cc        responses and NAKs, which complete, fail or
//                            rewind the send queue;
//   requester_timer.cc       ack deadlines and the device's retransmission
//                            timer.
// Its entry points for the rest of softrnic are in datapath.h and
// softrnic.h.
#ifndef FERRY_TRANSPORT_SOFTRNIC_REQUESTER_H_
#define FERRY_TRANSPORT_SOFTRNIC_REQUESTER_H_

#include <memory>

#include "transport/softrnic/softrnic.h"

namespace softrnic {

// Opens the QP's outgoing connection, unless it has one open, and starts
// its response thread. True if the QP has a connection now (always for a
// same-process peer); false if not, and then the timer dials again when
// there is work.
bool DialPeer(const std::shared_ptr<Qp>& qp) ABSL_LOCKS_EXCLUDED(qp->mu);

// When the transmission of `w` at `now` times out unacknowledged.
Clock::time_point AckDeadline(const Qp& qp, const SendWqe& w,
                              Clock::time_point now)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp.mu);

// Fails the front WQE with `status`, moves the QP to ERR and releases
// qp->mu.
void FailFront(const std::shared_ptr<Qp>& qp, ibv_wc_status status)
    ABSL_UNLOCK_FUNCTION(qp->mu);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_REQUESTER_H_
