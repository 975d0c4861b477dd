#include "transport/rdma/connector_model.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "transport/rdma/handshake.h"

namespace ferry::rdma::model {
namespace {

using Kind = RailConnector::Action::Kind;
using Phase = RailConnector::Phase;

constexpr int kAccepted = 0, kLost = 1, kSuperseded = 2, kStale = 3, kError = 4,
              kRefused = 5;
constexpr int kReady = 0, kDisconnect = 1;

// The reply results the machine sees as outcomes of their own; the others
// (stale incarnation, error) are kFailed. One table for both directions,
// so that a delivered reply and a forged one cannot disagree.
struct ReplyOutcome {
  int result;
  RailConnector::Outcome outcome;
};
constexpr ReplyOutcome kReplyOutcomes[] = {
    {kAccepted, RailConnector::Outcome::kAccepted},
    {kLost, RailConnector::Outcome::kLostTieBreak},
    {kSuperseded, RailConnector::Outcome::kSuperseded},
    {kRefused, RailConnector::Outcome::kRefused},
};

RailConnector::Outcome OutcomeOfResult(int result) {
  for (const ReplyOutcome& r : kReplyOutcomes) {
    if (r.result == result) return r.outcome;
  }
  return RailConnector::Outcome::kFailed;
}

// Not for kFailed, whose result depends on why (stale or error).
int ResultOfOutcome(RailConnector::Outcome outcome) {
  for (const ReplyOutcome& r : kReplyOutcomes) {
    if (r.outcome == outcome) return r.result;
  }
  return kError;
}

// Removes and returns the message or operation at `index` (the one that
// goes next).
template <typename T>
T TakeAt(std::vector<T>* items, int index) {
  T item = (*items)[index];
  items->erase(items->begin() + index);
  return item;
}

const char* EventName(World::Event::Kind k) {
  switch (k) {
    case World::Event::Kind::kNeed:
      return "need";
    case World::Event::Kind::kRunSend:
      return "send";
    case World::Event::Kind::kDeliver:
      return "deliver";
    case World::Event::Kind::kDrop:
      return "drop";
    case World::Event::Kind::kOpDone:
      return "op-done";
    case World::Event::Kind::kOpFail:
      return "op-fail";
    case World::Event::Kind::kTimer:
      return "timer";
    case World::Event::Kind::kUse:
      return "use-fails";
    case World::Event::Kind::kLocalFail:
      return "local-fail";
    case World::Event::Kind::kEvict:
      return "evict";
    case World::Event::Kind::kRestart:
      return "restart";
    case World::Event::Kind::kLearn:
      return "learn-restart";
  }
  return "?";
}

}  // namespace

std::string World::Event::Describe() const {
  return absl::StrCat(EventName(kind), "(", side == 0 ? "a" : "b", ",", index,
                      ")");
}

World::World(const Budget& budget) : budget_(budget) {
  // Side 0 ("a") sorts first: it wins tie-breaks.
  sides_.emplace_back(true);
  sides_.emplace_back(false);
  for (Side& s : sides_) {
    s.inc = next_inc_++;
    s.needs_left = budget.needs;
  }
  sides_[0].peer_inc = sides_[1].inc;
  sides_[1].peer_inc = sides_[0].inc;
}

int World::NewQp(int side) {
  qps_.push_back(Qp{side, true, -1});
  return static_cast<int>(qps_.size()) - 1;
}

void World::Kill(int qp) {
  if (qp >= 0) qps_[qp].alive = false;
}

void World::DropEndpoint(int side, uint64_t ep) {
  auto it = sides_[side].ep_qp.find(ep);
  if (it == sides_[side].ep_qp.end()) return;
  Kill(it->second);
  sides_[side].ep_qp.erase(it);
}

World::Msg World::Addressed(Msg::Type type, int to, uint64_t from_inc,
                            uint64_t to_inc) {
  Msg m;
  m.type = type;
  m.to = to;
  m.from_inc = from_inc;
  m.to_inc = to_inc;
  return m;
}

World::Op World::NewOp(Op::Type type, int side,
                       const RailConnector::Action& a) const {
  Op op;
  op.type = type;
  op.side = side;
  op.side_inc = sides_[side].inc;
  op.ep = a.ep;
  op.attempt = a.attempt;
  op.epoch = a.epoch;
  return op;
}

void World::PeerRestarted(int side, uint64_t peer_inc, Ctx* ctx) {
  RailConnector::Actions acts;
  sides_[side].m.Restart(&acts);
  Exec(side, acts, ctx);
  sides_[side].peer_inc = peer_inc;
}

void World::Exec(int side, const RailConnector::Actions& acts, Ctx* ctx) {
  Side& s = sides_[side];
  const int other = 1 - side;
  for (const RailConnector::Action& a : acts) {
    switch (a.kind) {
      case Kind::kSendRequest:
        ops_.push_back(NewOp(Op::Type::kSend, side, a));
        s.ep_qp.emplace(a.ep, -1);
        break;
      case Kind::kInstall: {
        auto it = s.attempt_qp.find(a.attempt);
        if (it == s.attempt_qp.end()) {
          error_ = "install of an attempt without QPs";
          break;
        }
        Op op = NewOp(Op::Type::kInstall, side, a);
        op.qp = it->second;
        s.attempt_qp.erase(it);
        op.remote_qp = ctx->reply_qp;
        ops_.push_back(op);
        break;
      }
      case Kind::kAccept: {
        if (ctx->request == nullptr) {
          error_ = "accept outside a request";
          break;
        }
        Op op = NewOp(Op::Type::kAccept, side, a);
        // The reply answers the initiator's attempt, not one of ours.
        op.attempt = ctx->request->attempt;
        op.qp = ctx->request->qp;
        op.req_from_inc = ctx->request->from_inc;
        ops_.push_back(op);
        if (a.fresh) s.ep_qp.emplace(a.ep, -1);
        break;
      }
      case Kind::kReply:
      case Kind::kReplyAccepted:
      case Kind::kRefuse: {
        Msg m = Addressed(Msg::Type::kReply, other, s.inc, ctx->reply_to_inc);
        m.attempt = ctx->reply_attempt;
        m.epoch = a.epoch;
        if (a.kind == Kind::kReplyAccepted) {
          m.result = kAccepted;
          m.qp = ctx->new_qp;
        } else if (a.kind == Kind::kRefuse) {
          m.result = kRefused;
        } else {
          m.result =
              a.result == ConnectReply::LOST_TIE_BREAK ? kLost : kSuperseded;
        }
        Send(m);
        break;
      }
      case Kind::kActivate: {
        auto it = s.ep_qp.find(a.ep);
        if (it == s.ep_qp.end() || ctx->new_qp < 0) {
          error_ = absl::StrCat("activate of unknown endpoint ", a.ep);
          break;
        }
        Kill(it->second);
        it->second = ctx->new_qp;
        ctx->new_qp_used = true;
        break;
      }
      case Kind::kConfirm:
        break;
      case Kind::kFail:
        ++fails_;
        DropEndpoint(side, a.ep);
        break;
      case Kind::kClose:
        DropEndpoint(side, a.ep);
        break;
      case Kind::kTellReady:
      case Kind::kTellDisconnect: {
        Msg m = Addressed(Msg::Type::kNotice, other, s.inc, s.peer_inc);
        m.epoch = a.epoch;
        m.result = a.kind == Kind::kTellReady ? kReady : kDisconnect;
        Send(m);
        break;
      }
    }
  }
}

bool World::UseFails(int side) const {
  const Side& s = sides_[side];
  if (s.m.phase() != Phase::kConnected || !s.m.confirmed()) return false;
  auto it = s.ep_qp.find(s.m.ep());
  if (it == s.ep_qp.end() || it->second < 0) return true;
  const int q = it->second;
  const int r = qps_[q].remote;
  if (!qps_[q].alive || r < 0 || !qps_[r].alive) return true;
  // A peer QP not connected yet (not in RTR) drops what we send, and RC
  // retransmits until it is: that fails only if it never gets there (it
  // dies) or it is connected to another QP.
  return qps_[r].remote != q && qps_[r].remote != -1;
}

std::vector<World::Event> World::Enabled() const {
  using K = Event::Kind;
  std::vector<Event> ev;
  const bool busy = !msgs_.empty() || !ops_.empty();
  for (int side = 0; side < 2; ++side) {
    const Side& s = sides_[side];
    if (s.needs_left > 0 && s.m.phase() == Phase::kIdle) {
      ev.push_back({K::kNeed, side, 0});
    }
    if (s.m.deadline_ns() != 0 && (!budget_.lazy_timers || !busy)) {
      ev.push_back({K::kTimer, side, 0});
    }
    if (UseFails(side)) ev.push_back({K::kUse, side, 0});
    if (budget_.local_failures > 0 && s.m.phase() != Phase::kIdle) {
      ev.push_back({K::kLocalFail, side, 0});
    }
    if (budget_.evictions > 0 && s.m.phase() == Phase::kConnected &&
        s.m.confirmed()) {
      ev.push_back({K::kEvict, side, 0});
    }
  }
  for (size_t i = 0; i < ops_.size(); ++i) {
    const int side = ops_[i].side;
    if (ops_[i].type == Op::Type::kSend) {
      ev.push_back({K::kRunSend, side, static_cast<int>(i)});
    } else {
      ev.push_back({K::kOpDone, side, static_cast<int>(i)});
      if (budget_.op_failures > 0) {
        ev.push_back({K::kOpFail, side, static_cast<int>(i)});
      }
    }
  }
  for (size_t i = 0; i < msgs_.size(); ++i) {
    ev.push_back({K::kDeliver, msgs_[i].to, static_cast<int>(i)});
    if (budget_.drops > 0) {
      ev.push_back({K::kDrop, msgs_[i].to, static_cast<int>(i)});
    }
  }
  if (budget_.restarts > 0) ev.push_back({K::kRestart, 1, 0});
  if (sides_[0].peer_inc != sides_[1].inc) ev.push_back({K::kLearn, 0, 0});
  return ev;
}

void World::Deliver(const Msg& m) {
  Side& t = sides_[m.to];
  RailConnector::Actions acts;
  Ctx ctx;
  switch (m.type) {
    case Msg::Type::kRequest: {
      ctx.request = &m;
      ctx.reply_attempt = m.attempt;
      ctx.reply_to_inc = m.from_inc;
      // The transport answers these itself: the rail's machine never
      // sees the request.
      auto answer = [&](int result, uint64_t epoch) {
        Msg r = Addressed(Msg::Type::kReply, 1 - m.to, t.inc, m.from_inc);
        r.attempt = m.attempt;
        r.epoch = epoch;
        r.result = result;
        Send(r);
      };
      // The transport's peer-level checks, then the rail's machine.
      if (m.to_inc != t.inc) {  // 0 is no run (OnConnect).
        answer(kStale, t.inc);  // The target's incarnation rides in epoch.
        return;
      }
      if (m.from_inc != t.peer_inc) {
        if (m.from_inc < t.peer_inc) {  // An earlier run of the peer.
          answer(kError, 0);
          return;
        }
        PeerRestarted(m.to, m.from_inc, &ctx);
      }
      t.m.OnRequest(m.epoch, next_ep_++, &acts);
      Exec(m.to, acts, &ctx);
      return;
    }
    case Msg::Type::kReply: {
      if (m.to_inc != t.inc) return;  // To a process that is gone.
      const RailConnector::Outcome outcome = OutcomeOfResult(m.result);
      // A stale incarnation reply carries the target's run in epoch.
      if (m.result == kStale && m.epoch > t.peer_inc) {
        PeerRestarted(m.to, m.epoch, &ctx);
      }
      ctx.reply_qp = m.qp;
      t.m.OnReply(m.attempt, outcome, m.result == kStale ? 0 : m.epoch,
                  absl::UnavailableError("model"), now_, &acts);
      // The attempt's QPs go unless an install took them.
      auto it = t.attempt_qp.find(m.attempt);
      bool installing = false;
      for (const auto& a : acts) installing |= a.kind == Kind::kInstall;
      if (it != t.attempt_qp.end() && !installing) {
        Kill(it->second);
        t.attempt_qp.erase(it);
      }
      Exec(m.to, acts, &ctx);
      // An accepted reply that installs nothing leaves the target's QP to
      // the DISCONNECT the machine sent.
      return;
    }
    case Msg::Type::kNotice:
      if (m.from_inc != t.peer_inc || m.to_inc != t.inc) return;
      if (m.result == kReady) {
        t.m.OnReady(m.epoch, &acts);
      } else {
        t.m.OnDisconnect(m.epoch, &acts);
      }
      Exec(m.to, acts, &ctx);
      return;
  }
}

void World::Apply(const Event& e) {
  ApplyOne(e);
  // A send whose attempt is no longer the machine's current one does
  // nothing when it runs (BeginSend refuses it without side effects):
  // forget it now, so that interleavings differing only in when it runs
  // are one state.
  ops_.erase(
      std::remove_if(ops_.begin(), ops_.end(),
                     [&](const Op& op) {
                       return op.type == Op::Type::kSend &&
                              (op.side_inc != sides_[op.side].inc ||
                               !sides_[op.side].m.request_out() ||
                               sides_[op.side].m.attempt() != op.attempt);
                     }),
      ops_.end());
}

void World::ApplyOne(const Event& e) {
  using K = Event::Kind;
  RailConnector::Actions acts;
  Ctx ctx;
  Side& s = sides_[e.side];
  switch (e.kind) {
    case K::kNeed:
      --s.needs_left;
      s.wanted = true;
      s.m.Need(next_ep_++, &acts);
      Exec(e.side, acts, &ctx);
      return;
    case K::kRunSend: {
      const Op op = TakeAt(&ops_, e.index);
      if (op.side_inc != s.inc) return;
      if (!s.m.BeginSend(op.attempt)) return;
      const int q = NewQp(e.side);
      s.attempt_qp[op.attempt] = q;
      Msg m = Addressed(Msg::Type::kRequest, 1 - e.side, s.inc, s.peer_inc);
      m.attempt = op.attempt;
      m.qp = q;
      m.epoch = op.epoch;
      Send(m);
      return;
    }
    case K::kDeliver:
      Deliver(TakeAt(&msgs_, e.index));
      return;
    case K::kDrop: {
      --budget_.drops;
      const Msg m = TakeAt(&msgs_, e.index);
      if (m.type == Msg::Type::kNotice) return;
      // The caller's RPC fails: it sees an error instead of the reply. (The
      // target's QP of a lost accepted reply stays with the target's
      // endpoint; the initiator never learns of it.)
      Msg r = m.type == Msg::Type::kRequest
                  ? Addressed(Msg::Type::kReply, 1 - m.to, 0, m.from_inc)
                  : Addressed(Msg::Type::kReply, m.to, 0, m.to_inc);
      r.attempt = m.attempt;
      r.result = kError;
      Send(r);
      return;
    }
    case K::kOpDone:
    case K::kOpFail: {
      const bool ok = e.kind == K::kOpDone;
      if (!ok) --budget_.op_failures;
      const Op op = TakeAt(&ops_, e.index);
      if (op.side_inc != s.inc) return;  // Its process is gone.
      const absl::Status result =
          ok ? absl::OkStatus() : absl::UnavailableError("QP failure");
      if (op.type == Op::Type::kAccept) {
        ctx.reply_attempt = op.attempt;
        ctx.reply_to_inc = op.req_from_inc;
        if (ok) {
          ctx.new_qp = NewQp(e.side);
          qps_[ctx.new_qp].remote = op.qp;
        }
        s.m.AcceptDone(op.ep, op.epoch, result, now_, &acts);
      } else {
        ctx.new_qp = op.qp;
        if (ok) qps_[op.qp].remote = op.remote_qp;
        s.m.Installed(op.ep, op.epoch, result, &acts);
      }
      Exec(e.side, acts, &ctx);
      if (ctx.new_qp >= 0 && !ctx.new_qp_used) Kill(ctx.new_qp);
      return;
    }
    case K::kTimer:
      s.m.Tick(std::numeric_limits<int64_t>::max(), &acts);
      Exec(e.side, acts, &ctx);
      return;
    case K::kUse:
    case K::kLocalFail: {
      if (e.kind == K::kLocalFail) --budget_.local_failures;
      const uint64_t ep = s.m.ep();
      DropEndpoint(e.side, ep);
      ++fails_;
      s.m.Failed(ep, &acts);
      Exec(e.side, acts, &ctx);
      return;
    }
    case K::kEvict:
      --budget_.evictions;
      if (!s.m.Close(s.m.ep(), &acts)) error_ = "eviction refused";
      Exec(e.side, acts, &ctx);
      return;
    case K::kRestart: {
      --budget_.restarts;
      Side fresh(false);
      fresh.inc = next_inc_++;
      fresh.peer_inc = sides_[0].inc;  // From the peer's descriptor.
      fresh.needs_left = s.needs_left;
      for (auto& [ep, q] : s.ep_qp) Kill(q);
      for (auto& [att, q] : s.attempt_qp) Kill(q);
      for (Qp& q : qps_) {
        if (q.side == 1) q.alive = false;
      }
      sides_[1] = fresh;
      // Its operations die with it, failing the RPCs they were answering;
      // messages to it find the new run.
      for (const Op& op : ops_) {
        if (op.side != 1 || op.type != Op::Type::kAccept) continue;
        Msg r = Addressed(Msg::Type::kReply, 0, 0, op.req_from_inc);
        r.attempt = op.attempt;
        r.result = kError;
        Send(r);
      }
      ops_.erase(std::remove_if(ops_.begin(), ops_.end(),
                                [](const Op& op) { return op.side == 1; }),
                 ops_.end());
      return;
    }
    case K::kLearn:
      // The peer's new descriptor (fetched after failures).
      PeerRestarted(0, sides_[1].inc, &ctx);
      return;
  }
}

absl::Status World::InjectPayload(const std::string& payload) {
  // Side 1's peer handler, given a message from side 0 ("a").
  FERRY_ASSIGN_OR_RETURN(const RdmaMessage msg, ParseRdmaMessage(payload));
  if (msg.has_connect()) {
    const ConnectRequest& req = msg.connect();
    FERRY_RETURN_IF_ERROR(ValidateConnectRequest(req, "a"));
    if (req.target_nic() != "nic0" || req.initiator_nic() != "nic0") {
      return absl::NotFoundError("no such rail");
    }
    Msg m = Addressed(Msg::Type::kRequest, 1, req.initiator_incarnation(),
                      req.target_incarnation());
    m.attempt = req.initiator_qps(0).qpn();  // Any id: replies go nowhere.
    m.qp = NewQp(0);
    qps_[m.qp].alive = false;  // Nobody's: a forged request's QP.
    m.epoch = req.rail_epoch();
    Deliver(m);
    return absl::OkStatus();
  }
  const RailNotice& n = msg.notice();
  FERRY_RETURN_IF_ERROR(ValidateRailNotice(n, "a"));
  Msg m = Addressed(Msg::Type::kNotice, 1, n.initiator_incarnation(),
                    n.target_incarnation());
  m.epoch = n.epoch();
  m.result = n.kind() == RailNotice::READY ? kReady : kDisconnect;
  Deliver(m);
  return absl::OkStatus();
}

absl::Status World::InjectReply(const std::string& payload) {
  Side& t = sides_[1];
  if (!t.m.request_out() || t.attempt_qp.count(t.m.attempt()) == 0) {
    return absl::FailedPreconditionError("no request out");
  }
  ConnectReply reply;
  if (!reply.ParseFromString(payload)) {
    return absl::InvalidArgumentError("malformed RDMA connect reply");
  }
  FERRY_RETURN_IF_ERROR(ValidateConnectReply(reply, 1));
  Msg m = Addressed(Msg::Type::kReply, 1, 0, t.inc);
  m.attempt = t.m.attempt();
  m.epoch = reply.epoch();
  const RailConnector::Outcome outcome = OutcomeOf(reply);
  if (outcome == RailConnector::Outcome::kFailed) {
    m.result =
        reply.result() == ConnectReply::STALE_INCARNATION ? kStale : kError;
    m.epoch = reply.target_incarnation();
  } else {
    m.result = ResultOfOutcome(outcome);
  }
  if (m.result == kAccepted) {
    m.qp = NewQp(0);
    qps_[m.qp].alive = false;  // Forged: no QP behind it.
  }
  Deliver(m);
  return absl::OkStatus();
}

}  // namespace ferry::rdma::model
