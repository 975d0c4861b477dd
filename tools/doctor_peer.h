// The doctor's reachability matrix: for every local NIC x remote NIC, a
// handshake, a verified RDMA WRITE and READ, and the latency of small
// WRITEs, with QPs set up exactly as Ferry's RDMA transport sets them up
// (transport/rdma/qp.h: MTU from both ports, GID by type, READ depths from
// both devices). The other side runs `doctor --serve=PORT`.
#ifndef FERRY_TOOLS_DOCTOR_PEER_H_
#define FERRY_TOOLS_DOCTOR_PEER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ferry::doctor {

enum class Level { kOk, kWarn, kFail };

struct Check {
  std::string name;
  Level level;
  std::string detail;
  std::string fix;  // For kWarn and kFail.
};

// Serves probes on `port` (every interface) for `seconds` (0: until
// killed), one client at a time. `devices`: the NICs offered (empty: every
// ACTIVE one).
absl::Status Serve(uint16_t port, const std::vector<std::string>& devices,
                   double seconds);

// Probes every pair of a local NIC (`devices`, empty: every ACTIVE one)
// and a NIC of the server at `peer` ("host:port"), one check per pair.
void ProbePeer(const std::string& peer, const std::vector<std::string>& devices,
               std::vector<Check>* out);

}  // namespace ferry::doctor

#endif  // FERRY_TOOLS_DOCTOR_PEER_H_
