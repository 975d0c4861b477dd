// SegmentCache: segment handles, the cached descriptors behind them, and
// the background refresher that keeps them current without the submit
// path ever waiting on the network. Two threads: a refresher that decides
// what to fetch and hands back parked requests (also when their deadline
// passes), and a fetcher that does the RPCs.
//
// A handle is (engine tag << 48) | (generation << 20) | (slot + 1): handles
// of another engine, of a closed segment or made-up values are rejected,
// and slots of closed segments are reused (oldest first), so opening and
// closing peers in turn keeps the table flat.
//
// A request whose target range is not in the cached descriptor (the peer
// may have registered the buffer since), or whose descriptor is marked
// stale (a request to the segment failed: it may have unregistered, moved
// or restarted), is parked: it waits, in state kWaiting, for a descriptor
// fetched after it was parked. One thread fetches, each segment at most
// once per kMinRefreshInterval, each fetch bounded by the RPC timeout;
// parked requests whose deadline passes meanwhile are handed back expired.
//
// Rate limits and deadlines run on the cache's Clock.
//
// Thread-safe. The ready callback runs on the refresher thread (or on the
// thread calling Close/Stop) with no lock of the cache held.
#ifndef FERRY_ENGINE_SEGMENT_CACHE_H_
#define FERRY_ENGINE_SEGMENT_CACHE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "ferry/transfer_engine.h"
#include "metadata/store.h"
#include "transport/segment_view.h"

namespace ferry {

struct Task;

class SegmentCache {
 public:
  // A segment whose requests keep failing is fetched again at most this
  // often, however many failures or misses ask for it.
  static constexpr absl::Duration kMinRefreshInterval = absl::Milliseconds(100);
  // Segments open at once; OpenSegment beyond it fails ResourceExhausted.
  static constexpr size_t kMaxSegments = (size_t{1} << 20) - 1;

  // What a parked task gets: the freshest descriptor (the one just
  // fetched, or the cached one if the fetch failed), and how the fetch
  // went (DeadlineExceeded if the task's deadline passed first, Cancelled
  // if the cache stopped, FailedPrecondition if the segment was closed).
  using ReadyFn =
      std::function<void(Task* task, std::shared_ptr<const SegmentView> view,
                         const absl::Status& fetch)>;

  // `client` and `clock` (null: the system clock) must outlive the cache.
  // `tag` distinguishes engines' handles.
  SegmentCache(metadata::Store* client, uint16_t tag, ReadyFn ready,
               Clock* clock = RealClock());
  // Stops the refresher (Stop()).
  ~SegmentCache();
  SegmentCache(const SegmentCache&) = delete;
  SegmentCache& operator=(const SegmentCache&) = delete;

  // Starts the refresher thread. Call once.
  absl::Status Start();
  // Stops the refresher; parked tasks get Cancelled. Idempotent.
  void Stop();

  // Returns the cached handle of `name`, fetching the descriptor the first
  // time (blocks on the metadata service; not for the data path). NotFound
  // if the segment is not registered, InvalidArgument if its descriptor is
  // invalid (nothing is cached then).
  absl::StatusOr<SegmentHandle> Open(const std::string& name);

  // Forgets the segment: the handle becomes invalid (a later Open of the
  // name gets a new one), parked tasks get FailedPrecondition. Returns the
  // last snapshot, for the transports to release what they hold for it.
  absl::StatusOr<std::shared_ptr<const SegmentView>> Close(
      SegmentHandle handle);

  struct Snapshot {
    std::shared_ptr<const SegmentView> view;
    // False while the descriptor is marked stale: requests should wait for
    // the refresh that is on its way (Park).
    bool fresh = true;
  };
  // The current snapshot, or NotFound for an invalid handle. Never blocks
  // on the network.
  absl::StatusOr<Snapshot> Get(SegmentHandle handle);

  // Parks `task` until a descriptor fetched after this call arrives (or
  // `deadline` passes), then hands it to the ready callback. NotFound for
  // an invalid handle (the task is not parked then).
  absl::Status Park(SegmentHandle handle, Task* task, absl::Time deadline);

  // Marks the snapshot as possibly out of date and queues a refresh.
  // Cheap; safe from any thread, including completion threads.
  void MarkStale(SegmentHandle handle);

  // Fetches the descriptor now (blocking; for RefreshSegment) and returns
  // the new snapshot.
  absl::StatusOr<std::shared_ptr<const SegmentView>> Refresh(
      SegmentHandle handle);

  struct Stats {
    uint64_t open = 0;
    uint64_t refreshes = 0;  // Background fetches.
    uint64_t refresh_failures = 0;
    uint64_t parked_now = 0;
    uint64_t parked_total = 0;
    uint64_t pushes = 0;  // Changes pushed by the metadata service.
  };
  Stats stats() const;

 private:
  struct Parked {
    Task* task;
    absl::Time deadline;
    uint64_t after;  // Fetches of the entry started before it was parked.
  };
  struct Entry {
    std::string name;
    std::shared_ptr<const SegmentView> view;
    uint32_t generation = 1;
    bool in_use = false;
    bool stale = false;
    bool queued = false;  // In refresh_queue_.
    uint64_t fetches_started = 0;
    absl::Time last_fetch = absl::InfinitePast();
    std::vector<Parked> parked;
  };
  struct Delivery {
    Task* task;
    std::shared_ptr<const SegmentView> view;
    absl::Status status;
  };

  absl::StatusOr<size_t> SlotOf(SegmentHandle handle) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SegmentHandle HandleOf(size_t slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueLocked(size_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<const SegmentView>> Fetch(
      const std::string& name);
  // Validates a descriptor (fetched or pushed) into a view.
  static absl::StatusOr<std::shared_ptr<const SegmentView>> MakeView(
      descriptor::SegmentDescriptor desc);
  // Watches an opened segment, if the store can push.
  void StartWatchLocked(const std::string& name,
                        std::shared_ptr<const SegmentView> view)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A watch stream's copy of the descriptor, which its deltas apply to.
  // `broken` once a pushed change was refused: later deltas would apply
  // to a base the service no longer has, so they are ignored until a
  // whole descriptor comes (the segment is served by refreshes meanwhile).
  struct WatchBase {
    descriptor::SegmentDescriptor descriptor;
    bool broken = false;
  };
  // Builds the descriptor a pushed change gives, checks that it names the
  // watched segment and is valid, and only then makes it the stream's base
  // and installs it; a refused change leaves the base untouched, marks it
  // broken and the cached view stale.
  void OnEvent(const std::string& name, WatchBase* base,
               const metadata::SegmentEvent& ev) ABSL_LOCKS_EXCLUDED(mu_);
  // The cached view of `name` goes stale (a refresh is queued).
  void MarkStale(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps the newer of the cached and the fetched snapshot.
  void InstallLocked(Entry* e, std::shared_ptr<const SegmentView> view)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefresherLoop();
  // Runs the fetches the refresher hands it, one at a time, so that the
  // refresher keeps expiring parked requests while a fetch is stuck.
  void FetcherLoop();
  // Installs a finished fetch and moves the tasks it serves into *out.
  void FinishFetchLocked(std::vector<Delivery>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves parked tasks past their deadline into *out.
  void ExpireLocked(absl::Time now, std::vector<Delivery>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Deliver(std::vector<Delivery>* deliveries);

  metadata::Store* const client_;
  Clock* const clock_;
  const uint16_t tag_;
  const ReadyFn ready_;

  mutable Mutex mu_;
  CondVar wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, SegmentHandle> by_name_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::deque<size_t> free_slots_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> refresh_queue_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
  // The watch of each open segment whose store can push, by name.
  absl::flat_hash_map<std::string, std::unique_ptr<metadata::Watch>> watches_
      ABSL_GUARDED_BY(mu_);

  struct FetchJob {
    size_t slot = 0;
    uint32_t generation = 0;
    std::string name;
    uint64_t fetch = 0;  // Entry::fetches_started when it began.
  };
  bool fetching_ ABSL_GUARDED_BY(mu_) = false;   // A job is out.
  bool job_ready_ ABSL_GUARDED_BY(mu_) = false;  // For the fetcher.
  bool job_done_ ABSL_GUARDED_BY(mu_) = false;   // For the refresher.
  FetchJob job_ ABSL_GUARDED_BY(mu_);
  absl::StatusOr<std::shared_ptr<const SegmentView>> job_result_
      ABSL_GUARDED_BY(mu_);
  CondVar job_cv_;

  std::thread refresher_;
  std::thread fetcher_;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_SEGMENT_CACHE_H_
