// The doctor's probe of one rail: a QP on a local NIC, set up exactly as
// Ferry's RDMA transport sets up its QPs (transport/rdma/qp.h: MTU from
// both ports, GID by type, READ depths from both devices), and the
// verified WRITE and READ and the latency run over it. Shared by the two
// ways of reaching a peer: `doctor --serve` on the other host
// (doctor_peer.cc) and a running engine found by its segment name
// (doctor_segment.cc). Not thread-safe: one probe per thread.
#ifndef FERRY_TOOLS_DOCTOR_PROBE_H_
#define FERRY_TOOLS_DOCTOR_PROBE_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/qp.h"

namespace ferry::doctor {

enum class Level { kOk, kWarn, kFail };

struct Check {
  std::string name;
  Level level;
  std::string detail;
  std::string fix;  // For kWarn and kFail.
};

// The local buffer of a probe: room for a WRITE's source and its READ back.
constexpr size_t kProbeBufferBytes = 64 << 10;

// One probe's verbs objects.
struct Probe {
  std::unique_ptr<rdma::Nic> nic;
  ibv_qp* qp = nullptr;
  std::unique_ptr<uint8_t[]> buf;  // kProbeBufferBytes, registered.
  ibv_mr* mr = nullptr;
  ~Probe();
};

// Opens `dev` and makes a probe QP (RESET) and its registered buffer.
absl::StatusOr<std::unique_ptr<Probe>> NewProbe(ibv_device* dev);

// Short RC timers: an unreachable NIC fails a probe in about 67 ms
// (4.096 us * 2^12 * 4) instead of Ferry's half second.
rdma::QpTimers ProbeTimers();

// WRITEs `len` bytes of pattern `seed` (tools/pattern.h) from the probe's
// buffer to (remote, rkey), READs them back into the buffer's second half and
// compares. `len` is at most kProbeBufferBytes / 2.
absl::Status WriteReadVerify(Probe* p, uint32_t len, uint64_t remote,
                             uint32_t rkey, uint32_t seed);

// The median latency of 8-byte signaled WRITEs to (remote, rkey), in us.
absl::StatusOr<double> WriteLatencyUs(Probe* p, uint64_t remote, uint32_t rkey);

// The check for a pair that passed: FAIL if the two ports' active MTUs
// differ (`remote_mtu`, an ibv_mtu; 0: unknown), else OK.
Check PairVerdict(const std::string& name, const Probe& p, uint32_t remote_mtu,
                  uint32_t bytes, double p50_us);

// The check for a pair whose probe failed with `s` after the handshake.
Check UnreachableVerdict(const std::string& name, const absl::Status& s);

// The local NICs to probe by name: those in `filter`, or every one.
std::map<std::string, ibv_device*> Devices(
    const std::vector<std::string>& filter);

}  // namespace ferry::doctor

#endif  // FERRY_TOOLS_DOCTOR_PROBE_H_
