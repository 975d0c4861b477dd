// Counters the transports keep, part of the public API
// (TransferEngine::GetTransportStats). Each is a snapshot; counters only
// grow over an engine's life.
#ifndef FERRY_INCLUDE_FERRY_STATS_H_
#define FERRY_INCLUDE_FERRY_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

struct NicStats {
  std::string name;
  bool port_active = false;
  // Slices (and their bytes) posted on this NIC, first tries and retries.
  uint64_t slices = 0;
  uint64_t bytes = 0;
  // Slices that failed on this NIC (and were retried or failed).
  uint64_t errors = 0;
  // Work requests posted for slices (RDMA): one moves a slice, or several
  // that continue each other in memory (coalesced), so at most `slices`.
  uint64_t work_requests = 0;
  // Work completions reaped from this NIC's CQ (RDMA): one per signaled WR
  // and per failed WR (selective signaling makes this smaller than
  // work_requests), keepalive probes and fences included.
  uint64_t completions = 0;
  // Work requests posted on this NIC and not yet completed, keepalive
  // probes and fences included (RDMA).
  uint64_t outstanding_wrs = 0;
  // The device reported a fatal error (IBV_EVENT_DEVICE_FATAL): it is out
  // of service for the rest of the engine's life.
  bool fatal = false;
};

struct TransportStats {
  std::string transport;  // "tcp", "rdma", ...
  std::vector<NicStats> nics;
  // Connections (RDMA: endpoints) open now, opened by this engine
  // (handshakes it started), accepted from peers, evicted, and failed.
  uint64_t endpoints = 0;
  uint64_t connects_started = 0;
  uint64_t connects_accepted = 0;
  uint64_t evictions = 0;
  uint64_t connect_failures = 0;
  // Queue pairs this engine created, for its handshakes and its peers'
  // (RDMA; a handshake storm's cost, bench/storm_bench).
  uint64_t qps_created = 0;
  // Connects that crossed one from the peer for the same rail and were
  // resolved by this engine adopting the peer's (one endpoint results).
  uint64_t connect_races = 0;
  // Slices retried after a failure (on another rail where possible).
  uint64_t retries = 0;
  // Slices failed at once, without touching the network, because their
  // peer is backing off after failed connects (one clear status instead
  // of a storm of attempts).
  uint64_t fast_failures = 0;
  // Gauges, for bounded-state checks: peers the transport keeps state for
  // (connection pools, peer records), and threads it runs now.
  uint64_t peers = 0;
  uint64_t threads = 0;
  // Target side (TCP): connections reset at once (over a cap or out of
  // fds), closed for a handshake/idle/frame timeout, and closed for a
  // malformed request; frames refused for a wrong buffer key or engine
  // incarnation (nothing read or written).
  uint64_t refused_connections = 0;
  uint64_t timed_out_connections = 0;
  uint64_t bad_frames = 0;
  uint64_t denied_frames = 0;
  // Initiator side, GPU memory moved through pinned host buffers (TCP):
  // slices staged, of those that waited for a free buffer, and the
  // device<->host copies issued with their bytes.
  uint64_t staged_slices = 0;
  uint64_t staging_waits = 0;
  uint64_t staging_copies = 0;
  uint64_t staging_copy_bytes = 0;
};

}  // namespace ferry

#endif  // FERRY_INCLUDE_FERRY_STATS_H_
