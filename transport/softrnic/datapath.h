// The responder and requester halves of the RC data path, shared by the
// TCP path and the same-process loopback path.
#ifndef FERRY_TRANSPORT_SOFTRNIC_DATAPATH_H_
#define FERRY_TRANSPORT_SOFTRNIC_DATAPATH_H_

#include <memory>

#include "transport/softrnic/connection.h"
#include "transport/softrnic/softrnic.h"
#include "transport/softrnic/wire.h"

namespace softrnic {

// What the responder answers to one request.
struct Response {
  bool send = false;      // False: drop silently (the requester will retry).
  bool io_error = false;  // The payload could not be read: close.
  Frame frame{};
  Mr* mr = nullptr;  // For READ_RESP: held until the data is sent.
  const uint8_t* data = nullptr;
  // A successful receive completion, made visible only after the response
  // has been sent: a responder that exits right after polling it must not
  // take the requester's acknowledgement with it.
  bool has_recv_wc = false;
  bool recv_solicited = false;
  ibv_wc recv_wc{};
};

// Makes the response's receive completion visible (if any), once the
// response has left.
void DeliverRecvCompletion(const std::shared_ptr<Qp>& qp, const Response& r)
    ABSL_LOCKS_EXCLUDED(qp->mu);

// What a device's listener does with a connection from address `from`
// (network order) whose first frame is `hello` (decoded, its proof, if
// any, already checked): kTake, with the QP it serves in *qp, when the QP
// exists on `dev`, is in RTR or RTS, and its peer is the HELLO's QP at
// `from`; kNotReady when the QP exists but is not yet in RTR (the HELLO
// waits); kRefuse otherwise.
enum class HelloCheck { kTake, kNotReady, kRefuse };
HelloCheck CheckHello(Device* dev, const Frame& hello, uint32_t from,
                      std::shared_ptr<Qp>* qp);
// The same for a QP already found, with its lock held: also where a
// connection is attached, since the QP may have been reset and connected
// elsewhere since the listener's check.
HelloCheck CheckHelloLocked(const Qp& qp, const Frame& hello, uint32_t from)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp.mu);

// Executes request `f` on responder `qp`, consuming its payload from `src`
// (the payload is always consumed, also when the request is refused).
Response ProcessRequest(const std::shared_ptr<Qp>& qp, const Frame& f,
                        PayloadSource* src) ABSL_LOCKS_EXCLUDED(qp->mu);

// Handles a response at requester `qp`; READ data is read from `src`.
// Returns false on a protocol violation (the connection must be closed).
// Sets *kick when WQEs must be (re)transmitted.
bool HandleResponse(const std::shared_ptr<Qp>& qp, const Frame& f,
                    PayloadSource* src, bool* kick) ABSL_LOCKS_EXCLUDED(qp->mu);

// Transmits every WQE not yet sent, in order.
void Kick(const std::shared_ptr<Qp>& qp) ABSL_LOCKS_EXCLUDED(qp->mu);

// Same-process fast path (loopback.cc), called by Kick with qp->send_mu
// held: while nothing is in flight, executes the queue's WRITEs and READs
// in batches directly at the peer QP and completes them. Returns true if
// it emptied the queue, false when the rest needs the general path (a
// SEND, an error to report, a fault or delay, a peer in another process).
bool ExecuteLoopback(const std::shared_ptr<Qp>& qp)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->send_mu);

// Completes the front WQE of the send queue (requires qp->mu). Successful
// signaled completions go to batch[(*n)++] when `batch` is given (the
// caller pushes them before releasing qp->mu), else to the CQ.
void CompleteFront(Qp* qp, ibv_wc_status status, ibv_wc* batch = nullptr,
                   int* n = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(qp->mu);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_DATAPATH_H_
