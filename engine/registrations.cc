// Registrations: the application's registrations (RegisterLocalMemory and
// UnregisterLocalMemory), all or nothing per batch, and the run's setup.
#include "engine/registrations.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "metadata/validation.h"

namespace ferry {

void Registrations::Configure(size_t mr_cache_bytes, Clock* clock) {
  mr_cache_bytes_ = mr_cache_bytes;
  clock_ = clock;
  local_memory_.SetClock(clock);
}

void Registrations::Clear() { local_memory_.Clear(); }

Registrations::CacheStats Registrations::cache_stats() const {
  CacheStats st;
  {
    MutexLock lock(&cache_mu_);
    st.bytes = cache_bytes_;
    st.registrations = cache_.size();
  }
  st.invalidations = mr_cache_invalidations_.load();
  st.evictions = mr_cache_evictions_.load();
  return st;
}

absl::StatusOr<MemoryRegion> Registrations::MakeRegion(
    void* addr, size_t length, const std::string& location,
    bool remote_accessible) {
  MemoryRegion region;
  region.addr = reinterpret_cast<uintptr_t>(addr);
  region.length = length;
  region.location = location.empty() ? "*" : location;
  region.remote_accessible = remote_accessible;
  if (region.location.size() > descriptor::kMaxLocationBytes) {
    return absl::InvalidArgumentError("location is too long");
  }
  if (ValidateRegion(region.addr, region.length).ok()) {
    // GPU memory: its transports must not touch it with the CPU, and its
    // location names the GPU (Mooncake's automatic "cuda:N").
    FERRY_ASSIGN_OR_RETURN(const gpu::GpuAllocation gpu,
                           gpu::GpuAllocationOf(region.addr, region.length));
    FERRY_ASSIGN_OR_RETURN(region.location,
                           gpu::ResolveLocation(region.location, gpu.device));
    region.cuda_device = gpu.device;
    region.cuda_buffer_id = gpu.buffer_id;
  }
  // The application's own registration wins over cached ones that share
  // its pages (unless transfers use them).
  if (mr_cache_bytes_ > 0 && ValidateRegion(region.addr, region.length).ok()) {
    DropCachedOverlapping(region.addr, region.length);
  }
  return region;
}

namespace {

// "buffer 3 of 40: ..." for a batch, the status alone for one buffer.
absl::Status InBatch(const absl::Status& s, size_t i, size_t n) {
  if (s.ok() || n == 1) return s;
  return absl::Status(s.code(),
                      absl::StrCat("buffer ", i, " of ", n, ": ", s.message()));
}

// Threads that register one batch's buffers with the transports. Pinning
// is the cost of registering host memory (the kernel faults in and pins
// every page: bench/register_bench), and it runs in parallel on as many
// CPUs as take part; a batch under kParallelRegisterBytes is done before
// threads would start.
constexpr size_t kParallelRegisterBytes = size_t{256} << 20;
constexpr unsigned kMaxRegisterThreads = 8;

size_t RegisterThreads(const std::vector<MemoryRegion>& regions) {
  size_t bytes = 0;
  for (const MemoryRegion& r : regions) bytes += r.length;
  if (regions.size() < 2 || bytes < kParallelRegisterBytes) return 1;
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  return std::min<size_t>({regions.size(), cpus, kMaxRegisterThreads});
}

// Runs fn(0..n-1) on `threads` threads (this one among them), each taking
// the next index; fewer if a thread cannot start.
void ForEachIndex(size_t n, size_t threads,
                  const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < threads; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // Out of threads (a pids limit): the others do the rest.
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
}

}  // namespace

absl::Status Registrations::Register(const std::vector<BufferEntry>& buffers,
                                     const std::string& location,
                                     bool remote_accessible,
                                     SegmentPublisher* publisher) {
  std::vector<MemoryRegion> regions;
  regions.reserve(buffers.size());
  for (const BufferEntry& b : buffers) {
    FERRY_ASSIGN_OR_RETURN(
        MemoryRegion region,
        MakeRegion(b.addr, b.length, location, remote_accessible));
    regions.push_back(std::move(region));
  }
  const size_t n = regions.size();
  MutexLock lock(&register_mu_);
  // Checked first, so nothing is registered with a transport for a region
  // that cannot be added (register_mu_ keeps the checks valid until Add);
  // the batch's own buffers against each other too, since they reach the
  // transports at once.
  for (size_t i = 0; i < n; ++i) {
    FERRY_RETURN_IF_ERROR(
        InBatch(local_memory_.CheckAvailable(regions[i]), i, n));
  }
  if (n > 1) {
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return regions[a].addr < regions[b].addr;
    });
    // Of the neighbours (by address) that overlap, the pair whose later
    // buffer comes first in the batch: named by that later index.
    size_t first = n, other = n;
    for (size_t k = 1; k < n; ++k) {
      const MemoryRegion& lo = regions[order[k - 1]];
      const MemoryRegion& hi = regions[order[k]];
      const size_t later = std::max(order[k - 1], order[k]);
      if (hi.addr < lo.addr + lo.length && later < first) {
        first = later;
        other = std::min(order[k - 1], order[k]);
      }
    }
    if (first < n) {
      return absl::AlreadyExistsError(absl::StrCat(
          "buffer ", first, " of ", n, ": 0x", absl::Hex(regions[first].addr),
          "+", regions[first].length, " overlaps buffer ", other,
          " of the batch (0x", absl::Hex(regions[other].addr), "+",
          regions[other].length, ")"));
    }
  }
  std::vector<descriptor::Buffer> entries(n);
  std::vector<absl::StatusOr<std::vector<const void*>>> handles(n);
  ForEachIndex(n, RegisterThreads(regions), [&](size_t i) {
    handles[i] = RegisterWithTransports(regions[i], &entries[i]);
  });
  absl::Status s;
  size_t added = 0;
  for (; added < n && s.ok(); ++added) {
    s = InBatch(handles[added].status(), added, n);
    if (s.ok()) {
      // A copy: on failure the rollback below needs the handles' count.
      s = InBatch(local_memory_.Add(regions[added], *handles[added]), added, n);
    }
  }
  if (s.ok()) {
    // One metadata round trip for the whole batch.
    std::vector<descriptor::Buffer> published;
    if (remote_accessible) published = std::move(entries);
    s = publisher->AddBuffers(published);
    if (s.ok()) return s;
  } else {
    --added;  // The one that failed was not added.
  }
  // All or nothing: a failed batch leaves nothing registered.
  for (size_t i = 0; i < n; ++i) {
    if (i < added) {
      DetachLocked(regions[i].addr);
    } else if (handles[i].ok()) {
      for (size_t t = 0; t < handles[i]->size(); ++t) {
        (*transports_)[t]->UnregisterMemory(regions[i].addr).IgnoreError();
      }
    }
  }
  return s;
}

absl::StatusOr<std::vector<const void*>> Registrations::RegisterWithTransports(
    const MemoryRegion& region, descriptor::Buffer* published) {
  published->set_addr(region.addr);
  published->set_length(region.length);
  published->set_location(region.location);
  std::vector<const void*> handles;
  for (auto& t : *transports_) {
    auto handle = t->RegisterMemory(region, published);
    if (!handle.ok()) {
      // Roll back so that a failed registration leaves nothing behind.
      for (size_t i = 0; i < handles.size(); ++i) {
        (*transports_)[i]->UnregisterMemory(region.addr).IgnoreError();
      }
      return handle.status();
    }
    handles.push_back(*handle);
  }
  return handles;
}

void Registrations::DetachLocked(uintptr_t addr) {
  local_memory_.Remove(addr, absl::ZeroDuration()).IgnoreError();
  for (auto& t : *transports_) t->UnregisterMemory(addr).IgnoreError();
}

absl::Status Registrations::Unregister(const std::vector<void*>& addrs,
                                       absl::Duration wait,
                                       SegmentPublisher* publisher) {
  absl::Status result;
  std::vector<uint64_t> unpublish;
  std::vector<uintptr_t> forget;
  {
    MutexLock lock(&register_mu_);
    for (void* addr : addrs) {
      const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
      bool remote = false;
      absl::Status s = UnregisterLocked(a, wait, &remote);
      if (remote) unpublish.push_back(a);
      if (s.code() != absl::StatusCode::kNotFound &&
          s.code() != absl::StatusCode::kFailedPrecondition) {
        forget.push_back(a);
      }
      if (!s.ok() && result.ok()) {
        result = addrs.size() > 1
                     ? absl::Status(s.code(), absl::StrCat("0x", absl::Hex(a),
                                                           ": ", s.message()))
                     : s;
      }
    }
    // ...then stop advertising them: one metadata round trip.
    if (absl::Status s = publisher->RemoveBuffers(unpublish);
        !s.ok() && result.ok()) {
      result = absl::Status(s.code(),
                            absl::StrCat("buffers unregistered locally, but "
                                         "the metadata update failed: ",
                                         s.message()));
    }
  }
  for (uintptr_t a : forget) ForgetCached(a);  // Outside register_mu_.
  return result;
}

absl::Status Registrations::UnregisterLocked(uintptr_t a, absl::Duration wait,
                                             bool* unpublish) {
  *unpublish = false;
  std::optional<MemoryRegion> region = local_memory_.Lookup(a);
  if (!region.has_value()) {
    return absl::NotFoundError(
        absl::StrCat("no registered buffer starts at 0x", absl::Hex(a)));
  }
  // First stop this engine's own use (waits for its in-flight requests)...
  FERRY_RETURN_IF_ERROR(local_memory_.Remove(a, wait));
  // ...then peers' (each transport waits for accesses in progress)...
  absl::Status result;
  for (auto& t : *transports_) {
    absl::Status s = t->UnregisterMemory(a);
    if (!s.ok() && result.ok()) result = s;
  }
  // ...and the caller stops advertising it.
  *unpublish = region->remote_accessible;
  return result;
}

}  // namespace ferry
