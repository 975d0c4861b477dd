// What every part of the RDMA transport reads: its options, its engine's
// environment, the clock, the NICs and the counters behind
// TransportStats. RdmaTransport owns it and fills it in Install, before
// any thread of the transport starts; from then on only the atomics
// change, so the parts read it without a lock.
#ifndef FERRY_TRANSPORT_RDMA_RDMA_CONTEXT_H_
#define FERRY_TRANSPORT_RDMA_RDMA_CONTEXT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/clock.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/qp.h"
#include "transport/transport.h"

namespace ferry::rdma {

// Counted by the parts, read by RdmaTransport::Stats.
struct RdmaCounters {
  std::atomic<uint64_t> connects_started{0};
  std::atomic<uint64_t> connects_accepted{0};
  std::atomic<uint64_t> qps_created{0};
  std::atomic<uint64_t> connect_failures{0};
  std::atomic<uint64_t> connect_races{0};
  std::atomic<uint64_t> evictions{0};
  std::atomic<uint64_t> retries{0};
  std::atomic<uint64_t> fast_failures{0};
};

struct RdmaContext {
  explicit RdmaContext(const TransportOptions& o)
      : options(o),
        posting{static_cast<uint32_t>(o.rdma.signal_every),
                static_cast<uint32_t>(o.rdma.inline_bytes)} {}
  RdmaContext(const RdmaContext&) = delete;
  RdmaContext& operator=(const RdmaContext&) = delete;

  // The index of the NIC named `name`, or -1.
  int NicIndex(absl::string_view name) const {
    for (size_t i = 0; i < nics.size(); ++i) {
      if (nics[i]->name() == name) return static_cast<int>(i);
    }
    return -1;
  }

  const TransportOptions options;
  TransportEnv env;
  // env.clock: every deadline, back-off, pause, linger and keepalive of
  // the transport is read from it.
  Clock* clock = RealClock();
  // This run of the engine (env.incarnation, or a random one stand-alone).
  uint64_t incarnation = 0;
  QpTimers timers;
  const QpPosting posting;
  // The NICs in use, in the order peers see them in the descriptor.
  std::vector<std::unique_ptr<Nic>> nics;
  // Shutdown began: nothing new is routed, connected or accepted.
  std::atomic<bool> stopping{false};
  RdmaCounters counters;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_RDMA_CONTEXT_H_
