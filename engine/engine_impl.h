// EngineImpl: the implementation behind TransferEngine, a facade over its
// parts: local memory registration and the MR cache (registrations.h),
// received notifications (notifications.h), batches (batch_table.h),
// segments (segment_cache.h) and publication (segment_publisher.h). It owns
// them, forwards to them and wires them together; each part calls only
// the parts below it, never back into the engine. Its own code by concern:
// engine_init.cc (Init's steps, Shutdown), engine_impl.cc (the forwarding
// calls, segments, sending notifications, statistics) and engine_submit.cc
// (submission, slicing, status). Thread-safety as in transfer_engine.h.
#ifndef FERRY_ENGINE_ENGINE_IMPL_H_
#define FERRY_ENGINE_ENGINE_IMPL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/clock.h"
#include "common/identity.h"
#include "common/mutex.h"
#include "engine/batch_table.h"
#include "engine/grpc_peer_channel.h"
#include "engine/notifications.h"
#include "engine/registrations.h"
#include "engine/segment_cache.h"
#include "engine/segment_publisher.h"
#include "engine/sender_check.h"
#include "ferry/transfer_engine.h"
#include "metadata/metadata_client.h"
#include "metadata/metadata_service.h"
#include "metadata/peer_service.h"
#include "metadata/rpc_server.h"
#include "transport/memory_registry.h"
#include "transport/transport.h"

namespace ferry {

class EngineImpl;

// One request after validation, ready to become a task.
struct Prepared {
  const TransferRequest* request = nullptr;
  MemoryRegistry::Lease lease;
  const SegmentView* view = nullptr;
  int buffer = -1;       // Index of the target buffer in the view.
  size_t transport = 0;  // Index into the engine's transports.
  // The cached descriptor cannot place it (stale, or no buffer holds the
  // range): it waits for a fresh one (SegmentCache::Park).
  bool park = false;
};

// The target of a run of requests to one segment: its snapshot (kept alive
// in `keep`) and the first installed transport that serves it.
struct TargetCursor {
  std::vector<std::shared_ptr<const SegmentView>>* keep;
  SegmentHandle handle = 0;
  const SegmentView* view = nullptr;
  size_t transport = 0;
  int view_transport = 0;  // `transport`'s index in the view.
  bool fresh = true;       // The snapshot is not marked stale.

  // FailedPrecondition if no installed transport reaches the segment.
  absl::Status Set(SegmentHandle h, std::shared_ptr<const SegmentView> v,
                   const EngineImpl* engine);
};

class EngineImpl {
 public:
  EngineImpl() = default;
  ~EngineImpl();

  absl::Status Init(const EngineOptions& options);
  void Shutdown();

  const EngineOptions& options() const { return options_; }
  std::string metadata_address() const;
  std::string rpc_address() const;
  const std::string& advertised_host() const { return advertised_host_; }
  const std::string& advertised_host_reason() const {
    return advertised_reason_;
  }

  absl::Status RegisterLocalMemory(void* addr, size_t length,
                                   const std::string& location,
                                   bool remote_accessible);
  absl::Status UnregisterLocalMemory(void* addr);
  absl::Status RegisterLocalMemoryBatch(const std::vector<BufferEntry>& buffers,
                                        const std::string& location,
                                        bool remote_accessible);
  absl::Status UnregisterLocalMemoryBatch(const std::vector<void*>& addrs);

  absl::StatusOr<SegmentHandle> OpenSegment(const std::string& name);
  absl::Status RefreshSegment(SegmentHandle handle);
  absl::Status CloseSegment(SegmentHandle handle);

  absl::StatusOr<std::vector<RemoteBuffer>> GetSegmentBuffers(
      SegmentHandle handle);
  absl::StatusOr<BatchId> AllocateBatch(size_t capacity);
  absl::Status SubmitTransfer(BatchId batch,
                              absl::Span<const TransferRequest> requests);
  absl::StatusOr<TransferStatus> GetTransferStatus(BatchId batch, size_t index);
  absl::StatusOr<BatchStatus> GetBatchStatus(BatchId batch);
  absl::StatusOr<BatchStatus> WaitBatch(BatchId batch, absl::Duration timeout);
  absl::Status FreeBatch(BatchId batch);

  absl::Status SendNotification(SegmentHandle target, const std::string& name,
                                const std::string& message);
  std::vector<Notification> GetNotifications();
  std::vector<TransportStats> GetTransportStats() const;
  EngineStats GetEngineStats() const;

 private:
  friend struct TargetCursor;
  // What Init's steps hand on to later ones (engine_init.cc).
  struct Startup;

  // Init's steps (engine_init.cc), in order. A step that fails leaves the
  // cleanup to Init.
  // The options as this run uses them: the auth token from the
  // environment if none is given, validated, log levels set.
  absl::Status CompleteOptions(EngineOptions* options) const;
  // Adopts the options, chooses the advertised host and starts the MR
  // cache.
  absl::Status BeginRun(const EngineOptions& options, Startup* up);
  // Sets advertised_host_ and advertised_reason_ (EngineOptions::
  // advertise_host says how). May resolve names: Init only.
  absl::Status ChooseAdvertisedHost(const EngineOptions& options,
                                    const TransportOptions& topts);
  // Starts the gRPC server: the peer service, and the metadata service if
  // embedded.
  absl::Status StartRpcServer(const EngineOptions& options, Startup* up);
  // Names this run (addresses, segment name, identity key) and makes the
  // client it sends with.
  absl::Status NameRun(const EngineOptions& options, Startup* up);
  // Connects to the metadata (or serves it, P2P).
  absl::Status ConnectMetadata(const EngineOptions& options, Startup* up);
  // The segment cache, the sender check and what the peer service calls.
  void StartPeerServices(const EngineOptions& options, const Startup& up);
  // Installs each transport, describing them in *desc.
  absl::Status InstallTransports(const EngineOptions& options,
                                 const Startup& up,
                                 descriptor::SegmentDescriptor* desc);
  absl::Status PublishSegment(const EngineOptions& options, const Startup& up,
                              const descriptor::SegmentDescriptor& desc);
  void LogStarted(const EngineOptions& options, const Startup& up) const;

  // Validates request `index` into *out. `prev` (if not null) is the
  // request before it: a local range in the same buffer shares its lease.
  absl::Status Prepare(size_t index, const TransferRequest& request,
                       const Prepared* prev, TargetCursor* cursor,
                       Prepared* out);
  // Fills task.slices for the request the task holds, targeting buffer
  // `buffer` of `view` through transport `transport`, and appends them to
  // *out (to be submitted to that transport).
  void SliceTask(Task* task, const SegmentView* view, int buffer,
                 size_t transport, std::vector<Slice*>* out);
  // Turns a prepared request into the batch's next task: sliced onto
  // (*per_transport)[its transport], or, if it waits for a descriptor,
  // added to *parked.
  void AddTaskLocked(Batch* batch, Prepared* p, absl::Time deadline,
                     std::vector<Task*>* parked,
                     std::vector<std::vector<Slice*>>* per_transport)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch->mu);
  // The first of transports_[first..] that segment `v` serves and that
  // reaches its buffer `buffer`; `first` if none does (its data path then
  // says why, and what would reach the buffer).
  size_t TransportFor(const SegmentView& v, int buffer, size_t first) const;
  // Whether segment `v` serves transports_[t] and that transport can reach
  // it from here (Transport::CanReach: shm needs the same host).
  bool Serves(const SegmentView& v, size_t t) const;
  // A parked task's descriptor came (SegmentCache's ready callback): run
  // it, or end it with the reason it cannot run.
  void OnDescriptorReady(Task* task, std::shared_ptr<const SegmentView> view,
                         const absl::Status& fetch);
  // One round of Transport::Poll over all transports; slices completed.
  size_t PollTransports();
  // Reaps completions on this thread until the batch is done, `deadline`
  // passes, or wait_spin passes without a completion.
  void DriveUntilDone(Batch* batch, absl::Time deadline);
  void ReleaseAll();
  // Stops segment lookups and shuts the transports down, once.
  void StopTransports();

  EngineOptions options_;
  // Where every part of this engine reads and waits on time
  // (ClockOrReal(options_.clock)); set by Init before any thread starts.
  Clock* clock_ = RealClock();
  std::atomic<bool> initialized_{false};
  uint64_t incarnation_ = 0;
  // What peers are told (EngineOptions::advertise_host), and why.
  std::string advertised_host_;
  std::string advertised_reason_;
  // What other engines pass as metadata_endpoint to use this one's.
  std::string metadata_address_;
  std::string rpc_address_;  // This engine's gRPC server.

  // The embedded metadata service, whose leases expire on clock_. Made by
  // the first Init and kept across Shutdown (with its segments), unless a
  // later Init brings another clock.
  std::unique_ptr<metadata::MetadataServiceImpl> metadata_service_;
  Clock* metadata_service_clock_ = nullptr;
  metadata::PeerServiceImpl peer_service_;
  std::unique_ptr<metadata::RpcServer> rpc_server_;
  std::unique_ptr<metadata::Store> metadata_;
  // Keeps the segment published (lease renewals, re-publication); after
  // metadata_, which it uses.
  std::unique_ptr<SegmentPublisher> publisher_;
  std::unique_ptr<metadata::PeerClient> peer_client_;
  std::unique_ptr<GrpcPeerChannel> peer_channel_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<size_t> slice_bytes_;  // max_slice_bytes() of each transport.
  std::unique_ptr<SegmentCache> segments_;

  // The application's registrations and the MR cache's, with every
  // transport in transports_.
  Registrations registrations_{&transports_};

  TaskSink sink_;
  BatchTable batches_;

  std::unique_ptr<SenderCheck> sender_check_;  // Uses metadata_.
  bool transports_stopped_ = false;  // StopTransports ran (until ReleaseAll).
  // This run's identity key (common/identity.h): made by Init, published
  // in the descriptor, signing what peer_client_ sends.
  std::shared_ptr<const IdentityKey> identity_;
  // What peers sent, until GetNotifications; kept across Shutdown.
  Notifications notifications_;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_ENGINE_IMPL_H_
