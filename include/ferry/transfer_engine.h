// ferry::TransferEngine: moves bytes between registered memory segments of
// engines on many hosts. The API mirrors Mooncake Transfer Engine's
// (init / registerLocalMemory / openSegment / allocateBatchID /
// submitTransfer / getTransferStatus / freeBatchID) so that code and
// tutorials map one to one, with these differences:
//   - every call returns absl::Status / absl::StatusOr, never throws;
//   - batch ids and segment handles are validated values, not pointers: a
//     freed, stale or forged id is an error, never undefined behaviour;
//   - WaitBatch reaps completions on the caller's thread for a bounded
//     time, then blocks on a condition variable (never an unbounded spin);
//   - a WRITE completes only after the target has applied it.
//
// Thread-safety: after Init returns, every method may be called from any
// thread concurrently. Init and Shutdown must not race with other calls.
#ifndef FERRY_INCLUDE_FERRY_TRANSFER_ENGINE_H_
#define FERRY_INCLUDE_FERRY_TRANSFER_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "ferry/etcd_limits.h"
#include "ferry/opcode.h"
#include "ferry/options.h"
#include "ferry/stats.h"

namespace ferry {

// The engine's time source (common/clock.h): only tests set one.
class Clock;

// A batch of transfer requests: allocated, filled by SubmitTransfer, polled
// or waited on, freed. Encodes a slot and a generation.
using BatchId = uint64_t;
// An opened remote (or local) segment. Valid for the engine's lifetime.
using SegmentHandle = uint64_t;

struct EngineOptions {
  // This engine's segment name, unique among the engines sharing a metadata
  // service. Printable ASCII, no spaces, at most 256 bytes.
  std::string local_segment_name;
  // Where segments are published and looked up, written as in Mooncake
  // (metadata/address/metadata_address.h):
  //   "embedded": run a metadata service inside this engine (other engines
  //     then use metadata_address() of this one);
  //   "host:port" or "ferry://host:port": a running Ferry service (another
  //     engine's embedded one, or tools/metadata_server);
  //   "etcd://host:port[,host:port...]": an etcd v3 cluster, directly;
  //   "P2PHANDSHAKE": no metadata service. The segment is named by this
  //     engine's RPC address, host:port (local_segment_name() after Init;
  //     set rpc_port and advertise_host to choose it), and peers ask the
  //     engine at host:port for its descriptor.
  std::string metadata_endpoint = "embedded";
  // A namespace (a cluster id): this engine's segment is published as
  // "<namespace>/<name>" and it opens segments of its namespace only, so
  // several clusters share one metadata service or etcd. Empty: none.
  std::string metadata_namespace = "";
  // With an etcd:// metadata_endpoint: what this engine's own etcd store
  // allows and how it compacts etcd's history (include/ferry/etcd_limits.h).
  // Engines and metadata_servers that share an etcd prefix should agree;
  // set compact_after to 0 on all of them where other applications share
  // the etcd cluster (compaction is etcd-wide).
  metadata::EtcdLimits etcd_limits;
  // A shared secret of the cluster (16+ printable characters; empty:
  // none). When set, this engine's peer service and embedded metadata
  // service answer only calls that carry it (others get UNAUTHENTICATED
  // and change nothing), and the engine sends it on every call it makes.
  // Give every engine and metadata_server of the cluster the same one.
  // Empty here: the environment's, if it has one ($FERRY_AUTH_TOKEN_FILE
  // or $FERRY_AUTH_TOKEN; Init fails InvalidArgument on a bad one), so
  // code that cannot pass a token (ferry.mooncake) can still use one.
  // With none, an engine listening beyond loopback logs a warning once.
  // What it does and does not protect: metadata/auth.h.
  std::string auth_token = "";
  // Mutual TLS on the engine's gRPC traffic (metadata calls, handshakes,
  // notifications, P2P descriptor reads): PEM files of the cluster CA, of
  // this engine's certificate (signed by it) and of its key; all three or
  // none. With them, the engine's peer service and embedded metadata
  // service accept only clients with a certificate from that CA, and the
  // engine checks every server's certificate against it and against the
  // host it dialled (so certificates name the addresses peers dial,
  // 127.0.0.1 included for an embedded service), or against
  // tls_server_name if that is set. The data path is not encrypted. What
  // it does and does not protect: metadata/tls.h.
  std::string tls_ca_file = "";
  std::string tls_cert_file = "";
  std::string tls_key_file = "";
  std::string tls_server_name = "";
  // Where the engine's listeners (gRPC server, TCP transport) bind: a host
  // name, an IPv4 or IPv6 literal, "0.0.0.0" (every IPv4 interface), or ""
  // (every interface, IPv4 and IPv6).
  std::string listen_host = "";
  // The address peers are told to reach this engine at (in its segment
  // descriptor): a host name (resolved once, at Init) or an IP literal.
  // Empty: chosen at Init, in this order: listen_host if it names one
  // address; the address of the network interface behind the first RDMA
  // NIC (with the rdma transport); the host's primary address (the one of
  // the default route's interface); loopback on a host with no other
  // address. A peer on another host that finds a loopback address in a
  // descriptor fails OpenSegment with FailedPrecondition saying so.
  std::string advertise_host = "";
  // Log levels (common/log.h): "" leaves them as they are (FERRY_LOG_LEVEL
  // or "info"); else a level ("debug") or per component ("warn,rdma=info")
  // applied at Init, for the whole process.
  std::string log_level = "";
  // Port of the engine's gRPC server (peer service, embedded metadata).
  // 0 picks a free port; set one where a firewall must let peers in
  // (docs/deployment.md lists every port).
  uint16_t rpc_port = 0;
  // Transports to install, in order of preference; a request uses the first
  // one that the target segment also serves and that reaches it from here.
  // "shm" (same host, direct copies) reaches only engines on this host, so
  // {"shm", "rdma"} copies to local peers and uses RDMA for the others.
  std::vector<std::string> transports = {"tcp"};
  // Deadline of every metadata and peer RPC.
  absl::Duration rpc_timeout = absl::Seconds(3);
  // The lease on this engine's segment in the metadata service: renewed
  // every third of it; if the engine dies, its segment is removed this long
  // after the last renewal, and peers' requests to it end FAILED
  // ("no longer registered") instead of retrying a dead address. The
  // engine also publishes its segment again by itself when the service
  // lost it (a metadata_server restarted). Zero: no lease, the segment
  // stays until removed (Mooncake's behaviour); it needs auth_token,
  // since a metadata service with none refuses such segments (anyone
  // could hold a name for ever). At most 1 h.
  absl::Duration metadata_lease_ttl = absl::Seconds(10);
  // A segment name belongs to one engine run at a time. If another run
  // holds it (its lease lives), Init waits up to this long for it to be
  // released before failing AlreadyExists: a run restarted after a crash
  // comes up once the crashed run's lease has ended, while a second engine
  // started by mistake with a live engine's name fails. Negative (the
  // default): metadata_lease_ttl plus one second. Zero: fail at once.
  absl::Duration segment_name_wait = absl::Seconds(-1);
  // A request not completed this long after submission ends in TIMEOUT.
  absl::Duration transfer_timeout = absl::Seconds(30);
  // Per-transport settings (include/ferry/options.h).
  TcpOptions tcp;
  RdmaOptions rdma;
  ShmOptions shm;
  // How long WaitBatch reaps completions on the calling thread before it
  // blocks, counted from the last completion it saw: while completions
  // keep coming it keeps going (run to completion on the caller's core,
  // no hand-off between threads). Zero: block at once and leave all
  // completion work to the transports' threads. Measured on the system
  // clock whatever `clock` is: it bounds CPU time spent.
  absl::Duration wait_spin = absl::Microseconds(50);
  // MR cache: when > 0, a request whose local source is mapped memory but
  // not registered gets it registered on first use (page-aligned, not
  // remote-accessible); cached registrations beyond this many bytes are
  // unregistered, least recently used first, never while in use. A cached
  // registration is dropped as soon as its memory is unmapped, freed back
  // to the kernel or remapped (memory hooks in libc, as UCX does; x86-64;
  // Init fails with FailedPrecondition where they cannot be installed).
  // At most 64 engines of one process may have it on at once (the hooks'
  // watcher pool); Init of one more fails with ResourceExhausted. GPU
  // memory is cached as the driver's whole allocation; no hook sees
  // cuMemFree, so its allocation id is checked at each use and each miss
  // (docs/gpu.md). 0 (the default): unregistered sources are an error.
  size_t mr_cache_bytes = 0;
  // Upper bound of AllocateBatch capacity.
  size_t max_batch_capacity = 1 << 16;
  // Received notifications queue until GetNotifications takes them; beyond
  // either bound further ones are refused to their senders
  // (ResourceExhausted), so a chatty or hostile peer cannot grow this
  // engine's memory without bound.
  size_t max_queued_notifications = 1 << 16;
  size_t max_queued_notification_bytes = 64 << 20;
  // Of those, what one sender address may hold, in count and in bytes (a
  // flood from one peer is refused while others still get through).
  size_t max_queued_notifications_per_sender = 1 << 13;
  size_t max_queued_notification_bytes_per_sender = 8 << 20;
  // Every notification's claimed sender segment is checked: it must be
  // registered, and have signed the notification with the identity key
  // it publishes, for this receiver's run, with a number not used before
  // (Notification::sender_verified; engine/sender_check.h). True (the default):
  // unverified ones are refused, PermissionDenied to the sender naming what did
  // not match (Unavailable when the check could not be made now: the sender may
  // retry). False: they are queued too, marked unverified.
  bool refuse_unverified_notifications = true;
  // Where the engine and its transports read the time and wait on it
  // (common/clock.h): leases, deadlines, backoff, keepalives, reaping.
  // Null (the default): the system clock. Tests of time-driven behaviour
  // pass a SimulatedClock. Not owned; must outlive the engine.
  Clock* clock = nullptr;
};

// One buffer of RegisterLocalMemoryBatch.
struct BufferEntry {
  void* addr = nullptr;
  size_t length = 0;
};

struct TransferRequest {
  OpCode opcode = OpCode::kRead;
  // Local memory: the source of a WRITE, the destination of a READ. Must lie
  // inside one buffer registered with RegisterLocalMemory.
  void* source = nullptr;
  SegmentHandle target_id = 0;
  // The remote virtual address (as in Mooncake TE), inside one buffer the
  // target registered as remote-accessible.
  uint64_t target_offset = 0;
  size_t length = 0;
};

enum class TransferState {
  kWaiting,    // Accepted, not yet handed to a transport.
  kPending,    // In flight.
  kCompleted,  // Every byte moved (a WRITE: applied at the target).
  kFailed,     // See TransferStatus::error.
  kTimeout,    // Not done within EngineOptions::transfer_timeout.
};

const char* TransferStateName(TransferState state);

struct TransferStatus {
  TransferState state = TransferState::kWaiting;
  // Bytes of this request moved so far.
  uint64_t transferred_bytes = 0;
  // Why the request failed or timed out; OK otherwise.
  absl::Status error;
};

struct BatchStatus {
  // kCompleted if every request completed; kFailed/kTimeout if any failed
  // (the first failure's state) and all are done; kPending otherwise.
  TransferState state = TransferState::kWaiting;
  size_t total = 0;
  size_t completed = 0;
  size_t failed = 0;
  uint64_t transferred_bytes = 0;
  absl::Status first_error;
};

// A buffer a segment registered as remote-accessible.
struct RemoteBuffer {
  uint64_t addr = 0;
  uint64_t length = 0;
  std::string location;
};

// Engine-level counters and gauges (transport ones: GetTransportStats).
struct EngineStats {
  // Segments open now (OpenSegment minus CloseSegment).
  uint64_t segments_open = 0;
  // Descriptors fetched in the background (after a request missed its
  // buffer in the cached one, or failed), and fetches that failed.
  uint64_t descriptor_refreshes = 0;
  // Changes of open segments pushed by the metadata service (WatchSegment)
  // and applied without a fetch.
  uint64_t descriptor_pushes = 0;
  uint64_t descriptor_refresh_failures = 0;
  // Requests waiting (kWaiting) for such a fetch now, and in total.
  uint64_t requests_waiting_for_descriptor = 0;
  uint64_t requests_waited_for_descriptor = 0;
  // Notifications received and not yet taken, their bytes, and how many
  // were refused because the queue was full.
  uint64_t notifications_queued = 0;
  uint64_t notification_bytes_queued = 0;
  uint64_t notifications_refused = 0;
  // Peer-service channels cached (bounded; least recently used closed).
  uint64_t peer_channels = 0;
  // MR cache: registrations and their bytes now; registrations dropped
  // because their memory was released or replaced (unmapped, freed back
  // to the kernel, remapped).
  uint64_t mr_cache_registrations = 0;
  uint64_t mr_cache_bytes = 0;
  uint64_t mr_cache_invalidations = 0;
  // Registrations dropped to stay within mr_cache_bytes.
  uint64_t mr_cache_evictions = 0;
};

struct Notification {
  // The segment the sender says it is; trust it only if sender_verified.
  std::string from_segment;
  std::string name;
  std::string message;
  // Where the notification came from, as the connection shows it
  // ("ipv4:10.0.0.7"): the sender cannot choose it.
  std::string sender_address;
  // from_segment is registered and signed this notification with the
  // identity key it publishes (looked up in the metadata when it arrived),
  // and it was not received before. An engine of a release before identity
  // keys is held to its host instead: published from sender_address's
  // host. P2P mode checks the host only.
  bool sender_verified = false;
};

class EngineImpl;

class TransferEngine {
 public:
  // This host's RDMA NICs as Mooncake TE's priority matrix: JSON mapping
  // each memory location ("cpu:0", "cuda:1") to its tiers of NIC names,
  // best first, read from sysfs. `devices` is a comma-separated filter
  // (empty: every NIC). Where sysfs places none of them (soft NICs,
  // containers without /sys/class/infiniband), {"*": [[every NIC]]}: any
  // NIC is as good as another. NotFound when there is no NIC (named).
  // The result can be given back as EngineOptions' rdma.topology_json.
  // Thread-safe; needs no engine.
  static absl::StatusOr<std::string> LocalTopology(
      absl::string_view devices = "");

  TransferEngine();
  // Calls Shutdown().
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Starts the engine: gRPC server (peer service, and the metadata service
  // if embedded), transports, and publishes this segment. Fails with
  // InvalidArgument for bad options, Unavailable/DeadlineExceeded if the
  // metadata service cannot be reached within rpc_timeout, AlreadyExists if
  // called twice. On failure the engine holds no resources and Init may be
  // retried.
  absl::Status Init(const EngineOptions& options);

  // Removes this segment from the metadata service, stops transports and
  // servers. Requests still in flight end FAILED. Idempotent.
  void Shutdown();

  // The address this engine advertises to peers (EngineOptions::
  // advertise_host, resolved, or the one chosen at Init) and why it was
  // chosen. Empty before Init.
  std::string advertised_host() const;
  std::string advertised_host_reason() const;

  // The metadata service this engine uses: with an embedded one, this
  // engine's gRPC address, which other engines pass as metadata_endpoint;
  // else EngineOptions::metadata_endpoint as given. Empty before Init.
  std::string metadata_address() const;
  // "host:port" of this engine's gRPC server (its peer service, and the
  // embedded metadata service if there is one), as peers are told it.
  // Empty before Init.
  std::string rpc_address() const;
  // This engine's segment name: EngineOptions::local_segment_name, or in
  // P2PHANDSHAKE mode the host:port peers open it by.
  const std::string& local_segment_name() const;

  // Registers [addr, addr + length) with every transport. `location` is
  // "cpu:N", "cuda:N" or "*". A remote-accessible buffer is published so
  // peers can READ and WRITE it. InvalidArgument for a null address, zero
  // length or wrap-around; AlreadyExists if it overlaps a registered buffer.
  // GPU memory (docs/gpu.md) must lie in one driver allocation, and must
  // be unregistered before that allocation is freed.
  absl::Status RegisterLocalMemory(void* addr, size_t length,
                                   const std::string& location = "*",
                                   bool remote_accessible = true);

  // Registers several buffers as RegisterLocalMemory does, all or none,
  // with one metadata round trip for the whole batch (Mooncake's
  // registerLocalMemoryBatch): registering n buffers costs one RPC, not n.
  // A batch of 256 MiB or more is pinned on up to min(CPUs, 8) threads
  // (pinning is registration's cost: bench/register_bench); the buffers
  // must not overlap each other. On failure the error names the buffer
  // (its index) and nothing stays registered.
  absl::Status RegisterLocalMemoryBatch(const std::vector<BufferEntry>& buffers,
                                        const std::string& location = "*",
                                        bool remote_accessible = true);

  // Unregisters the buffers starting at `addrs` as UnregisterLocalMemory
  // does, with one metadata round trip for the batch. Each is attempted;
  // the first error (naming its address) is returned.
  absl::Status UnregisterLocalMemoryBatch(const std::vector<void*>& addrs);

  // Unregisters the buffer that starts at `addr`. Waits (up to
  // transfer_timeout) for this engine's requests that use it, then gives up
  // with FailedPrecondition and leaves it registered. NotFound if no buffer
  // starts at `addr`.
  absl::Status UnregisterLocalMemory(void* addr);

  // Returns a handle for the named segment, fetching and caching its
  // descriptor. NotFound if no engine published that name. Opening the same
  // name twice returns the same handle.
  absl::StatusOr<SegmentHandle> OpenSegment(const std::string& name);

  // Fetches the segment's descriptor again (e.g. after the peer registered
  // more memory). Requests already submitted keep the snapshot they used.
  // Rarely needed: a request that misses its buffer in the cached
  // descriptor fetches a new one by itself (see SubmitTransfer).
  absl::Status RefreshSegment(SegmentHandle handle);

  // Closes the segment: the handle becomes invalid (NotFound afterwards;
  // OpenSegment of the name returns a new one), and what the engine keeps
  // for the peer -- cached descriptor, connections, endpoints, channels --
  // is released, at once where idle, otherwise as soon as the requests in
  // flight to it completed (they are not failed). Requests waiting for
  // its descriptor fail with FailedPrecondition. NotFound for an invalid
  // handle.
  absl::Status CloseSegment(SegmentHandle handle);

  // The remote-accessible buffers of the segment, from the cached
  // descriptor (RefreshSegment first to see newer registrations), sorted by
  // address. NotFound for an invalid handle.
  absl::StatusOr<std::vector<RemoteBuffer>> GetSegmentBuffers(
      SegmentHandle handle);

  // Allocates a batch for up to `capacity` requests (1..max_batch_capacity).
  absl::StatusOr<BatchId> AllocateBatch(size_t capacity);

  // Submits `requests` to the batch; may be called several times until the
  // batch's capacity is used. Never waits on the network. All requests are
  // validated first: on any error (named with the request's index) none is
  // submitted. Errors: InvalidArgument for a bad batch id, zero length, a
  // local range not inside registered memory, or more requests than the
  // remaining capacity; NotFound for an unknown segment handle;
  // FailedPrecondition if no installed transport reaches the target, or if
  // a local range is GPU memory whose allocation was freed under its
  // registration.
  //
  // A request whose remote range is not inside one remote-accessible
  // buffer of the cached descriptor (the peer may have registered it
  // since), or whose target's descriptor is marked stale after a failure,
  // is accepted and waits (kWaiting) for a descriptor fetched in the
  // background (at most one fetch per segment per 100 ms); then it runs,
  // or fails with InvalidArgument if the range is still not inside one
  // buffer. EngineStats counts these waits.
  absl::Status SubmitTransfer(BatchId batch,
                              absl::Span<const TransferRequest> requests);

  // Status of request `index` (in submission order) of the batch.
  absl::StatusOr<TransferStatus> GetTransferStatus(BatchId batch, size_t index);
  absl::StatusOr<BatchStatus> GetBatchStatus(BatchId batch);

  // Waits until every submitted request of the batch is done or `timeout`
  // passes: first reaping completions on this thread (see wait_spin), then
  // blocking on a condition variable. Returns the batch status;
  // DeadlineExceeded if the wait timed out (the requests continue).
  absl::StatusOr<BatchStatus> WaitBatch(BatchId batch, absl::Duration timeout);

  // Frees the batch. FailedPrecondition while requests are in flight (the
  // batch stays valid); InvalidArgument for a freed, stale or forged id.
  absl::Status FreeBatch(BatchId batch);

  // Sends a short message (name up to 256 bytes, message up to 64 KiB) to
  // the engine owning `target`. Delivered in order per sender; typically
  // sent after WaitBatch to tell the peer its data is in place.
  absl::Status SendNotification(SegmentHandle target, const std::string& name,
                                const std::string& message);

  // Removes and returns the notifications received so far (oldest first).
  std::vector<Notification> GetNotifications();

  // A snapshot of the engine's counters (zeros before Init).
  EngineStats GetEngineStats() const;

  // A snapshot of each installed transport's counters (per NIC slices,
  // bytes and errors; connections opened, accepted and evicted; retries),
  // in the order of EngineOptions::transports. Empty before Init.
  std::vector<TransportStats> GetTransportStats() const;

 private:
  std::unique_ptr<EngineImpl> impl_;
};

}  // namespace ferry

#endif  // FERRY_INCLUDE_FERRY_TRANSFER_ENGINE_H_
