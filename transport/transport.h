// The Transport interface: what every way of moving bytes (TCP, RDMA, ...)
// implements. It is deliberately small, in the spirit of eRPC's transport
// interface: install, register memory, submit slices, report completions.
// A new transport is one class plus one line in
// transport/registry/registry.cc.
//
// The engine splits each request into Slices of at most max_slice_bytes()
// and hands them to a transport; the transport completes every slice it was
// given exactly once, through slice->sink, from any thread, and never
// touches the slice (or its local memory) after completing it.
//
// Thread-safety: Submit, Poll, Stats, RegisterMemory and UnregisterMemory
// may be called concurrently from any thread after Install returns. Install and
// Shutdown are called once each, by the engine, with no other call in progress.
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
#include "common/clock.h"
#include "descriptor/descriptor.pb.h"
#include "ferry/opcode.h"
#include "ferry/options.h"
#include "ferry/stats.h"
#include "transport/memory_registry.h"
#include "transport/peer_channel.h"
#include "transport/segment_view.h"

namespace ferry {

struct Slice;

// Receives slice completions. Implemented by the engine.
class SliceSink {
 public:
  virtual ~SliceSink() = default;
  // `status` is OK if the slice's bytes were moved (for a WRITE: applied at
  // the target). Called exactly once per slice, from any thread.
  virtual void OnSliceDone(Slice* slice, const absl::Status& status) = 0;
  // Completes n slices that all succeeded, in order: the same as
  // OnSliceDone(slice, OK) for each (the default), but a sink can do a
  // group cheaper (transports complete slices in groups per completion).
  virtual void OnSlicesDone(Slice* const* slices, size_t n) {
    for (size_t i = 0; i < n; ++i) OnSliceDone(slices[i], absl::OkStatus());
  }
};

// Transport-private state of one registered buffer: what RegisterMemory
// returned, handed back with every slice whose local range lies in that
// buffer, so the data path needs no lookup (RDMA: the lkey per NIC).
using MemoryHandle = const void*;

// A contiguous piece of one request: the unit a transport moves. The engine
// fills the first block; the transport owns the rest while the slice is in
// it (the engine zeroes them before Submit).
struct Slice {
  OpCode op = OpCode::kRead;
  void* local = nullptr;  // Local address (source of a WRITE).
  uint64_t remote = 0;    // Remote virtual address.
  size_t length = 0;
  const SegmentView* target = nullptr;  // Alive until the slice completes.
  int remote_buffer = -1;  // Index of the target buffer holding the range.
  MemoryHandle local_handle = nullptr;  // From this transport's Register.
  absl::Time deadline = absl::InfiniteFuture();
  SliceSink* sink = nullptr;

  // Transport-owned.
  Slice* next = nullptr;  // Intrusive queue link.
  uint32_t attempts = 0;  // Failed tries so far.
  // Private to the transport holding the slice (e.g. RDMA keeps its rail,
  // remote key and the rails it failed on here), so that transport state
  // needs neither a field in this interface nor an allocation per slice.
  uint64_t scratch[2] = {0, 0};

  void Complete(const absl::Status& status) { sink->OnSliceDone(this, status); }
};

// What a transport gets from the engine at Install.
struct TransportEnv {
  std::string local_segment;  // This engine's segment name.
  // This run of the engine, as published in its descriptor: peers compare
  // it to tell a restarted engine from a live one.
  uint64_t incarnation = 0;
  // Address to bind listeners to: a host, an IP literal, or "" (every
  // interface, IPv4 and IPv6).
  std::string listen_host;
  // Numeric address peers reach this host at, published in endpoints
  // (never a name: peers do not resolve on their data path). Empty: the
  // address bound (tests that bind one address).
  std::string advertise_host;
  // This engine's peer-service address (as published in its descriptor),
  // for peers that must call back (e.g. to close a connection).
  std::string rpc_address;
  // Handshakes and other control messages to the same transport of a
  // peer engine (outlives the transport).
  PeerChannel* peer_channel = nullptr;
  // The engine's clock (common/clock.h; never null, outlives the
  // transport): every timeout, backoff and keepalive of the transport
  // reads and waits on it.
  Clock* clock = RealClock();
  // The cluster's token (EngineOptions::auth_token; empty: none). A
  // transport whose wire can carry a proof of it (tcp) requires one from
  // every peer that connects, and proves it to every peer it connects to,
  // so that the keys a descriptor publishes grant nothing without it.
  std::string auth_token;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // "tcp", "rdma", ...: the key in segment descriptors.
  virtual absl::string_view name() const = 0;

  // Starts listeners and threads. Fills `endpoint` (already named) with what
  // peers need to reach this transport.
  virtual absl::Status Install(const TransportEnv& env,
                               descriptor::TransportEndpoint* endpoint) = 0;

  // Makes a local buffer usable by this transport and returns its handle
  // (valid until UnregisterMemory; may be null). For a remote-accessible
  // region the transport may add per-NIC keys to `published`, the entry
  // the engine publishes in its segment descriptor.
  virtual absl::StatusOr<MemoryHandle> RegisterMemory(
      const MemoryRegion& region, descriptor::Buffer* published) = 0;

  // Reverses RegisterMemory for the region starting at `addr`. The engine
  // calls it only once no slice of its own uses the region; it waits for
  // accesses by peers that are in progress.
  virtual absl::Status UnregisterMemory(uintptr_t addr) = 0;

  // Whether this transport can move bytes to the segment `target`
  // describes at all, given the endpoint it published (the engine has
  // checked that there is one): the shm transport reaches only an engine
  // on this host that lets this process at its memory. The engine asks
  // when it picks a transport for a target (once per run of requests to
  // it, never per slice) and takes the next transport in its order where
  // the answer is no. May make local system calls; never waits on the
  // network. Default: yes.
  virtual bool CanReach(const SegmentView& target) { return true; }

  // Largest slice the transport wants to be given.
  virtual size_t max_slice_bytes() const = 0;

  // Starts moving `slices`; each is completed later (or inline) through its
  // sink, with DeadlineExceeded if it is not done by its deadline. The
  // caller's thread may do the posting (run to completion); it never
  // blocks on the network or on a connection being set up.
  virtual void Submit(absl::Span<Slice* const> slices) = 0;

  // Reaps completions on the calling thread and returns how many slices it
  // completed; never blocks. Transports whose threads complete everything
  // by themselves return 0. The engine calls it while an application
  // thread waits for a batch, so a waiting thread does the completion work
  // on its own core instead of handing it to a worker and back.
  virtual size_t Poll() { return 0; }

  // Releases what the transport keeps for the peer `segment` describes
  // (connections, endpoints, records): at once where idle, else as soon as
  // the slices on them completed. Never fails a slice; a later Submit to
  // the peer sets up what it needs again. Called by CloseSegment.
  virtual void ClosePeer(const SegmentView& segment) = 0;

  // A snapshot of the transport's counters.
  virtual TransportStats Stats() const = 0;

  // Stops threads; in-flight slices complete with Cancelled/Unavailable.
  virtual void Shutdown() = 0;
};

// Everything transports are configured with, parsed once by the engine.
struct TransportOptions {
  TcpOptions tcp;
  RdmaOptions rdma;
  ShmOptions shm;
  // Bound of connection set-up (TCP connect, RDMA handshake RPCs).
  absl::Duration connect_timeout = absl::Seconds(3);
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TRANSPORT_H_
