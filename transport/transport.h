// The Transport interface: what every way of moving bytes (TCP, RDMA, ...)
// implements. It is deliberately small, in the spirit of eRPC's transport
// interface: install, register memory, submit slices, report completions.
//
// The engine splits each request into Slices of at most max_slice_bytes()
// and hands them to a transport; the transport completes every slice it was
// given exactly once, through slice->sink, from any thread, and never
// touches the slice (or its local memory) after completing it.
//
// Thread-safety: Submit, RegisterMemory and UnregisterMemory may be called
// concurrently from any thread after Install returns. Install and Shutdown
// are called once each, by the engine, with no other call in progress.
#ifndef FERRY_TRANSPORT_TRANSPORT_H_
#define FERRY_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/opcode.h"
#include "metadata/peer_service.h"
#include "metadata/proto/metadata.pb.h"
#include "transport/memory_registry.h"
#include "transport/segment_view.h"

namespace ferry {

struct Slice;

// Receives slice completions. Implemented by the engine.
class SliceSink {
 public:
  virtual ~SliceSink() = default;
  // `status` is OK if the slice's bytes were moved (for a WRITE: applied at
  // the target). Called exactly once per slice.
  virtual void OnSliceDone(Slice* slice, const absl::Status& status) = 0;
};

// A contiguous piece of one request: the unit a transport moves.
struct Slice {
  OpCode op = OpCode::kRead;
  void* local = nullptr;  // Local address (source of a WRITE).
  uint64_t remote = 0;    // Remote virtual address.
  size_t length = 0;
  const SegmentView* target = nullptr;  // Alive until the slice completes.
  absl::Time deadline = absl::InfiniteFuture();
  SliceSink* sink = nullptr;
  // Failover bookkeeping, owned by the transport the slice is in.
  uint32_t attempts = 0;
  int32_t rail = -1;          // Rail currently carrying it.
  uint64_t failed_rails = 0;  // Bit per rail it already failed on.

  void Complete(const absl::Status& status) { sink->OnSliceDone(this, status); }
};

// What a transport gets from the engine at Install.
struct TransportEnv {
  std::string local_segment;  // This engine's segment name.
  std::string listen_host;    // Address to bind listeners to.
  metadata::PeerServiceImpl* peer_service = nullptr;  // For handshakes.
  metadata::PeerClient* peer_client = nullptr;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // "tcp", "rdma", ...: the key in segment descriptors.
  virtual absl::string_view name() const = 0;

  // Starts listeners and threads. Fills `endpoint` (already named) with what
  // peers need to reach this transport.
  virtual absl::Status Install(const TransportEnv& env,
                               metadata::TransportEndpoint* endpoint) = 0;

  // Makes a local buffer usable by this transport. For a remote-accessible
  // region the transport may add per-NIC keys to `published`, the entry the
  // engine publishes in its segment descriptor.
  virtual absl::Status RegisterMemory(const MemoryRegion& region,
                                      metadata::Buffer* published) = 0;

  // Reverses RegisterMemory for the region starting at `addr`. Waits for
  // accesses by peers that are in progress.
  virtual absl::Status UnregisterMemory(uintptr_t addr) = 0;

  // Largest slice the transport wants to be given.
  virtual size_t max_slice_bytes() const = 0;

  // Starts moving `slices`; each is completed later (or inline) through its
  // sink, with DeadlineExceeded if it is not done by its deadline.
  virtual void Submit(absl::Span<Slice* const> slices) = 0;

  // Stops threads; in-flight slices complete with Cancelled/Unavailable.
  virtual void Shutdown() = 0;
};

// Transport options common to all transports, parsed once by the engine.
struct TransportOptions {
  // TCP: connections opened to each peer; slices are spread over them.
  int tcp_connections_per_peer = 2;
  size_t tcp_max_slice_bytes = 4 << 20;
  absl::Duration connect_timeout = absl::Seconds(3);
  // RDMA: devices to use (all ACTIVE ones if empty), slice size, GID index
  // (-1: choose the best automatically).
  std::vector<std::string> rdma_devices;
  size_t rdma_slice_bytes = 64 << 10;
  int rdma_gid_index = -1;
  // Initiator endpoints (QPs) kept at most; idle ones are evicted (SIEVE).
  size_t rdma_max_endpoints = 4096;
  // Failover: tries per slice (on different rails when possible); errors
  // after which a rail is paused, and for how long before it is probed.
  uint32_t rdma_max_attempts = 4;
  uint32_t rdma_pause_after_errors = 3;
  absl::Duration rdma_pause_duration = absl::Seconds(1);
  // Worker polling: empty CQ polls (each with a yield) before sleeping on
  // the completion channel; CPUs to pin NIC workers to (round robin; empty:
  // no pinning).
  int rdma_spin_polls = 64;
  // Priority matrix as in Mooncake TE, e.g. {"cpu:0": [["mlx5_0"],
  // ["mlx5_1"]]}; empty: NUMA nodes from sysfs.
  std::string rdma_topology_json;
  std::vector<int> rdma_worker_cpus;
};

// Creates the transport called `name`, or NotFound listing the known ones.
// A new transport is added by one entry in transport_factory.cc.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(
    absl::string_view name, const TransportOptions& options);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TRANSPORT_H_
