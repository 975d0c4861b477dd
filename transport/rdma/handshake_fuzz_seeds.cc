// Writes the seed corpus of handshake_fuzz_test (transport/rdma/fuzz/
// handshake_fuzz_test_corpus): valid messages of every kind in the
// fuzzer's record format (handshake_fuzz.cc), at moments where side 1 can
// act on them, and whole protocol runs.
//   bazel run //transport/rdma:handshake_fuzz_seeds --
//   "$PWD/transport/rdma/fuzz/handshake_fuzz_test_corpus"
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "transport/rdma/connector_model.h"
#include "transport/rdma/handshake.pb.h"

namespace {

using ferry::rdma::ConnectReply;
using ferry::rdma::ConnectRequest;
using ferry::rdma::QpInfo;
using ferry::rdma::RailNotice;
using ferry::rdma::RdmaMessage;
using ferry::rdma::model::Budget;
using ferry::rdma::model::World;
using Kind = World::Event::Kind;

// Records events into a corpus entry while applying them to a model, so
// that the event tags select the same events in the fuzzer.
class Script {
 public:
  Script() : w_(MakeBudget()) {}

  static Budget MakeBudget() {
    Budget b;  // As handshake_fuzz.cc.
    b.needs = 3;
    b.drops = 2;
    b.op_failures = 2;
    b.local_failures = 2;
    b.evictions = 2;
    b.restarts = 1;
    return b;
  }

  // Applies the first enabled event of `kind` on `side` (-1: any).
  bool Step(Kind kind, int side = -1) {
    const auto events = w_.Enabled();
    for (size_t i = 0; i < events.size(); ++i) {
      if (events[i].kind == kind && (side < 0 || events[i].side == side)) {
        out_.push_back(static_cast<char>(2 + i));
        w_.Apply(events[i]);
        return true;
      }
    }
    return false;
  }
  void Payload(int tag, const std::string& p) {
    out_.push_back(static_cast<char>(tag));
    out_.push_back(static_cast<char>(p.size() & 0xff));
    out_.push_back(static_cast<char>(p.size() >> 8));
    out_ += p;
    if (tag == 0) {
      (void)w_.InjectPayload(p);
    } else {
      (void)w_.InjectReply(p);
    }
  }
  // Runs the protocol until nothing is in flight.
  void Settle() {
    for (int k = 0; k < 200 && !w_.Quiescent(); ++k) {
      if (!Step(Kind::kDeliver) && !Step(Kind::kRunSend) &&
          !Step(Kind::kOpDone) && !Step(Kind::kTimer) && !Step(Kind::kUse)) {
        break;
      }
    }
  }
  const std::string& bytes() const { return out_; }

 private:
  World w_;
  std::string out_;
};

QpInfo Qp(uint32_t qpn) {
  QpInfo q;
  q.set_nic("nic0");
  q.set_qpn(qpn);
  q.set_gid(std::string("\0\0\0\0\0\0\0\0\0\0\xff\xff\x7f\0\0\x01", 16));
  q.set_psn(qpn & 0xffffff);
  return q;
}

std::string Request(uint64_t epoch) {
  RdmaMessage m;
  ConnectRequest* r = m.mutable_connect();
  r->set_initiator_segment("a");
  r->set_initiator_incarnation(1);
  r->set_target_incarnation(2);
  r->set_initiator_nic("nic0");
  r->set_target_nic("nic0");
  *r->add_initiator_qps() = Qp(77);
  r->set_rail_epoch(epoch);
  r->set_initiator_rpc_address("127.0.0.1:5000");
  return m.SerializeAsString();
}

std::string Notice(RailNotice::Kind kind, uint64_t epoch) {
  RdmaMessage m;
  RailNotice* n = m.mutable_notice();
  n->set_kind(kind);
  n->set_initiator_segment("a");
  n->set_initiator_incarnation(1);
  n->set_initiator_nic("nic0");
  n->set_target_nic("nic0");
  n->set_epoch(epoch);
  n->set_target_incarnation(2);
  return m.SerializeAsString();
}

std::string Reply(ConnectReply::Result result, uint64_t epoch) {
  ConnectReply r;
  r.set_result(result);
  r.set_target_incarnation(result == ConnectReply::STALE_INCARNATION ? 9 : 1);
  r.set_epoch(epoch);
  if (result == ConnectReply::ACCEPTED) *r.add_target_qps() = Qp(88);
  if (result == ConnectReply::REFUSED) r.set_reason("RDMA NIC nic0 is down");
  return r.SerializeAsString();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  std::vector<std::pair<std::string, std::string>> seeds;
  {
    // A forged request, READY and DISCONNECT at an idle side.
    Script s;
    s.Payload(0, Request(0));
    s.Payload(0, Notice(RailNotice::READY, 1));
    s.Payload(0, Notice(RailNotice::DISCONNECT, 1));
    s.Settle();
    seeds.emplace_back("request_ready_disconnect", s.bytes());
  }
  {
    // A request while side 1 is connecting itself (tie-break: side 1
    // loses and adopts), then a stale one.
    Script s;
    s.Step(Kind::kNeed, 1);
    s.Payload(0, Request(0));
    s.Payload(0, Request(0));
    s.Settle();
    seeds.emplace_back("request_while_connecting", s.bytes());
  }
  for (auto [name, result, epoch] :
       std::vector<std::tuple<const char*, ConnectReply::Result, uint64_t>>{
           {"reply_accepted", ConnectReply::ACCEPTED, 1},
           {"reply_lost", ConnectReply::LOST_TIE_BREAK, 0},
           {"reply_superseded", ConnectReply::SUPERSEDED, 3},
           {"reply_stale", ConnectReply::STALE_INCARNATION, 0},
           {"reply_refused", ConnectReply::REFUSED, 0}}) {
    // Side 1 sends a request; the reply is forged.
    Script s;
    s.Step(Kind::kNeed, 1);
    s.Step(Kind::kRunSend, 1);
    s.Payload(1, Reply(result, epoch));
    s.Settle();
    seeds.emplace_back(name, s.bytes());
  }
  {
    // Both sides connect at once, then one evicts, then both reconnect.
    Script s;
    s.Step(Kind::kNeed, 0);
    s.Step(Kind::kNeed, 1);
    s.Settle();
    s.Step(Kind::kEvict, 1);
    s.Settle();
    s.Step(Kind::kNeed, 0);
    s.Settle();
    seeds.emplace_back("connect_evict_reconnect", s.bytes());
  }
  {
    // A connection, a lost message, a failure and a restart.
    Script s;
    s.Step(Kind::kNeed, 0);
    s.Step(Kind::kRunSend, 0);
    s.Step(Kind::kDrop);
    s.Settle();
    s.Step(Kind::kNeed, 1);
    s.Settle();
    s.Step(Kind::kLocalFail, 0);
    s.Step(Kind::kRestart);
    s.Step(Kind::kNeed, 0);
    s.Settle();
    seeds.emplace_back("drop_fail_restart", s.bytes());
  }
  for (const auto& [name, bytes] : seeds) {
    const std::string path = std::string(argv[1]) + "/" + name;
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
  }
  std::printf("%zu seeds written to %s\n", seeds.size(), argv[1]);
  return 0;
}
