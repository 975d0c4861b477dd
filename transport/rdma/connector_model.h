// A model of two peers connecting one rail, for checking RailConnector:
// each side's real RailConnector, with QPs, the control messages in flight
// (in any order), the operations the transport runs outside the peer lock
// (send a request, accept, install), deadlines, the data path using a
// connection, lost messages, failed operations and endpoints, evictions
// and a restart of one side. The world executes the machines' actions the
// way RailLifecycle does, minus verbs and threads.
//
// Enabled() lists what may happen next; Apply() makes it happen. At a
// quiescent state (nothing in flight, no deadline pending, no use that
// would fail) CheckQuiescent() says whether the rail is settled: each side
// idle or connected, never in between (wedged); if both are connected,
// their QPs are connected to each other (one endpoint, agreed); no QP
// outlives its endpoint.
#ifndef FERRY_TRANSPORT_RDMA_CONNECTOR_MODEL_H_
#define FERRY_TRANSPORT_RDMA_CONNECTOR_MODEL_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "transport/rdma/connector.h"

namespace ferry::rdma::model {

struct Budget {
  int needs = 2;           // Per side: times the data path wants the rail.
  int drops = 0;           // Messages lost (the RPC fails).
  int op_failures = 0;     // Accepts or installs that fail (QP errors).
  int local_failures = 0;  // Endpoints failed by the data path.
  int evictions = 0;       // Idle endpoints closed by their side.
  int restarts = 0;        // Restarts of side 1.
  // Deadlines fire only when nothing else is in flight (they are long):
  // for liveness checks. Otherwise they may fire at any moment.
  bool lazy_timers = false;
};

class World {
 public:
  struct Event {
    enum class Kind : uint8_t {
      kNeed,
      kRunSend,
      kDeliver,
      kDrop,
      kOpDone,
      kOpFail,
      kTimer,
      kUse,
      kLocalFail,
      kEvict,
      kRestart,
      kLearn,
    };
    Kind kind;
    int side = 0;
    int index = 0;  // Of the message or operation.
    std::string Describe() const;
  };

  explicit World(const Budget& budget);

  std::vector<Event> Enabled() const;
  void Apply(const Event& e);

  // Nothing in flight, nothing that must still happen.
  bool Quiescent() const;
  absl::Status CheckQuiescent() const;
  // Every step: the machines' own invariants.
  absl::Status CheckStep() const;
  // Liveness, for runs without faults: every side that wanted the rail is
  // connected, and no endpoint failed on the way.
  absl::Status CheckLive() const;

  // Canonical state, for a visited set.
  std::string Key() const;

  // A raw control message (an RdmaMessage payload) from side 0 arriving at
  // side 1, as the transport's peer handler gets it: parsed, validated,
  // then handed to the machine (for fuzzing). Returns the handler's status.
  absl::Status InjectPayload(const std::string& payload);
  // A raw ConnectReply arriving at side 1 for its request in flight, if it
  // has one (as the transport's connect job reads it).
  absl::Status InjectReply(const std::string& payload);

  const RailConnector& machine(int side) const { return sides_[side].m; }

 private:
  struct Qp {
    int side = 0;
    bool alive = true;
    int remote = -1;
  };
  struct Msg {
    enum class Type : uint8_t { kRequest, kReply, kNotice };
    Type type = Type::kRequest;
    int to = 0;
    uint64_t from_inc = 0;
    uint64_t to_inc = 0;
    uint64_t attempt = 0;
    int qp = -1;
    uint64_t epoch = 0;
    // Reply: 0 accepted, 1 lost tie-break, 2 superseded, 3 stale
    // incarnation, 4 error (the RPC failed), 5 refused. Notice: 0 READY,
    // 1 DISCONNECT.
    int result = 0;
  };
  struct Op {
    enum class Type : uint8_t { kSend, kAccept, kInstall };
    Type type = Type::kSend;
    int side = 0;
    uint64_t side_inc = 0;
    uint64_t ep = 0;
    uint64_t attempt = 0;
    uint64_t epoch = 0;
    int qp = -1;         // kAccept: the initiator's; kInstall: our own.
    int remote_qp = -1;  // kInstall: the target's.
    uint64_t req_from_inc = 0;
  };
  struct Side {
    explicit Side(bool wins) : m(wins, kTimeout) {}
    RailConnector m;
    uint64_t inc = 0;
    uint64_t peer_inc = 0;
    int needs_left = 0;
    bool wanted = false;
    std::map<uint64_t, int> ep_qp;       // Endpoint -> its QP (-1: none).
    std::map<uint64_t, int> attempt_qp;  // Request out -> its QP.
  };
  // What the actions being executed refer to.
  struct Ctx {
    const Msg* request = nullptr;
    int new_qp = -1;  // A QP connected by the operation that just ended.
    bool new_qp_used = false;
    uint64_t reply_attempt = 0;
    uint64_t reply_to_inc = 0;
    int reply_qp = -1;
  };
  static constexpr int64_t kTimeout = 1000;

  // A message's envelope: to whom, and between which runs of the sides
  // (0 where the sender's run does not matter); the payload is the
  // caller's to fill in.
  static Msg Addressed(Msg::Type type, int to, uint64_t from_inc,
                       uint64_t to_inc);
  // An operation of `side`'s current run for the action that asks for it.
  Op NewOp(Op::Type type, int side, const RailConnector::Action& a) const;
  // `side` learns that its peer now runs as `peer_inc`: the peer's
  // connections and epochs are gone.
  void PeerRestarted(int side, uint64_t peer_inc, Ctx* ctx);

  void ApplyOne(const Event& e);
  void Exec(int side, const RailConnector::Actions& acts, Ctx* ctx);
  void Kill(int qp);
  void DropEndpoint(int side, uint64_t ep);
  int NewQp(int side);
  void Send(Msg m) { msgs_.push_back(m); }
  bool UseFails(int side) const;
  void Deliver(const Msg& m);

  Budget budget_;
  std::vector<Side> sides_;
  std::vector<Qp> qps_;
  std::vector<Msg> msgs_;
  std::vector<Op> ops_;
  uint64_t next_ep_ = 1;
  uint64_t next_inc_ = 1;
  int64_t now_ = 0;
  int fails_ = 0;      // Endpoints failed (for liveness).
  std::string error_;  // A model-level inconsistency seen while applying.
};

}  // namespace ferry::rdma::model

#endif  // FERRY_TRANSPORT_RDMA_CONNECTOR_MODEL_H_
