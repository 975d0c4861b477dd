// MetadataServiceImpl: the gRPC front of a Store (store.h). Hosted either
// inside an engine (metadata endpoint "embedded", an in-memory store) or by
// tools/metadata_server (in-memory, durable or etcd). Thread-safe; gRPC
// calls it from its own threads.
//
// Every call is served with gRPC's callback API, so no call holds a thread
// while its response waits for a slow reader (issue 26): unary handlers
// run on a CallPool (call_pool.h), and WatchSegment streams hold no
// thread at all: one notifier thread turns the store's change notices
// into writes.
// Stores with an in-memory table (Store::watchable) are watched through
// it; others through their own WatchSegment (ForwardWatchReactor: etcd's
// watch), or, where they have none, the stream ends UNIMPLEMENTED and the
// readers refresh on a miss.
#ifndef FERRY_METADATA_METADATA_SERVICE_H_
#define FERRY_METADATA_METADATA_SERVICE_H_

#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "metadata/call_pool.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/segment_store.h"
#include "metadata/watch_budget.h"

namespace ferry::metadata {

class MetadataServiceImpl final : public MetadataService::CallbackService {
 public:
  // Watch streams served at once; more are refused RESOURCE_EXHAUSTED.
  static constexpr int kMaxWatches = 4096;
  // Watch streams one caller (AddressGroup(CallerAddress): an IPv4
  // address, an IPv6 /64) may hold at once; more are refused
  // RESOURCE_EXHAUSTED. Each stream holds a copy of its descriptor (and
  // gRPC the encoded event its client has not taken), so without it one
  // address could pin kMaxWatches copies of a large segment and leave no
  // stream for anyone else. Not 64, as for unary calls: an engine watches
  // every segment it opens (SegmentCache), and the engines of one host (a
  // process per GPU) share its address, so 64 would leave each of eight
  // engines only eight watched peers. A sixteenth of kMaxWatches, the share
  // CallPool gives a caller of its calls (64 of 1,024): sixteen hosts to
  // fill the service. A refused watch is no error to an engine: it
  // refreshes that segment on a miss, as with a store that cannot push.
  static constexpr int kMaxWatchesPerCaller = kMaxWatches / 16;
  // And the bytes of events the streams hold until gRPC has written them
  // (forever, for a client that does not read): WatchBudget's limits,
  // 1 GiB for the service and a sixteenth of it per caller. Counts alone
  // let one address's 256 streams on a large segment pin gigabytes. A
  // stream whose event does not fit ends RESOURCE_EXHAUSTED.
  static constexpr size_t kMaxWatchBytes = WatchBudget::kMaxBytes;
  static constexpr size_t kMaxWatchBytesPerCaller =
      WatchBudget::kMaxBytesPerCaller;

  // Serves an in-memory SegmentStore of its own, whose leases expire on
  // `clock` (null: the system clock; it must outlive the service).
  explicit MetadataServiceImpl(Clock* clock = RealClock());
  // Serves `store`, which must outlive the service, running handlers on a
  // CallPool with `pool` limits.
  explicit MetadataServiceImpl(Store* store, CallPoolOptions pool = {})
      : store_(store), pool_(pool) {}
  // The server must be shut down first (no stream left).
  ~MetadataServiceImpl() override;

  // Answers only calls carrying `token` (auth.h); empty: any, but then a
  // PutSegment with no lease (lease_ttl_ms=0, a segment that stays until
  // removed) is refused PermissionDenied unless the caller authenticated
  // with a TLS client certificate, so that no one can squat a name for
  // ever. Call before serving.
  void SetAuthToken(std::string token) { token_ = std::move(token); }

  grpc::ServerUnaryReactor* PutSegment(grpc::CallbackServerContext* ctx,
                                       const PutSegmentRequest* request,
                                       PutSegmentResponse* response) override;
  grpc::ServerUnaryReactor* UpdateBuffers(
      grpc::CallbackServerContext* ctx, const UpdateBuffersRequest* request,
      UpdateBuffersResponse* response) override;
  grpc::ServerUnaryReactor* GetSegment(grpc::CallbackServerContext* ctx,
                                       const GetSegmentRequest* request,
                                       GetSegmentResponse* response) override;
  grpc::ServerUnaryReactor* RemoveSegment(
      grpc::CallbackServerContext* ctx, const RemoveSegmentRequest* request,
      RemoveSegmentResponse* response) override;
  grpc::ServerUnaryReactor* ListSegments(
      grpc::CallbackServerContext* ctx, const ListSegmentsRequest* request,
      ListSegmentsResponse* response) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* ctx,
                                      const KeepAliveRequest* request,
                                      KeepAliveResponse* response) override;
  grpc::ServerWriteReactor<SegmentEvent>* WatchSegment(
      grpc::CallbackServerContext* ctx,
      const WatchSegmentRequest* request) override;

  // Returns once no unary handler runs or waits to (see
  // PeerServiceImpl::WaitIdle).
  void WaitIdle() { pool_.WaitIdle(); }
  // Unary calls admitted and not yet over (tests).
  int CallsForTesting() const { return pool_.calls(); }
  // Watch streams served now (tests).
  int WatchesForTesting() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return watches_;
  }
  // Tests: smaller byte limits for watch streams, to reach them with
  // events of a few MiB.
  void SetWatchByteLimitsForTesting(size_t max_bytes,
                                    size_t max_bytes_per_caller) {
    watch_budget_.SetLimits(max_bytes, max_bytes_per_caller);
  }
  // Bytes of events the watch streams of `caller` (AddressGroup) hold
  // (tests).
  size_t WatchBytesForTesting(const std::string& caller) const {
    return watch_budget_.held(caller);
  }

  // One watch stream's state, shared by its reactor and the notifier.
  struct WatchState;

 private:
  class WatchReactor;
  // Every call's first step: the token check, before the call takes a
  // pool slot, so a caller without the token costs no thread or queue
  // space.
  grpc::Status Admit(const grpc::CallbackServerContext& ctx);
  void Poke(std::shared_ptr<WatchState> state);
  void Release(const std::string& caller);  // A watch of `caller` ended.
  void NotifierLoop();

  std::unique_ptr<SegmentStore> own_store_;
  Store* store_;
  std::string token_;
  CallPool pool_;
  // Charged by every watch stream's reactor, which the server has ended
  // (OnDone, having given back all it held) before the service goes.
  WatchBudget watch_budget_;

  Mutex mu_;
  CondVar wake_;
  std::deque<std::shared_ptr<WatchState>> poked_ ABSL_GUARDED_BY(mu_);
  int watches_ ABSL_GUARDED_BY(mu_) = 0;
  // Watches per caller (AddressGroup), for kMaxWatchesPerCaller; callers
  // with none are not kept.
  absl::flat_hash_map<std::string, int> watches_of_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread notifier_;  // Started with the first watch.
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_METADATA_SERVICE_H_
