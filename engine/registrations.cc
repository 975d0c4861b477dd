// Registrations: the application's registrations (RegisterLocalMemory and
// UnregisterLocalMemory), all or nothing per batch, and the run's setup.
#include "engine/registrations.h"

#include <optional>
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
  MutexLock lock(&register_mu_);
  std::vector<descriptor::Buffer> published;
  absl::Status s;
  size_t attached = 0;
  for (; attached < regions.size(); ++attached) {
    descriptor::Buffer b;
    s = AttachLocked(regions[attached], &b);
    if (!s.ok()) {
      if (regions.size() > 1) {
        s = absl::Status(
            s.code(), absl::StrCat("buffer ", attached, " of ", regions.size(),
                                   ": ", s.message()));
      }
      break;
    }
    if (remote_accessible) published.push_back(std::move(b));
  }
  // One metadata round trip for the whole batch.
  if (s.ok()) s = publisher->AddBuffers(published);
  if (!s.ok()) {
    // All or nothing: a failed batch leaves nothing registered.
    for (size_t i = 0; i < attached; ++i) DetachLocked(regions[i].addr);
  }
  return s;
}

absl::Status Registrations::AttachLocked(const MemoryRegion& region,
                                         descriptor::Buffer* published) {
  // Checked first, so nothing is registered with a transport for a region
  // that cannot be added (register_mu_ keeps the check valid until Add).
  FERRY_RETURN_IF_ERROR(local_memory_.CheckAvailable(region));
  published->set_addr(region.addr);
  published->set_length(region.length);
  published->set_location(region.location);
  std::vector<const void*> handles;
  absl::Status s;
  for (auto& t : *transports_) {
    auto handle = t->RegisterMemory(region, published);
    if (!handle.ok()) {
      s = handle.status();
      break;
    }
    handles.push_back(*handle);
  }
  const size_t registered = handles.size();
  if (s.ok()) s = local_memory_.Add(region, std::move(handles));
  if (!s.ok()) {
    // Roll back so that a failed registration leaves nothing behind.
    for (size_t i = 0; i < registered; ++i) {
      (*transports_)[i]->UnregisterMemory(region.addr).IgnoreError();
    }
  }
  return s;
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
