// Registrations: this engine's registered local memory. The buffers the
// application registers (RegisterLocalMemory, registrations.cc) and, when
// mr_cache_bytes > 0, the MR cache's own registrations of memory that
// requests name unregistered (mr_cache.cc), each kept in step across the
// local registry, every transport and the published segment.
//
// Thread-safety: every call may run concurrently with the others, except
// the lifecycle calls (Configure, StartCache, StopCache, Clear), which run
// alone. register_mu_ serializes the application's registrations, so that
// the registry, the transports and the published descriptor change
// together; cache_mu_ guards the cache's bookkeeping and is never held
// across a transport call or a driver query. The two are never held
// together.
#ifndef FERRY_ENGINE_REGISTRATIONS_H_
#define FERRY_ENGINE_REGISTRATIONS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "engine/memory_hooks.h"
#include "engine/segment_publisher.h"
#include "ferry/transfer_engine.h"
#include "gpu/gpu_memory.h"
#include "metadata/proto/metadata.pb.h"
#include "transport/memory_registry.h"
#include "transport/transport.h"

namespace ferry {

class Registrations {
 public:
  // Registers with each of `transports` (the engine's, installed and
  // removed by it while no registration call runs); it must outlive this.
  explicit Registrations(
      const std::vector<std::unique_ptr<Transport>>* transports)
      : transports_(transports) {}
  // Gives the cache's watcher back.
  ~Registrations() { StopCache(); }
  Registrations(const Registrations&) = delete;
  Registrations& operator=(const Registrations&) = delete;

  // This run's cache budget (0: no MR cache) and the clock of the bounded
  // waits (unregistering under a transfer, a miss waiting for another's
  // registration).
  void Configure(size_t mr_cache_bytes, Clock* clock);
  // Installs the memory hooks the cache needs (when it is on).
  absl::Status StartCache();
  // Drops the cache's state and gives its watcher back.
  void StopCache();
  // Forgets every registration (no lease may be held): the transports that
  // hold their handles are going.
  void Clear();

  // Registers `buffers` locally and with every transport, and adds the
  // remote-accessible ones to `publisher`'s segment in one update. All or
  // nothing: a failed batch leaves nothing registered.
  absl::Status Register(const std::vector<BufferEntry>& buffers,
                        const std::string& location, bool remote_accessible,
                        SegmentPublisher* publisher);
  // Unregisters each of `addrs` (waiting up to `wait` for transfers using
  // it) and removes them from `publisher`'s segment in one update; the
  // first error, naming its buffer when there are several.
  absl::Status Unregister(const std::vector<void*>& addrs, absl::Duration wait,
                          SegmentPublisher* publisher);

  // MR cache (mr_cache.cc): leases the local range, registering a
  // page-aligned cover of it (GPU memory: its whole allocation) first when
  // the cache is on and the range is mapped but unregistered; evicts least
  // recently used cached registrations beyond the budget. A range in GPU
  // memory whose allocation was freed under its registration is an error
  // (FailedPrecondition), or, cached, a miss.
  absl::StatusOr<MemoryRegistry::Lease> AcquireLocal(uintptr_t addr,
                                                     size_t length);

  struct CacheStats {
    size_t bytes = 0;
    size_t registrations = 0;
    uint64_t invalidations = 0;
    uint64_t evictions = 0;
  };
  CacheStats cache_stats() const;

 private:
  struct CachedMr {
    size_t length;
    uint64_t last_use;
    int device = -1;         // GPU memory's device, -1 for host memory.
    uint64_t buffer_id = 0;  // GPU memory's allocation (gpu_memory.h).
  };
  // Registrations being made (reserved, not yet cached).
  struct Registering {
    uintptr_t addr;
    size_t length;
    bool invalidated;  // A release hit it meanwhile.
  };
  // What a miss registers: GPU memory's whole allocation, or a page-aligned
  // cover of host memory, [start, end).
  struct Cover {
    gpu::GpuAllocation gpu;
    uintptr_t start = 0;
    uintptr_t end = 0;
  };

  // The region of a registration request (validated; cached overlapping
  // registrations dropped).
  absl::StatusOr<MemoryRegion> MakeRegion(void* addr, size_t length,
                                          const std::string& location,
                                          bool remote_accessible);
  // Registers `region` with every transport (the slow part: pinning) and
  // fills the entry to publish; the transports' handles, in their order.
  // Nothing is left behind on failure. Runs on several threads at once
  // for one batch (transports register concurrently), under no lock.
  absl::StatusOr<std::vector<const void*>> RegisterWithTransports(
      const MemoryRegion& region, descriptor::Buffer* published);
  // Undoes a registration added to the registry in Register (nothing can
  // use the region yet).
  void DetachLocked(uintptr_t addr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(register_mu_);
  // Unregisters locally and from the transports; *unpublish says whether
  // the caller must remove it from the published segment.
  absl::Status UnregisterLocked(uintptr_t addr, absl::Duration wait,
                                bool* unpublish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(register_mu_);

  // A miss: registers a cover of the range and leases the range in it.
  absl::StatusOr<MemoryRegistry::Lease> RegisterMiss(uintptr_t addr,
                                                     size_t length);
  // The cover a miss on [addr, addr + length) registers; InvalidArgument
  // if host memory in it is not mapped.
  static absl::StatusOr<Cover> CoverOf(uintptr_t addr, size_t length);
  // The region to register for `cover`: merged with the cached
  // registrations it shares pages with, which are dropped (retired if in
  // use).
  MemoryRegion MergeCached(const Cover& cover);
  // Two ends of one try at registering the region a miss reserved (or
  // failed to reserve): a lease, an error to return, or, with *again, why
  // another try is needed.
  absl::StatusOr<MemoryRegistry::Lease> AwaitOtherRegistration(
      const MemoryRegion& region, const Cover& cover, uintptr_t addr,
      size_t length, const absl::Status& reserved, bool* again);
  absl::StatusOr<MemoryRegistry::Lease> RegisterReserved(
      const MemoryRegion& region, uintptr_t addr, size_t length, bool* again);
  // Unregisters a retired cached registration from the transports, then
  // gives its range back.
  void UnregisterCached(uintptr_t addr);
  // Ends the record of a registration in progress at `lo`; true if a
  // release invalidated it meanwhile.
  bool ForgetRegistering(uintptr_t lo) ABSL_EXCLUSIVE_LOCKS_REQUIRED(cache_mu_);
  // Unregisters the cached registration at `addr` if no transfer uses it
  // (ProcessReleases retires busy ones itself). True if it is gone now.
  bool DropCached(uintptr_t addr);
  // Drops cached registrations whose memory was released or replaced
  // (as the memory hooks saw), and finishes retired ones.
  void ProcessReleases();
  void DropCachedOverlapping(uintptr_t addr, size_t length);
  void EvictCached(uintptr_t keep);
  // For a lease the cache found: OK with *lease kept if it may serve the
  // request; OK with *lease an error (released) if it was the cache's
  // registration of a freed GPU allocation, now retired (a miss); the
  // error if it is the application's registration of one.
  absl::Status KeepIfLive(absl::StatusOr<MemoryRegistry::Lease>* lease,
                          uintptr_t addr, size_t length);
  // Retires cached registrations of GPU allocations freed since they were
  // made (no memory hook sees cuMemFree).
  void DropFreedGpu();
  // OK unless the lease is of GPU memory whose allocation was freed: the
  // registration then names memory that is gone or another allocation's.
  static absl::Status CheckGpuLease(const MemoryRegistry::Lease& lease,
                                    uintptr_t addr, size_t length);
  void ForgetCached(uintptr_t addr);
  // Takes a cached registration out of the cache and retires it (no new
  // lease); ProcessReleases unregisters it once its leases are gone.
  std::map<uintptr_t, CachedMr>::iterator RetireCachedLocked(
      std::map<uintptr_t, CachedMr>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(cache_mu_);

  const std::vector<std::unique_ptr<Transport>>* const transports_;
  // Set by Configure, before any other call of the run: read without a
  // lock.
  size_t mr_cache_bytes_ = 0;
  Clock* clock_ = RealClock();

  MemoryRegistry local_memory_;
  // Serializes registration so local registry, transports and the published
  // descriptor change together.
  Mutex register_mu_;

  mutable Mutex cache_mu_;
  std::map<uintptr_t, CachedMr> cache_ ABSL_GUARDED_BY(cache_mu_);
  size_t cache_bytes_ ABSL_GUARDED_BY(cache_mu_) = 0;
  uint64_t cache_clock_ ABSL_GUARDED_BY(cache_mu_) = 0;
  // Released (or evicted) but still leased: unregistered once idle.
  std::vector<uintptr_t> retired_ ABSL_GUARDED_BY(cache_mu_);
  std::atomic<size_t> retired_count_{0};
  std::vector<Registering> registering_ ABSL_GUARDED_BY(cache_mu_);
  std::atomic<uint64_t> mr_cache_invalidations_{0};
  std::atomic<uint64_t> mr_cache_evictions_{0};
  MemoryWatcher* watcher_ = nullptr;  // From the pool; while the cache is on.
};

}  // namespace ferry

#endif  // FERRY_ENGINE_REGISTRATIONS_H_
