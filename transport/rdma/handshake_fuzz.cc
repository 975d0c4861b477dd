// Fuzz target: RDMA handshake messages (RdmaMessage payloads as they
// arrive through the PeerChannel, and ConnectReply payloads as the connect
// job reads them) -- parsing, validation, and the reaction of the rail's
// RailConnector -- interleaved with the real protocol between two sides of
// the connector model (connector_model.h: no NIC, no threads).
//
// Input: a sequence of records. Tag byte:
//   0: u16 length + payload: an RdmaMessage from side 0 to side 1;
//   1: u16 length + payload: a ConnectReply to side 1's request in flight;
//   2..255: one step of the model (the (tag - 2)-th enabled event, mod the
//           number enabled).
// After every record the machines' invariants must hold; at the end the
// model is run to quiescence (messages delivered, deadlines fired, failing
// connections found), where every rail must be settled: idle or connected
// to each other, never wedged, no QP left over.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "transport/rdma/connector_model.h"

namespace {

using ferry::rdma::model::Budget;
using ferry::rdma::model::World;

void Check(const absl::Status& s, const char* when) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s: %s\n", when, s.ToString().c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Budget budget;
  budget.needs = 3;
  budget.drops = 2;
  budget.op_failures = 2;
  budget.local_failures = 2;
  budget.evictions = 2;
  budget.restarts = 1;
  World w(budget);
  size_t i = 0;
  int steps = 0;
  while (i < size && steps++ < 512) {
    const uint8_t tag = data[i++];
    if (tag <= 1) {
      if (size - i < 2) break;
      const size_t len = data[i] | (size_t{data[i + 1]} << 8);
      i += 2;
      const size_t n = len < size - i ? len : size - i;
      const std::string payload(reinterpret_cast<const char*>(data + i), n);
      i += n;
      // Refusals are fine; what matters is that nothing breaks.
      if (tag == 0) {
        (void)w.InjectPayload(payload);
      } else {
        (void)w.InjectReply(payload);
      }
    } else {
      const auto events = w.Enabled();
      if (events.empty()) continue;
      w.Apply(events[(tag - 2) % events.size()]);
    }
    Check(w.CheckStep(), "after a record");
  }
  // Let everything in flight land, with no new needs or faults: the
  // messages, operations, deadlines and failing uses.
  for (int k = 0; k < 10000 && !w.Quiescent(); ++k) {
    bool applied = false;
    for (const World::Event& e : w.Enabled()) {
      using K = World::Event::Kind;
      if (e.kind == K::kDeliver || e.kind == K::kRunSend ||
          e.kind == K::kOpDone || e.kind == K::kTimer || e.kind == K::kUse) {
        w.Apply(e);
        applied = true;
        break;
      }
    }
    Check(w.CheckStep(), "settling");
    if (!applied) break;
  }
  // A rail still busy here is wedged: that is what this target is for.
  Check(w.Quiescent() ? absl::OkStatus()
                      : absl::InternalError("the rail did not settle"),
        "settling");
  Check(w.CheckQuiescent(), "settled");
  return 0;
}
