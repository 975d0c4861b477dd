#include "transport/rdma/connector.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ferry::rdma {
namespace {

using Action = RailConnector::Action;
using Kind = RailConnector::Action::Kind;

Action Make(Kind kind, uint64_t ep = 0, uint64_t epoch = 0) {
  Action a;
  a.kind = kind;
  a.ep = ep;
  a.epoch = epoch;
  return a;
}

}  // namespace

const char* PhaseName(RailConnector::Phase p) {
  switch (p) {
    case RailConnector::Phase::kIdle:
      return "idle";
    case RailConnector::Phase::kRequesting:
      return "requesting";
    case RailConnector::Phase::kAwaitingPeer:
      return "awaiting-peer";
    case RailConnector::Phase::kAccepting:
      return "accepting";
    case RailConnector::Phase::kInstalling:
      return "installing";
    case RailConnector::Phase::kConnected:
      return "connected";
  }
  return "?";
}

void RailConnector::Reset() {
  phase_ = Phase::kIdle;
  ep_ = 0;
  attempt_ = 0;
  conn_epoch_ = 0;
  resends_ = 0;
  confirmed_ = false;
  deadline_ns_ = 0;
}

bool RailConnector::Need(uint64_t new_ep, Actions* out) {
  if (phase_ != Phase::kIdle) return false;
  Reset();
  phase_ = Phase::kRequesting;
  ep_ = new_ep;
  attempt_ = ++next_attempt_;
  Action a = Make(Kind::kSendRequest, ep_, epoch_);
  a.attempt = attempt_;
  out->push_back(a);
  return true;
}

bool RailConnector::BeginSend(uint64_t attempt) {
  if (attempt != attempt_) return false;
  if (phase_ == Phase::kRequesting) return true;
  // Adopted meanwhile (or being adopted): our request is moot.
  attempt_ = 0;
  return false;
}

void RailConnector::OnReply(uint64_t attempt, Outcome outcome, uint64_t epoch,
                            const absl::Status& why, int64_t now_ns,
                            Actions* out) {
  if (outcome == Outcome::kSuperseded || outcome == Outcome::kAccepted) {
    epoch_ = std::max(epoch_, epoch);
  }
  if (attempt == 0 || attempt != attempt_ || phase_ != Phase::kRequesting) {
    // The endpoint failed, was replaced or adopted meanwhile. A connection
    // the peer made for it is nobody's: close it there, not leave it dead.
    if (attempt != 0 && attempt == attempt_) attempt_ = 0;
    if (outcome == Outcome::kAccepted) {
      out->push_back(Make(Kind::kTellDisconnect, 0, epoch));
    }
    return;
  }
  attempt_ = 0;
  switch (outcome) {
    case Outcome::kAccepted:
      phase_ = Phase::kInstalling;
      conn_epoch_ = epoch;
      out->push_back(Make(Kind::kInstall, ep_, epoch));
      out->back().attempt = attempt;
      return;
    case Outcome::kLostTieBreak:
      // The peer is connecting this rail too and its request wins: it
      // brings the QPs, or the endpoint fails at the deadline.
      phase_ = Phase::kAwaitingPeer;
      deadline_ns_ = now_ns + timeout_ns_;
      return;
    case Outcome::kSuperseded:
      // The rail has a newer connection than we knew of: the peer's half of
      // it is ours to replace (we lost ours), claiming the epoch we now
      // know -- once; a second SUPERSEDED means the rail keeps changing.
      if (resends_ < kMaxResends) {
        ++resends_;
        attempt_ = ++next_attempt_;
        Action a = Make(Kind::kSendRequest, ep_, epoch_);
        a.attempt = attempt_;
        out->push_back(a);
        return;
      }
      {
        Action a = Make(Kind::kFail, ep_);
        a.why = absl::UnavailableError(
            "RDMA connect superseded twice by newer connections of the rail");
        out->push_back(a);
      }
      Reset();
      return;
    case Outcome::kRefused:
    case Outcome::kFailed: {
      Action a = Make(Kind::kFail, ep_);
      a.why = why.ok() ? absl::UnavailableError("RDMA connect failed") : why;
      a.backoff = outcome == Outcome::kFailed;
      a.rail_fault = outcome == Outcome::kRefused;
      out->push_back(a);
      Reset();
      return;
    }
  }
}

void RailConnector::Installed(uint64_t ep, uint64_t epoch,
                              const absl::Status& result, Actions* out) {
  if (ep != ep_ || phase_ != Phase::kInstalling || epoch != conn_epoch_) {
    // Failed, closed or replaced while our QPs were being connected.
    out->push_back(Make(Kind::kTellDisconnect, 0, epoch));
    return;
  }
  if (result.ok()) {
    phase_ = Phase::kConnected;
    confirmed_ = true;
    Action a = Make(Kind::kActivate, ep, epoch);
    a.confirmed = true;
    out->push_back(a);
    out->push_back(Make(Kind::kTellReady, ep, epoch));
    return;
  }
  // Our QPs would not take the peer's validated answer (our NIC failed
  // meanwhile): pause the rail, not the peer -- its other rails still work.
  Action a = Make(Kind::kFail, ep);
  a.why = result;
  a.rail_fault = true;
  out->push_back(a);
  out->push_back(Make(Kind::kTellDisconnect, 0, epoch));
  Reset();
}

void RailConnector::OnRequest(uint64_t claimed_epoch, uint64_t new_ep,
                              Actions* out) {
  switch (phase_) {
    case Phase::kRequesting:
      if (we_win_ties_) {
        // Both sides are connecting this rail: ours wins, and the peer
        // adopts our QPs when our request arrives.
        Action a = Make(Kind::kReply, 0, epoch_);
        a.result = ConnectReply::LOST_TIE_BREAK;
        out->push_back(a);
        return;
      }
      [[fallthrough]];
    case Phase::kAwaitingPeer: {
      // The peer's request wins: adopt its QPs into our endpoint (the
      // slices waiting there go out on them).
      phase_ = Phase::kAccepting;
      conn_epoch_ = epoch_ = std::max(epoch_, claimed_epoch) + 1;
      deadline_ns_ = 0;
      Action a = Make(Kind::kAccept, ep_, conn_epoch_);
      a.fresh = false;
      out->push_back(a);
      return;
    }
    case Phase::kAccepting: {
      // A second request while one is being accepted: the peer gave up on
      // the first. Refused; it backs off and tries again.
      Action a = Make(Kind::kRefuse);
      a.why = absl::UnavailableError(
          "a connect for this RDMA rail is being accepted");
      out->push_back(a);
      return;
    }
    case Phase::kInstalling:
    case Phase::kConnected:
      if (claimed_epoch < epoch_) {
        // Sent before its sender learned of the rail's current connection.
        Action a = Make(Kind::kReply, 0, epoch_);
        a.result = ConnectReply::SUPERSEDED;
        out->push_back(a);
        return;
      }
      {
        // The peer knew the current connection and replaces it: it lost
        // its half.
        Action a = Make(Kind::kFail, ep_);
        a.why = absl::UnavailableError("RDMA connection replaced by the peer");
        a.flush = true;
        out->push_back(a);
      }
      Reset();
      [[fallthrough]];
    case Phase::kIdle: {
      Reset();
      phase_ = Phase::kAccepting;
      ep_ = new_ep;
      conn_epoch_ = epoch_ = std::max(epoch_, claimed_epoch) + 1;
      Action a = Make(Kind::kAccept, ep_, conn_epoch_);
      a.fresh = true;
      out->push_back(a);
      return;
    }
  }
}

void RailConnector::AcceptDone(uint64_t ep, uint64_t epoch,
                               const absl::Status& result, int64_t now_ns,
                               Actions* out) {
  if (ep != ep_ || phase_ != Phase::kAccepting || epoch != conn_epoch_) {
    Action a = Make(Kind::kRefuse);
    a.why = absl::UnavailableError(
        "RDMA endpoint failed or was replaced during the connect");
    out->push_back(a);
    return;
  }
  if (!result.ok()) {
    Action f = Make(Kind::kFail, ep);
    f.why = result;
    out->push_back(f);
    Action r = Make(Kind::kRefuse);
    r.why = result;
    out->push_back(r);
    Reset();
    return;
  }
  // Usable for sending once the initiator's QPs can receive: READY, or
  // the deadline (RC retransmission covers a slow initiator).
  phase_ = Phase::kConnected;
  confirmed_ = false;
  deadline_ns_ = now_ns + timeout_ns_;
  Action a = Make(Kind::kActivate, ep, epoch);
  a.confirmed = false;
  out->push_back(a);
  out->push_back(Make(Kind::kReplyAccepted, ep, epoch));
}

void RailConnector::OnReady(uint64_t epoch, Actions* out) {
  if (phase_ != Phase::kConnected || epoch != conn_epoch_ || confirmed_) {
    return;
  }
  confirmed_ = true;
  deadline_ns_ = 0;
  out->push_back(Make(Kind::kConfirm, ep_, epoch));
}

void RailConnector::OnDisconnect(uint64_t epoch, Actions* out) {
  // Only the connection the peer means: a newer one, or one still being
  // set up, stays.
  if ((phase_ != Phase::kConnected && phase_ != Phase::kInstalling) ||
      epoch != conn_epoch_) {
    return;
  }
  out->push_back(Make(Kind::kClose, ep_, conn_epoch_));
  Reset();
}

void RailConnector::Tick(int64_t now_ns, Actions* out) {
  if (deadline_ns_ == 0 || now_ns < deadline_ns_) return;
  if (phase_ == Phase::kAwaitingPeer) {
    Action a = Make(Kind::kFail, ep_);
    a.why = absl::UnavailableError(
        "the peer won the RDMA connect tie-break but did not connect");
    out->push_back(a);
    Reset();
    return;
  }
  if (phase_ == Phase::kConnected && !confirmed_) {
    confirmed_ = true;
    out->push_back(Make(Kind::kConfirm, ep_, conn_epoch_));
  }
  deadline_ns_ = 0;
}

void RailConnector::Failed(uint64_t ep, Actions* out) {
  if (ep == 0 || ep != ep_) return;
  // A connected peer half is useless without ours: tell the peer, so it
  // does not wait for its QPs to fail. (While installing, Installed tells
  // it; while accepting, the peer's request is refused.)
  if (phase_ == Phase::kConnected) {
    out->push_back(Make(Kind::kTellDisconnect, 0, conn_epoch_));
  }
  Reset();
}

bool RailConnector::Close(uint64_t ep, Actions* out) {
  if (ep == 0 || ep != ep_ || phase_ != Phase::kConnected) return false;
  out->push_back(Make(Kind::kClose, ep_, conn_epoch_));
  out->push_back(Make(Kind::kTellDisconnect, 0, conn_epoch_));
  Reset();
  return true;
}

void RailConnector::Restart(Actions* out) {
  if (phase_ != Phase::kIdle) {
    Action a = Make(Kind::kFail, ep_);
    a.why = absl::UnavailableError("peer restarted");
    a.flush = true;
    out->push_back(a);
  }
  Reset();
  epoch_ = 0;
}

std::string RailConnector::DebugString() const {
  return absl::StrCat(PhaseName(phase_), " ep=", ep_, " att=", attempt_,
                      " epoch=", epoch_, "/", conn_epoch_, " rs=", resends_,
                      confirmed_ ? " confirmed" : "",
                      deadline_ns_ != 0 ? " timer" : "");
}

void RailConnector::AppendKey(std::string* out) const {
  const uint64_t words[] = {static_cast<uint64_t>(phase_),
                            ep_,
                            attempt_,
                            next_attempt_,
                            epoch_,
                            conn_epoch_,
                            static_cast<uint64_t>(resends_),
                            confirmed_ ? 1u : 0u,
                            deadline_ns_ != 0 ? 1u : 0u};
  out->append(reinterpret_cast<const char*>(words), sizeof(words));
}

absl::Status RailConnector::CheckInvariants() const {
  auto bad = [&](absl::string_view what) {
    return absl::InternalError(absl::StrCat(what, ": ", DebugString()));
  };
  if ((phase_ == Phase::kIdle) != (ep_ == 0)) return bad("endpoint vs phase");
  if (phase_ == Phase::kIdle && (attempt_ != 0 || deadline_ns_ != 0)) {
    return bad("idle with a request or a timer");
  }
  if (conn_epoch_ > epoch_) return bad("connection newer than the rail");
  const bool has_conn = phase_ == Phase::kAccepting ||
                        phase_ == Phase::kInstalling ||
                        phase_ == Phase::kConnected;
  if (has_conn != (conn_epoch_ != 0)) return bad("connection epoch vs phase");
  if (phase_ == Phase::kAwaitingPeer && deadline_ns_ == 0) {
    return bad("awaiting the peer without a deadline");
  }
  if (phase_ == Phase::kConnected && confirmed_ == (deadline_ns_ != 0)) {
    return bad("confirmation vs its deadline");
  }
  if (phase_ != Phase::kConnected && phase_ != Phase::kAwaitingPeer &&
      deadline_ns_ != 0) {
    return bad("a timer in a phase without one");
  }
  if (phase_ == Phase::kRequesting && attempt_ == 0) {
    return bad("requesting without a request");
  }
  if (attempt_ > next_attempt_) return bad("attempt from the future");
  return absl::OkStatus();
}

ConnectBackoff::Verdict ConnectBackoff::Admit(int64_t now_ns) {
  if (failures_ == 0) return Verdict::kGo;
  if (now_ns < retry_after_ns_) return Verdict::kFailFast;
  probing_ = true;
  retry_after_ns_ = now_ns + probe_window_ns_;
  return Verdict::kProbe;
}

void ConnectBackoff::Failed(int64_t now_ns, const absl::Status& why) {
  last_error_ = why;
  // Handshakes of one round (e.g. every rail at first contact) fail
  // together: the first one sets the backoff, the others do not escalate.
  if (failures_ != 0 && !probing_ && now_ns < retry_after_ns_) return;
  probing_ = false;
  ++generation_;
  failures_ = std::min<uint32_t>(failures_ + 1, 64);
  const int shift = std::min<int>(static_cast<int>(failures_) - 1, kMaxShift);
  retry_after_ns_ = now_ns + (kBaseNs << shift);
}

void ConnectBackoff::Succeeded() {
  failures_ = 0;
  retry_after_ns_ = 0;
  probing_ = false;
  last_error_ = absl::OkStatus();
}

}  // namespace ferry::rdma
