// Connection set-up of the RDMA transport as explicit state machines, free
// of verbs and threads: they decide, RailLifecycle executes (create and
// connect QPs, send a request, install, fail, close, tell the peer).
//
// RailConnector: one rail (a local NIC and a NIC of one peer). The rail has
// at most one current endpoint, in one phase:
//
//   kIdle ---Need---> kRequesting ---ACCEPTED---> kInstalling --ok-->
//   kConnected
//                       |   |  \---LOST_TIE_BREAK--> kAwaitingPeer
//                       |   \--failed / 2nd SUPERSEDED--> kIdle (fail)
//                       \--peer's request, peer wins--> kAccepting (adopt)
//   kIdle / kConnected --peer's request--> kAccepting (fresh; replaces)
//   kAwaitingPeer --peer's request--> kAccepting;  --timeout--> kIdle (fail)
//   kAccepting --accept done--> kConnected (unconfirmed until READY or the
//                                 confirm timeout)
//   any --failed / closed / DISCONNECT / peer restarted--> kIdle
//
// Every connection of a rail gets a higher epoch. A request claims the
// epoch its sender knew; one that claims less than the rail's is stale and
// answered SUPERSEDED (its sender resends once with the newer epoch, then
// gives up), while one that claims the current epoch replaces it (its
// sender lost its half). When both sides request at once, the side whose
// segment name sorts first wins the tie-break: the other answers
// LOST_TIE_BREAK, adopts the winner's request when it comes, or fails at
// the deadline. A reply or a completion that arrives for an attempt or an
// endpoint that is no longer current is moot; if it made a connection at
// the peer, the machine tells the peer to close it. So every phase but
// kIdle and kConnected is left by a message, a local result or a deadline:
// no interleaving of connects, accepts, tie-breaks, disconnects, timeouts,
// lost messages and restarts wedges a rail (rail_connector_test checks
// every interleaving up to a bounded depth for two sides and one rail).
//
// ConnectBackoff: per peer, bounds handshakes with a peer that fails them
// (refused, unreachable, silent): after a failure, none for a backoff
// period (50 ms doubling to 1.6 s); then one probe at a time, the others
// failing fast, until a handshake succeeds.
//
// Not thread-safe: RailLifecycle calls them under the Peer's lock.
#ifndef FERRY_TRANSPORT_RDMA_CONNECTOR_H_
#define FERRY_TRANSPORT_RDMA_CONNECTOR_H_

#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "transport/rdma/handshake.pb.h"

namespace ferry::rdma {

class RailConnector {
 public:
  enum class Phase : uint8_t {
    kIdle,          // No endpoint.
    kRequesting,    // Our endpoint; our ConnectRequest is (about to be) out.
    kAwaitingPeer,  // We lost the tie-break: the peer's request brings QPs.
    kAccepting,     // QPs are being made for the peer's request.
    kInstalling,    // The peer accepted: our QPs are being connected.
    kConnected,     // Usable (once confirmed: the peer's QPs can receive).
  };

  // What became of our ConnectRequest.
  enum class Outcome : uint8_t {
    kAccepted,
    kLostTieBreak,
    kSuperseded,
    kRefused,  // The peer will not connect this rail now (REFUSED).
    kFailed,   // RPC error, malformed reply, stale incarnation.
  };

  struct Action {
    enum class Kind : uint8_t {
      // Create QPs for `ep` and send a ConnectRequest claiming rail epoch
      // `epoch`, as attempt `attempt` (after BeginSend says it is still
      // wanted); report with OnReply.
      kSendRequest,
      // Connect attempt `attempt`'s QPs to the accepted reply's, for `ep`
      // and connection `epoch`; report with Installed.
      kInstall,
      // Create and connect QPs for the peer's request, into `ep` (`fresh`:
      // a new endpoint, the rail's now); report with AcceptDone.
      kAccept,
      // Answer the peer's request without QPs: `result` with `epoch`.
      kReply,
      // Answer the peer's request with the accepted QPs and `epoch`.
      kReplyAccepted,
      // Answer the peer's request with REFUSED, because of `why`.
      kRefuse,
      // Install the connected QPs into `ep` as connection `epoch`; it may
      // send at once if `confirmed`.
      kActivate,
      // `ep` may send now (post what waits).
      kConfirm,
      // `ep` is out of service: its slices go elsewhere (`why`); `backoff`:
      // a handshake with the peer failed (back the peer off); `rail_fault`:
      // the peer refused this rail, or our NIC could not make or connect
      // its QPs (avoid the rail for a while); `flush`: flush its posted
      // work.
      kFail,
      // `ep` is out of service: no new slices; it drains, then goes.
      kClose,
      // Tell the peer: connection `epoch` can receive (READY) / is closed
      // (DISCONNECT).
      kTellReady,
      kTellDisconnect,
    };
    Kind kind;
    uint64_t ep = 0;
    uint64_t attempt = 0;
    uint64_t epoch = 0;
    ConnectReply::Result result = ConnectReply::ACCEPTED;
    bool fresh = false;
    bool confirmed = false;
    bool backoff = false;
    bool rail_fault = false;
    bool flush = false;
    absl::Status why;
  };
  using Actions = absl::InlinedVector<Action, 4>;

  // Sends with a stale claim that are answered SUPERSEDED are sent again
  // this often (with the newer epoch) before the endpoint fails.
  static constexpr int kMaxResends = 1;

  // `we_win_ties`: our segment name sorts before the peer's. `timeout_ns`:
  // how long we wait for the tie-break winner's request, and for READY.
  RailConnector(bool we_win_ties, int64_t timeout_ns)
      : we_win_ties_(we_win_ties), timeout_ns_(timeout_ns) {}

  // The data path needs the rail and it has no endpoint: starts endpoint
  // `new_ep` (kSendRequest). False (nothing done) if it has one.
  bool Need(uint64_t new_ep, Actions* out);
  // Asked before sending attempt `attempt`: false if it is moot (the
  // endpoint was adopted, failed or replaced meanwhile); then it is
  // forgotten and must not be sent.
  bool BeginSend(uint64_t attempt);
  // The answer to attempt `attempt` (`epoch`: the reply's).
  void OnReply(uint64_t attempt, Outcome outcome, uint64_t epoch,
               const absl::Status& why, int64_t now_ns, Actions* out);
  // The result of kInstall.
  void Installed(uint64_t ep, uint64_t epoch, const absl::Status& result,
                 Actions* out);
  // A ConnectRequest from the peer for this rail, claiming `claimed_epoch`
  // (already validated); `new_ep` is the id for a fresh endpoint. Always
  // answers: kAccept (then AcceptDone answers), kReply or kRefuse.
  void OnRequest(uint64_t claimed_epoch, uint64_t new_ep, Actions* out);
  // The result of kAccept. Always answers (kReplyAccepted or kRefuse).
  void AcceptDone(uint64_t ep, uint64_t epoch, const absl::Status& result,
                  int64_t now_ns, Actions* out);
  // The peer's notices about connection `epoch`.
  void OnReady(uint64_t epoch, Actions* out);
  void OnDisconnect(uint64_t epoch, Actions* out);
  // Deadlines (tie-break winner, READY).
  void Tick(int64_t now_ns, Actions* out);
  // The data path failed `ep` (a QP error, a dead port or device, a
  // refused post): the rail has no endpoint.
  void Failed(uint64_t ep, Actions* out);
  // Closes `ep` (the caller checked it is connected and idle): kClose and
  // kTellDisconnect. False if `ep` is not the rail's connected endpoint.
  bool Close(uint64_t ep, Actions* out);
  // The peer restarted: its connections and epochs are gone.
  void Restart(Actions* out);

  Phase phase() const { return phase_; }
  // The current endpoint (0 in kIdle).
  uint64_t ep() const { return ep_; }
  // The rail's latest connection epoch known.
  uint64_t epoch() const { return epoch_; }
  uint64_t conn_epoch() const { return conn_epoch_; }
  bool confirmed() const { return confirmed_; }
  // A deadline is pending (Tick has work at some time).
  int64_t deadline_ns() const { return deadline_ns_; }
  // Our request for the current endpoint is out (a reply will come), and
  // its attempt.
  bool request_out() const { return attempt_ != 0; }
  uint64_t attempt() const { return attempt_; }

  // The whole state, for logs and for the model checker's visited set.
  std::string DebugString() const;
  // The whole state as raw bytes appended to *out (a compact key).
  void AppendKey(std::string* out) const;
  // Consistency of the state (for tests and fuzzing): OK or what is wrong.
  absl::Status CheckInvariants() const;

 private:
  void Reset();

  bool we_win_ties_;
  int64_t timeout_ns_;
  Phase phase_ = Phase::kIdle;
  uint64_t ep_ = 0;
  uint64_t attempt_ = 0;  // Outstanding request of ep_ (0: none).
  uint64_t next_attempt_ = 0;
  uint64_t epoch_ = 0;
  uint64_t conn_epoch_ = 0;
  int resends_ = 0;
  bool confirmed_ = false;
  int64_t deadline_ns_ = 0;
};

const char* PhaseName(RailConnector::Phase p);

// Per-peer handshake backoff (see the file comment). Not thread-safe.
class ConnectBackoff {
 public:
  static constexpr int64_t kBaseNs = 50'000'000;  // 50 ms
  static constexpr int kMaxShift = 5;             // 1.6 s

  // `probe_window_ns`: how long one probe may run before another is let
  // through (a probe whose result never comes must not block the peer).
  explicit ConnectBackoff(int64_t probe_window_ns)
      : probe_window_ns_(probe_window_ns) {}

  enum class Verdict : uint8_t { kGo, kProbe, kFailFast };
  // May a new handshake start now? kProbe: yes, as the only one until it
  // reports (or its window passes).
  Verdict Admit(int64_t now_ns);
  // A handshake failed / succeeded (or a connection was made either way).
  void Failed(int64_t now_ns, const absl::Status& why);
  void Succeeded();

  bool backing_off(int64_t now_ns) const {
    return failures_ > 0 && now_ns < retry_after_ns_;
  }
  // Bumped by every failure that (re)starts a backoff period: a handshake
  // admitted before the latest one is moot (the peer failed meanwhile).
  uint64_t generation() const { return generation_; }
  uint32_t failures() const { return failures_; }
  int64_t retry_after_ns() const { return retry_after_ns_; }
  const absl::Status& last_error() const { return last_error_; }

 private:
  int64_t probe_window_ns_;
  bool probing_ = false;
  uint64_t generation_ = 0;
  uint32_t failures_ = 0;  // Backoff level: failures in a row.
  int64_t retry_after_ns_ = 0;
  absl::Status last_error_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_CONNECTOR_H_
