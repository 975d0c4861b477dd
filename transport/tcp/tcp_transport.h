// TcpTransport: Ferry's fallback transport over kernel TCP. Needs no special
// hardware; also the reference the RDMA transport is compared with.
//
// Target side: a TcpServer applies peers' requests to this engine's
// registered memory. Initiator side: a TcpClient keeps a small pool of
// connections per peer address. Both run on a fixed set of event-loop
// threads (TcpOptions::io_threads each): no thread per connection.
//
// Failure model (what a user sees; the limits are TcpOptions, defaults in
// brackets):
//
// * Deadlines. Every slice ends -- OK, failed, or DeadlineExceeded -- by
//   its deadline plus 100 ms (deadlines are checked every 10 ms on the
//   loop; the rest is loop latency), whatever the peer does: stopped
//   (SIGSTOP, sendmsg would block), killed, black-holed, or dripping a
//   response one byte at a time. A slice whose request has not reached the
//   socket just leaves its queue. One whose request is (partly) on the
//   wire cannot be taken back, so its connection is closed; the other
//   slices on that connection that never reached the wire are retried on
//   another connection (up to 4 tries), those that did fail with
//   Unavailable (DeadlineExceeded if late). A WRITE that failed or timed
//   out may or may not have been applied at the target, in whole or in
//   part; it is never sent twice by the transport.
// * Peer failures. A killed peer or a broken connection fails the slices on
//   the wire with Unavailable at once. A peer that refuses, does not answer
//   a connect within TransportOptions::connect_timeout [3 s], or drops
//   connections before ever answering is backed off per address
//   [100 ms doubling to 5 s]; meanwhile its slices fail at once with
//   Unavailable "TCP peer A is backed off after N failed attempts (last:
//   cause); next attempt in T", counted in TransportStats::fast_failures.
//   At most one connect attempt per back-off interval: no storm. Slices
//   that waited for the attempt that failed end with Unavailable naming
//   its cause (connect_failures counts the attempts).
// * Access. Each remote-accessible buffer gets a random 64-bit key at
//   registration (a new one each time), published as Buffer.tcp_key; every
//   frame carries the key of the buffer it touches and the target engine
//   run's incarnation, both from the initiator's descriptor. A wrong key
//   fails the slice with PermissionDenied, another incarnation (the target
//   restarted, or another process now has its port) with
//   FailedPrecondition; neither reads or writes a byte, and both are
//   counted in TransportStats::denied_frames. A range in no
//   remote-accessible buffer fails with InvalidArgument.
// * Bad descriptors. A TCP endpoint that is not a numeric IPv4
//   "address:port" fails its slices with InvalidArgument naming it and
//   creates no state (names are not resolved: that could block).
// * Bounded state, initiator: at most max_peers [1024] peer pools, least
//   recently used idle ones dropped (ResourceExhausted for a new peer while
//   all are busy); connections_per_peer [2] each, closed after half of
//   idle_timeout unused; idle pools dropped after idle_timeout. ClosePeer
//   drops a peer's pool at once if idle, else when its slices completed.
// * Target limits: max_connections [4096] and max_connections_per_address
//   [64] accepted connections (one more is reset at once); a connection is
//   closed when its first request does not arrive within handshake_timeout
//   [10 s], when it is idle for idle_timeout [60 s], or when one frame (a
//   request with its payload, or a response until the peer took it) takes
//   longer than frame_timeout [10 s]; a READ response counts from when it
//   was queued, however many wait before it. So a lease on target memory
//   is held at most 2 x frame_timeout (a WRITE payload, then a paused
//   queue of answers) plus the 50 ms check, and UnregisterMemory waits
//   2 x frame_timeout + 1 s for the accesses in progress. Out of fds, the
//   listener sheds the waiting connections with a spare fd and backs off (10 ms
//   doubling to 1 s) instead of spinning, and recovers as soon as fds come
//   back. Malformed frames close that connection only.
// * Threads: 2 x io_threads [1], created at Install; if the system refuses
//   one, Install fails with ResourceExhausted (never an abort).
// * GPU memory. Sockets cannot read or write device memory, so both sides
//   stage it through pinned host buffers: TcpOptions::staging_buffers
//   [8] of max_slice_bytes each per side (the initiator's when a GPU
//   buffer is first registered, the target's at its first GPU frame), the
//   bound of the path's memory. The initiator copies on streams and a
//   thread of its own, so copies overlap the wire (gpu_staging.h); the
//   target copies on its loop thread, the kernel's socket buffers keeping
//   the wire busy meanwhile (target_staging.h). A slice waits, in order,
//   for a free buffer (so its deadline is kept only to within the
//   deadlines of the slices holding the buffers; one that expired while
//   waiting fails then, uncopied); a frame longer than the target's buffers
//   fails with InvalidArgument, a failed copy with Internal (both name the
//   cause). TransportStats counts staged slices, waits, copies and their bytes.
// * Shutdown completes everything still queued or in flight with Cancelled.
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define FERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"
#include "transport/gpu_staging.h"
#include "transport/memory_registry.h"
#include "transport/tcp/tcp_client.h"
#include "transport/tcp/tcp_server.h"
#include "transport/transport.h"

namespace ferry::tcp {

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TransportOptions& options);
  ~TcpTransport() override;

  absl::string_view name() const override { return "tcp"; }
  absl::Status Install(const TransportEnv& env,
                       descriptor::TransportEndpoint* endpoint) override;
  absl::StatusOr<MemoryHandle> RegisterMemory(
      const MemoryRegion& region, descriptor::Buffer* published) override;
  absl::Status UnregisterMemory(uintptr_t addr) override;
  size_t max_slice_bytes() const override {
    return options_.tcp.max_slice_bytes;
  }
  void Submit(absl::Span<Slice* const> slices) override;
  void ClosePeer(const SegmentView& segment) override;
  TransportStats Stats() const override;
  void Shutdown() override;

  // The target side, for tests.
  const TcpServer& server() const { return server_; }

 private:
  const TransportOptions options_;
  // The keys of remote-accessible buffers, by address; registry_'s handle 0
  // of each points into this map's values (declared first: outlives it).
  Mutex keys_mu_;
  absl::flat_hash_map<uintptr_t, std::unique_ptr<BufferKey>> keys_
      ABSL_GUARDED_BY(keys_mu_);
  MemoryRegistry registry_;
  TcpServer server_;
  TcpClient client_;
  // Staged slices go to the client as host memory.
  struct ClientPath final : StagingPath {
    explicit ClientPath(TcpClient* c) : client(c) {}
    void SubmitStaged(Slice* slice) override {
      client->Submit(absl::MakeConstSpan(&slice, 1));
    }
    TcpClient* client;
  };
  ClientPath staging_path_{&client_};
  GpuStaging gpu_staging_;
  // The local handle of a GPU buffer: which device (host buffers: null).
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_
