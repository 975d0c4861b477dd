// ServerSession: the target's half of the TCP wire protocol for one
// accepted connection, with no I/O of its own (the server moves the bytes,
// so this state machine can be tested and fuzzed alone).
//
// Requests are handled in arrival order. Each header is validated before
// use; each access is checked against the registry (remote-accessible
// buffers only, with the buffer's key and this engine run's incarnation:
// a frame with another key or incarnation is answered with an error and
// touches nothing) and holds a lease on its buffer until its bytes have moved:
// a WRITE's payload is received straight into host target memory, a
// READ's data is sent straight from it. A range outside registered memory
// is answered with an error status and touches nothing (a WRITE's payload
// is drained). A malformed header ends the session.
//
// GPU-resident buffers move through the server's TargetStaging
// (target_staging.h): a WRITE's payload is received into a pinned buffer
// and copied to the device before it is acknowledged; a READ's range is
// copied into one, then sent. A frame longer than a staging buffer is
// refused (kTooLarge), a failed copy answered kStagingFailed. While every
// buffer is in use the session stops reading (its request waits, whole,
// in `staging_`) until Resume finds one, for at most frame_timeout; a
// session holds at most kMaxStagedResponses of them in queued READ
// answers.
//
// Bounded: at most kMaxQueuedResponses responses wait for the peer to take
// them; while that many wait, no more input is read (the peer's requests
// stay in its socket), so a peer that does not read cannot make the
// target queue work. Timeouts (CheckTimeouts) bound how long a peer may
// hold the connection idle, or hold a lease with a frame it does not finish.
//
// Not thread-safe: one event-loop thread uses it.
#ifndef FERRY_TRANSPORT_TCP_SERVER_SESSION_H_
#define FERRY_TRANSPORT_TCP_SERVER_SESSION_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/memory_registry.h"
#include "transport/tcp/staging_buffer.h"
#include "transport/tcp/target_staging.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {

// A remote-accessible buffer's key: the registry's handle 0 of each such
// buffer points at one (set by TcpTransport::RegisterMemory). A buffer
// without one is served to nobody.
struct BufferKey {
  uint64_t value = 0;
};

class ServerSession {
 public:
  struct Limits {
    absl::Duration handshake_timeout = absl::Seconds(10);
    absl::Duration idle_timeout = absl::Seconds(60);
    absl::Duration frame_timeout = absl::Seconds(10);
  };
  static constexpr size_t kMaxQueuedResponses = 16;
  static constexpr size_t kMaxStagedResponses = 2;

  // `registry` (and `gpu_staging`, if not null) must outlive the session.
  // `incarnation`: this engine run's, as published in its descriptor.
  // `now`: when the connection was accepted. Without `gpu_staging`, frames
  // for GPU-resident buffers are answered kStagingFailed. With an
  // `auth_token`, the session's first output is a CHALLENGE and it serves
  // nothing until a PROOF of the token answers it (wire.h); a wrong one
  // ends the session (PermissionDenied).
  ServerSession(MemoryRegistry* registry, const Limits& limits,
                uint64_t incarnation, absl::Time now,
                TargetStaging* gpu_staging = nullptr,
                absl::string_view auth_token = "");
  ServerSession(const ServerSession&) = delete;
  ServerSession& operator=(const ServerSession&) = delete;

  // Input: where to receive the next bytes, then OnReceived with how many
  // arrived there. Empty while too many responses wait (stop reading). A
  // non-OK return (DataLoss naming the fault) means: close the connection.
  bool wants_input() const {
    return out_.size() < kMaxQueuedResponses &&
           staged_out_ < kMaxStagedResponses && !stalled_;
  }
  std::pair<uint8_t*, size_t> InputBuffer();
  absl::Status OnReceived(size_t n, absl::Time now);

  // Output: bytes to send next, as at most `max_iov` iovecs; then OnSent
  // with how many of them went out. OnSent may resume requests that were
  // staged while output was full: non-OK as for OnReceived.
  bool has_output() const { return !out_.empty(); }
  int PrepareOutput(iovec* iov, int max_iov) const;
  absl::Status OnSent(size_t n, absl::Time now);

  // Waiting for a free staging buffer (see above): call Resume now and
  // then to try again. Non-OK as for OnReceived.
  bool stalled() const { return stalled_; }
  // A frame may wait for a buffer up to frame_timeout, like any frame.
  absl::Status Resume(absl::Time now);

  // DeadlineExceeded saying which limit the peer overran, if it did: the
  // caller closes the connection.
  absl::Status CheckTimeouts(absl::Time now) const;

  // Whether the peer proved the token (always, without one).
  bool proven() const { return proven_; }
  // Requests whose header was accepted.
  uint64_t requests() const { return requests_; }
  // Of those, refused for a wrong key or incarnation.
  uint64_t denied() const { return denied_; }
  // Of those, let at the memory they name: what makes a connection worth
  // keeping when slots run short (TcpServer sheds the others first).
  uint64_t admitted() const { return admitted_; }
  // The start of a request or some of its bytes have arrived, but not all.
  bool mid_frame() const { return payload_left_ > 0 || !staging_.empty(); }

 private:
  struct Response {
    uint8_t header[kResponseHeaderBytes];
    const uint8_t* data = nullptr;  // READ data, in the leased buffer.
    size_t length = 0;              // Of data.
    size_t sent = 0;                // Of header + data.
    absl::Time queued;              // The frame timeout counts from here.
    MemoryRegistry::Lease lease;
    TargetStaging::Buffer staged;  // Holds data, for a GPU-resident range.
  };

  absl::Status Process(absl::Time now);
  absl::Status StartRequest(const uint8_t* header, absl::Time now);
  // Leases the request's range if the frame may access it; else says why
  // not (and leases nothing).
  WireStatus Admit(const RequestHeader& req, MemoryRegistry::Lease* lease);
  // For a GPU-resident range in `region`: a staging buffer in `*buffer`,
  // or an error status (kStagingFailed too when the application freed the
  // allocation under its registration); kOk with no buffer means none is
  // free (stall).
  WireStatus Stage(const RequestHeader& req, const MemoryRegion& region,
                   TargetStaging::Buffer* buffer);
  void EndPayload(absl::Time now);
  void Queue(Response r, absl::Time now);
  // Frame timing: called whenever input state may have changed.
  void UpdateFrameClock(absl::Time now);

  // Takes the PROOF from the `staged` bytes of input once it is whole;
  // refuses anything else as soon as its header is in.
  absl::Status TakeProof(size_t staged);

  MemoryRegistry* const registry_;
  TargetStaging* const gpu_staging_;
  const Limits limits_;
  const uint64_t incarnation_;
  const std::string auth_token_;
  uint8_t challenge_[kResponseHeaderBytes] = {};  // Sent first (token only).
  bool proven_;
  const absl::Time created_;
  uint64_t requests_ = 0;
  uint64_t denied_ = 0;
  uint64_t admitted_ = 0;

  // Input. Headers (and any payload bytes read with them) are staged.
  StagingBuffer staging_;
  // The WRITE whose payload is arriving: its destination (null: drained),
  // bytes still due, id and answer, and the lease on the target buffer.
  uint8_t* payload_ = nullptr;
  size_t payload_left_ = 0;
  uint64_t payload_id_ = 0;
  WireStatus payload_status_ = WireStatus::kOk;
  MemoryRegistry::Lease payload_lease_;
  // A staged WRITE: its payload goes to this buffer, then to the device.
  TargetStaging::Buffer payload_staged_;
  int payload_device_ = -1;
  uint64_t payload_device_addr_ = 0;
  size_t payload_length_ = 0;
  // Queued READ answers holding a staging buffer; whether the request at
  // the front of staging_ waits for a free one.
  size_t staged_out_ = 0;
  bool stalled_ = false;
  absl::Time stalled_since_ = absl::InfiniteFuture();

  std::deque<Response> out_;

  // Since when the current input frame has been in progress (while input
  // is read), and the front response has waited for the peer; the last
  // time a request or response finished.
  absl::Time frame_since_ = absl::InfiniteFuture();
  absl::Time out_since_ = absl::InfiniteFuture();
  absl::Time last_done_;
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_SERVER_SESSION_H_
