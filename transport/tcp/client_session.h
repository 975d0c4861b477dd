// ClientSession: the initiator's half of the TCP wire protocol for one
// connection, with no I/O of its own (the connection moves the bytes, so
// this state machine can be tested and fuzzed alone).
//
// Requests go out in the order slices were added; the target answers them
// in that order, so every response must match the oldest unanswered
// request (id, opcode, length), or the stream is broken. READ data is
// received straight into the slice's memory; the rest into a small staging
// buffer. Slices end up in a list of Done entries: the caller completes
// them, after the last syscall touching their memory has returned.
//
// A slice is "on the wire" once any byte of its request was sent; before
// that it can move to another connection without any risk (Abort hands
// such slices back for a retry).
//
// Not thread-safe: one connection's event-loop thread uses it.
#ifndef FERRY_TRANSPORT_TCP_CLIENT_SESSION_H_
#define FERRY_TRANSPORT_TCP_CLIENT_SESSION_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/tcp/staging_buffer.h"
#include "transport/tcp/wire.h"
#include "transport/transport.h"

namespace ferry::tcp {

// The DeadlineExceeded status of `slice`, sent to `peer`.
absl::Status SliceDeadlineError(absl::string_view peer, const Slice& slice);

class ClientSession {
 public:
  struct Done {
    Slice* slice;
    absl::Status status;
  };

  // `peer` names the target in status messages. With an `auth_token`, the
  // session sends nothing until the target's CHALLENGE arrives, and then
  // the PROOF of the token before any request (wire.h).
  explicit ClientSession(std::string peer, std::string auth_token = "")
      : peer_(std::move(peer)),
        auth_token_(std::move(auth_token)),
        awaiting_challenge_(!auth_token_.empty()) {}
  ClientSession(const ClientSession&) = delete;
  ClientSession& operator=(const ClientSession&) = delete;

  // Queues `slice` (its length is 1..kMaxFrameLength).
  void Add(Slice* slice);

  bool empty() const { return unsent_.empty() && awaiting_.empty(); }
  size_t size() const { return unsent_.size() + awaiting_.size(); }
  // Bytes of the slices in the session, for load balancing.
  uint64_t load_bytes() const { return load_bytes_; }
  // Whether a response (of any kind) ever arrived: the peer speaks the
  // protocol, as opposed to one that accepts and then drops connections.
  bool answered_any() const { return answered_any_; }

  // Under a token: whether the target's CHALLENGE is still due, and
  // whether the whole PROOF went out.
  bool awaiting_challenge() const { return awaiting_challenge_; }
  bool proof_sent() const {
    return proof_len_ > 0 && proof_sent_ == proof_len_;
  }

  // Output: bytes to send next, as at most `max_iov` iovecs (0: nothing to
  // send); then OnSent with how many of them went out.
  bool has_output() const {
    return !awaiting_challenge_ &&
           (proof_sent_ < proof_len_ || !unsent_.empty());
  }
  int PrepareOutput(iovec* iov, int max_iov) const;
  void OnSent(size_t n);

  // Input: where to receive the next bytes (never empty), then OnReceived
  // with how many arrived there. Finished slices are appended to `done`. A
  // non-OK return (DataLoss naming the fault) means the peer broke the
  // protocol: the caller aborts the connection.
  std::pair<uint8_t*, size_t> InputBuffer();
  absl::Status OnReceived(size_t n, std::vector<Done>* done);

  // Slices not on the wire whose deadline passed go to `done` with
  // DeadlineExceeded. Returns true if a slice on the wire passed its
  // deadline: its frame cannot be taken back, so the caller must abort the
  // connection.
  bool Expire(absl::Time now, std::vector<Done>* done);

  // Ends every slice. Those not on the wire go to `retry` if it is not
  // null; the others (and all of them if `retry` is null) to `done` with
  // DeadlineExceeded if their deadline passed by `now`, else `cause`.
  void Abort(const absl::Status& cause, absl::Time now,
             std::vector<Slice*>* retry, std::vector<Done>* done);

 private:
  // The error a slice fails with when the target refused it with `status`.
  absl::Status Refusal(WireStatus status, const Slice& slice) const;
  struct Entry {
    Slice* slice;
    uint64_t id;
    size_t sent;   // Bytes of header + payload sent so far.
    size_t total;  // Header + payload (a READ has none).
    uint8_t header[kRequestHeaderBytes];
  };

  absl::Status Process(std::vector<Done>* done);
  void FinishFront(absl::Status status, std::vector<Done>* done);

  // Takes the CHALLENGE at the front of the staged input and queues the
  // PROOF.
  absl::Status TakeChallenge();

  const std::string peer_;
  const std::string auth_token_;
  bool awaiting_challenge_;
  uint8_t proof_[kRequestHeaderBytes + kProofBytes];
  size_t proof_len_ = 0;  // 0: no PROOF (no token).
  size_t proof_sent_ = 0;
  uint64_t next_id_ = 1;
  uint64_t load_bytes_ = 0;
  bool answered_any_ = false;
  std::deque<Entry> unsent_;    // The front one may be partly sent.
  std::deque<Entry> awaiting_;  // Sent; answered in this order.

  // Input: response headers are staged; READ data goes to `body_`.
  StagingBuffer staging_;
  uint8_t* body_ = nullptr;  // Where the front READ's data goes next.
  size_t body_left_ = 0;     // 0: expecting a header.
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_CLIENT_SESSION_H_
