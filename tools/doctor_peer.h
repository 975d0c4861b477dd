// The doctor's reachability matrix: for every local NIC x remote NIC, a
// handshake, a verified RDMA WRITE and READ, and the latency of small
// WRITEs (doctor_probe.h). The other side is a `doctor --serve=PORT`
// (doctor_peer.cc) or a running engine found by its segment name
// (doctor_segment.cc).
#ifndef FERRY_TOOLS_DOCTOR_PEER_H_
#define FERRY_TOOLS_DOCTOR_PEER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tools/doctor_probe.h"

namespace ferry::doctor {

// Serves probes on `port` (every interface) for `seconds` (0: until
// killed), one client at a time. `devices`: the NICs offered (empty: every
// ACTIVE one).
absl::Status Serve(uint16_t port, const std::vector<std::string>& devices,
                   double seconds);

// Probes every pair of a local NIC (`devices`, empty: every ACTIVE one)
// and a NIC of the server at `peer` ("host:port"), one check per pair.
void ProbePeer(const std::string& peer, const std::vector<std::string>& devices,
               std::vector<Check>* out);

// Probes every pair of a local NIC and a NIC of the running engine whose
// segment is `segment`, found through the metadata service at `metadata`
// ("host:port"): Ferry's own RDMA handshake with that engine (a rail of
// one QP, closed afterwards), a verified WRITE and READ of its NIC's probe
// page (never application memory) and the WRITE latency. One check per
// pair, after one for the segment.
void ProbeSegment(const std::string& metadata, const std::string& segment,
                  const std::vector<std::string>& devices,
                  std::vector<Check>* out);

}  // namespace ferry::doctor

#endif  // FERRY_TOOLS_DOCTOR_PEER_H_
