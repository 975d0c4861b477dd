// Options of the transports, part of the public API: EngineOptions embeds
// them (include/ferry/transfer_engine.h) and every transport reads its own. One
// typed struct per transport, parsed in one place, instead of settings read
// from the environment wherever they are needed.
#ifndef FERRY_INCLUDE_FERRY_OPTIONS_H_
#define FERRY_INCLUDE_FERRY_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace ferry {

// The TCP transport's limits and timeouts are explained, with what a user
// sees when one is hit, at the top of transport/tcp/tcp_transport.h.
struct TcpOptions {
  // Connections opened to each peer; slices are spread over them (1..64).
  int connections_per_peer = 2;
  // Largest slice: a request is split into slices of at most this size.
  size_t max_slice_bytes = 4 << 20;
  // Event-loop threads on each side (1..16): this many drive every
  // connection this engine opened, and as many more every connection it
  // accepted. There is no thread per connection.
  int io_threads = 1;
  // Pinned host buffers (of max_slice_bytes each) through which GPU memory
  // moves, on each side (1..1024): sockets cannot read device memory. The
  // initiator's and the target's pools are allocated when they first meet
  // GPU memory; they bound the staging path's memory (tcp_transport.h).
  int staging_buffers = 8;

  // Target side. Port the transport listens on (on EngineOptions's
  // listen_host); 0 picks a free one, which a firewall cannot know in
  // advance: set one where peers cross a firewall.
  uint16_t port = 0;
  // Connections accepted and open at once, in all (and at most half the
  // soft RLIMIT_NOFILE, so that the cap binds before descriptors run out)
  // and per peer IP address. At the global cap a newcomer takes the slot
  // of a connection from the address that holds the most, if it holds at
  // least two more than the newcomer's, preferring one that was never let
  // at memory; otherwise, and beyond the per-address cap, it is closed
  // (reset) at once.
  int max_connections = 4096;
  int max_connections_per_address = 64;
  // An accepted connection is closed when its first request header has not
  // arrived within handshake_timeout, when no request arrived for
  // idle_timeout since the previous one was answered, or when one frame
  // (a request's header and payload, or a response until the peer took
  // its last byte) takes longer than frame_timeout.
  absl::Duration handshake_timeout = absl::Seconds(10);
  absl::Duration idle_timeout = absl::Seconds(60);
  absl::Duration frame_timeout = absl::Seconds(10);  // Each at most 1 h.

  // Initiator side. Peer addresses with state (a connection pool, backoff)
  // kept at most; beyond, the least recently used idle one is dropped. A
  // slice to a new peer while all are busy fails with ResourceExhausted.
  int max_peers = 1024;
  // A peer that refused, could not be reached, or dropped its connections
  // before answering is not tried again for backoff_min, doubling per
  // failure up to backoff_max; meanwhile its slices fail at once.
  absl::Duration backoff_min = absl::Milliseconds(100);
  absl::Duration backoff_max = absl::Seconds(5);
};

struct RdmaOptions {
  // Devices to use; empty: every device with an ACTIVE port.
  std::vector<std::string> devices;
  // A request is split into slices of this size (4 KiB .. 64 MiB), and the
  // slices are striped over all usable (local NIC, remote NIC) rails.
  size_t slice_bytes = 64 << 10;
  // A request's consecutive slices go to one rail up to stripe_bytes (a
  // stripe), and stripes spread over the rails by load: slices that follow
  // each other on one rail are posted as one work request (up to 16 slices,
  // 1 MiB), where spread slice by slice each costs the NICs a work request
  // and a completion of its own. A request of at most stripe_bytes thus
  // rides one rail; many requests in flight still use every rail. 0 or up
  // to slice_bytes: spread slice by slice (Mooncake TE's way).
  // 0..1 GiB.
  size_t stripe_bytes = 1 << 20;
  // GID index; -1 picks by type: on RoCE the best RoCE v2 entry
  // (IPv4-mapped, then global IPv6, link-local last; RoCE v1 never), on
  // InfiniBand the best entry. -1 also defers to the environment variable
  // MC_GID_INDEX, as Mooncake TE does.
  int gid_index = -1;
  // RC QPs per endpoint (one endpoint per local NIC, remote NIC pair);
  // slices alternate between them (1..16).
  int qps_per_endpoint = 2;
  // Selective signaling: every signal_every-th WR on a QP asks for a
  // completion, and so does the last WR of every ibv_post_send chain (at
  // most 32 WRs), hence 1..32. 1 signals every WR. Fewer completions save
  // the NIC a CQE write and the poller a CQE per WR.
  int signal_every = 16;
  // WRITE work requests of up to inline_bytes go inline (the payload
  // copied into the WQE at post time, no DMA read of it); capped by what
  // the device grants (Ferry halves the ask until the device accepts it).
  // 0 turns inline off (0..1024).
  int inline_bytes = 64;
  // Endpoints kept at most; beyond this, idle ones are evicted (SIEVE),
  // busy ones never.
  size_t max_endpoints = 4096;
  // Peer records (one per remote segment seen) kept at most; beyond this,
  // records of peers without endpoints are dropped, least recently used
  // first.
  size_t max_peers = 1024;
  // An endpoint idle this long is probed (a zero-length RDMA WRITE): the
  // endpoint of a peer that died without a word then fails and is dropped
  // (see rdma_transport.h for the bound). Zero disables the probes.
  absl::Duration keepalive_interval = absl::Seconds(2);
  // Failover: tries per slice (each on a rail it has not failed on while
  // one is left; at least one try per rail); errors after which a rail is
  // paused, and for how long before it is probed again (doubling, up to
  // 64x, while it keeps failing).
  uint32_t max_attempts = 4;
  uint32_t pause_after_errors = 3;
  absl::Duration pause_duration = absl::Seconds(1);
  // RC transport timer: ACK timeout 4.096 us * 2^qp_timeout (1..31) and
  // retries (0..7) before a silent peer fails the QP. The defaults (14, 7)
  // detect a dead link in about half a second; lower values fail over
  // faster at the risk of spurious errors under congestion.
  int qp_timeout = 14;
  int qp_retry_count = 7;
  // Fork safety: a process that forks while memory is registered may have
  // its pages copied on write under the NIC (the child touches them) on
  // kernels before 5.13 / rdma-core before 35. true calls ibv_fork_init at
  // Install (registered ranges are excluded from fork, at one madvise per
  // registration); Install fails if that is too late (memory registered
  // already) or unsupported. false (default): nothing is done, which is
  // safe where ibv_is_fork_initialized() says IBV_FORK_UNNEEDED (modern
  // kernels); RDMAV_FORK_SAFE=1 in the environment does the same as true.
  bool fork_safe = false;
  // Addressing of every packet (the GRH on RoCE). traffic_class is the IP
  // header's DSCP << 2 | ECN: the default 106 (DSCP 26, ECN-capable) is the
  // class lossless (PFC + ECN) RoCE fabrics are commonly configured for,
  // and the value perftest's --tclass takes there; use the one your
  // fabric's QoS gives RoCE. service_level is the IB SL (on RoCE, the PCP
  // where the port trusts it). hop_limit is the IP TTL; flow_label (20
  // bits) lets switches hash flows apart with ECMP.
  int traffic_class = 106;
  int service_level = 0;
  int hop_limit = 64;
  uint32_t flow_label = 0;
  // Worker threads polling the NICs' completion queues when no application
  // thread does (0: one per NIC; fewer serve the NICs round robin); empty
  // polls (each with a yield) before a worker sleeps on the completion
  // channels; CPUs to pin them to (round robin; empty: no pinning).
  int worker_threads = 0;
  int spin_polls = 64;
  std::vector<int> worker_cpus;
  // NIC preference per buffer location, Mooncake TE's priority matrix:
  // {"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_1"]]}. Empty:
  // derived from sysfs (NUMA node of each NIC; PCI distance to GPUs).
  std::string topology_json;
  // Root of the sysfs tree the topology is read from (tests point it at a
  // fake tree).
  std::string sysfs_root = "/sys";
  // GPU memory the NICs cannot register (no dma-buf, no nvidia-peermem):
  // true (default) registers it anyway and stages this engine's transfers
  // of it through pinned host buffers (`staging_buffers` of slice_bytes,
  // allocated at the first such registration: the path's whole memory),
  // copies overlapping the wire; peers cannot reach such a buffer over
  // RDMA (docs/gpu.md). false: its registration fails, saying what is
  // missing.
  bool gpu_staging = true;
  int staging_buffers = 64;
};

// The same-host transport, "shm": what a user sees at each limit is
// explained at the top of transport/shm/shm_transport.h.
struct ShmOptions {
  // A request is split into slices of at most this size (4 KiB .. 1 GiB);
  // one copy (a system call) moves up to 1,024 of them.
  size_t slice_bytes = 4 << 20;
  // Threads that copy (1..64). A Submit of at most inline_bytes in all is
  // copied on the submitting thread instead (no hand-off: small requests
  // complete before SubmitTransfer returns), while that thread is not
  // already copying to the same peer.
  int copy_threads = 2;
  size_t inline_bytes = 64 << 10;
  // Target side: remote-accessible buffers registered at once at most
  // (1..1,048,576; 8 bytes each in the shared table; one more fails its
  // registration with ResourceExhausted) and initiator copy lanes (16..65,536;
  // 64 bytes each; each attached peer takes copy_threads + 1 of them, and
  // a peer that finds none free falls back to the next transport).
  int max_buffers = 1 << 16;
  int max_lanes = 1024;
  // How long UnregisterMemory waits for a peer's copy in progress into the
  // buffer before it fails with FailedPrecondition naming the peer's pid
  // (the buffer must then not be freed: that peer may still write it).
  absl::Duration unregister_wait = absl::Seconds(5);
  // Initiator side: peers attached at once at most (1..65,536); beyond,
  // new targets are reached through the next transport.
  int max_peers = 1024;
  // Pinned host buffers (of slice_bytes each) through which the initiator's
  // GPU memory moves (1..1024): a copy system call cannot read device
  // memory.
  int staging_buffers = 8;
};

}  // namespace ferry

#endif  // FERRY_INCLUDE_FERRY_OPTIONS_H_
