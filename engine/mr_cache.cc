// Registrations: the opt-in MR cache.
//
// A request whose local source is mapped but unregistered gets a
// page-aligned cover of it registered on first use. The rules that keep
// that safe and fast:
//   - a cached registration is dropped as soon as the memory behind it is
//     released or replaced (memory_hooks.h): a NIC must never be handed a
//     registration that pins pages the address no longer maps. A release
//     that comes while a registration is being made invalidates that one
//     too, and a release is acknowledged to the hooks only once the
//     registrations it hits are retired, so no thread can lease one in
//     between;
//   - registering takes no lock across the transports' RegisterMemory
//     (ibv_reg_mr pins and maps pages, and may take milliseconds): the
//     range is reserved in the registry first, so concurrent misses on
//     other ranges proceed in parallel and misses on the same range wait
//     for the one registration;
//   - a retired registration keeps its range in the registry until the
//     transports unregistered it, so nothing new is registered over it
//     before that;
//   - least recently used registrations beyond mr_cache_bytes are dropped,
//     never one a transfer is using;
//   - GPU memory is cached as the driver's whole allocation. No hook sees
//     cuMemFree, so each use checks the allocation's id against the
//     driver's (one query), and each miss drops the registrations of
//     allocations freed since: a NIC never writes where a freed allocation
//     was, and a freed one holds device memory only until the next miss.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/registrations.h"
#include "gpu/gpu_memory.h"

namespace ferry {
namespace {

// A miss that finds its range being registered by another thread waits
// this long for it; a miss retries this often before giving up.
constexpr absl::Duration kReservationWait = absl::Seconds(5);
constexpr int kMissAttempts = 4;

bool Overlaps(uintptr_t a, size_t a_len, uintptr_t b, size_t b_len) {
  return a < b + b_len && b < a + a_len;
}

}  // namespace

absl::Status Registrations::StartCache() {
  if (mr_cache_bytes_ == 0) return absl::OkStatus();
  if (absl::Status s = InstallMemoryHooks(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mr_cache_bytes > 0 needs memory hooks, which cannot be installed "
        "here (",
        s.message(), "); register memory with RegisterLocalMemory instead"));
  }
  if (watcher_ == nullptr) watcher_ = MemoryWatcher::Acquire();
  if (watcher_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "mr_cache_bytes > 0: ", MemoryWatcher::kMaxWatchers,
        " engines of this process use the MR cache already (the most the "
        "memory hooks serve); set mr_cache_bytes = 0 here and register "
        "memory with RegisterLocalMemory"));
  }
  return absl::OkStatus();
}

void Registrations::StopCache() {
  {
    MutexLock lock(&cache_mu_);
    cache_.clear();
    cache_bytes_ = 0;
    retired_.clear();
    retired_count_.store(0);
  }
  MemoryWatcher::Release(watcher_);
  watcher_ = nullptr;
}

void Registrations::UnregisterCached(uintptr_t addr) {
  for (auto& t : *transports_) t->UnregisterMemory(addr).IgnoreError();
  local_memory_.EraseRetired(addr);
}

absl::Status Registrations::CheckGpuLease(const MemoryRegistry::Lease& lease,
                                          uintptr_t addr, size_t length) {
  const MemoryRegion& r = lease.region();
  if (r.cuda_device < 0) return absl::OkStatus();
  absl::Status s =
      gpu::CheckGpuAllocation(addr, r.cuda_device, r.cuda_buffer_id);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("local source 0x", absl::Hex(addr),
                                             "+", length, ": ", s.message()));
}

absl::Status Registrations::KeepIfLive(
    absl::StatusOr<MemoryRegistry::Lease>* lease, uintptr_t addr,
    size_t length) {
  // No hook sees cuMemFree: a GPU registration is checked against the
  // driver at each use instead.
  absl::Status live = CheckGpuLease(**lease, addr, length);
  const uintptr_t base = (*lease)->region().addr;
  const uint64_t id = (*lease)->region().cuda_buffer_id;
  {
    MutexLock lock(&cache_mu_);
    auto it = cache_.find(base);
    if (live.ok()) {
      if (it != cache_.end()) it->second.last_use = ++cache_clock_;
      return absl::OkStatus();
    }
    const bool cached = it != cache_.end() && it->second.device >= 0 &&
                        it->second.buffer_id == id;
    // Retired by another thread that saw the same (it stays in retired_
    // while this lease holds it): a miss here too.
    const bool retired =
        std::find(retired_.begin(), retired_.end(), base) != retired_.end();
    // The application's own registration of a freed allocation is its
    // error to see.
    if (!cached && !retired) return live;
    *lease = live;  // Gives the lease back before it is retired.
    if (cached) {
      RetireCachedLocked(it);
      mr_cache_invalidations_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  ProcessReleases();
  return absl::OkStatus();
}

absl::StatusOr<MemoryRegistry::Lease> Registrations::AcquireLocal(
    uintptr_t addr, size_t length) {
  if (mr_cache_bytes_ == 0) {
    auto lease = local_memory_.Acquire(addr, length, /*need_remote=*/false);
    if (!lease.ok()) return lease;
    FERRY_RETURN_IF_ERROR(CheckGpuLease(*lease, addr, length));
    return lease;
  }
  // Before any lookup: a registration whose memory went away must not
  // serve this request.
  if (watcher_->MaybePending() ||
      retired_count_.load(std::memory_order_acquire) > 0) {
    ProcessReleases();
  }
  auto lease = local_memory_.Acquire(addr, length, /*need_remote=*/false);
  if (lease.ok()) {
    absl::Status s = KeepIfLive(&lease, addr, length);
    if (!s.ok()) return s;
    if (lease.ok()) return lease;
  }
  if (addr + length < addr) return lease;
  return RegisterMiss(addr, length);
}

absl::StatusOr<Registrations::Cover> Registrations::CoverOf(uintptr_t addr,
                                                            size_t length) {
  // GPU memory is cached as the driver's whole allocation (its id checked
  // at each use); host memory as a page-aligned cover, watched by the
  // memory hooks.
  Cover cover;
  FERRY_ASSIGN_OR_RETURN(cover.gpu, gpu::GpuAllocationOf(addr, length));
  cover.start = cover.gpu.start;
  cover.end = cover.gpu.start + cover.gpu.size;
  if (cover.gpu.device < 0) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    cover.start = addr & ~(page - 1);
    cover.end = (addr + length + page - 1) & ~(page - 1);
    // Registering unmapped memory would fault later (or, on a NIC, fail to
    // pin): msync reports ENOMEM for any unmapped page in the range.
    if (::msync(reinterpret_cast<void*>(cover.start), cover.end - cover.start,
                MS_ASYNC) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "local source 0x", absl::Hex(addr), "+", length,
          " is not mapped memory, so the MR cache cannot register it"));
    }
  }
  return cover;
}

absl::StatusOr<MemoryRegistry::Lease> Registrations::RegisterMiss(
    uintptr_t addr, size_t length) {
  FERRY_ASSIGN_OR_RETURN(const Cover cover, CoverOf(addr, length));
  // A miss is when an application that freed GPU memory has allocated
  // more: what it freed stops holding device memory (through the NICs'
  // registrations) from here.
  DropFreedGpu();
  absl::Status last;
  for (int attempt = 0; attempt < kMissAttempts; ++attempt) {
    const MemoryRegion region = MergeCached(cover);
    // Known as being registered, and watched, before anything is pinned:
    // a release from now on invalidates it (ProcessReleases).
    {
      MutexLock lock(&cache_mu_);
      registering_.push_back({region.addr, region.length, false});
    }
    watcher_->Watch(region.addr, region.length);
    bool again = false;
    absl::Status reserved = local_memory_.Reserve(region);
    absl::StatusOr<MemoryRegistry::Lease> lease =
        reserved.ok() ? RegisterReserved(region, addr, length, &again)
                      : AwaitOtherRegistration(region, cover, addr, length,
                                               reserved, &again);
    if (!again) return lease;
    last = lease.status();
  }
  return absl::Status(
      last.code(),
      absl::StrCat("MR cache: cannot register local source 0x", absl::Hex(addr),
                   "+", length, ": ", last.message()));
}

MemoryRegion Registrations::MergeCached(const Cover& cover) {
  const bool on_gpu = cover.gpu.device >= 0;
  // Cached registrations sharing pages with the cover (neighbouring
  // allocations often do) are merged into it: registered buffers may not
  // overlap, and a request must lie inside one. A cached registration
  // overlapping a live GPU allocation, but not of it, is of a freed one:
  // it goes, and the cover stays the allocation.
  uintptr_t lo = cover.start, hi = cover.end;
  std::vector<uintptr_t> merged;
  {
    MutexLock lock(&cache_mu_);
    for (bool grew = true; grew;) {
      grew = false;
      for (const auto& [a, c] : cache_) {
        if (a < hi && a + c.length > lo &&
            std::find(merged.begin(), merged.end(), a) == merged.end()) {
          // This very allocation, registered by another thread since
          // this one missed: it serves the request (the reservation
          // below fails, and the retry leases it).
          if (on_gpu && c.device >= 0 && c.buffer_id == cover.gpu.buffer_id) {
            continue;
          }
          merged.push_back(a);
          if (on_gpu) continue;
          lo = std::min(lo, a);
          hi = std::max(hi, a + c.length);
          grew = true;
        }
      }
    }
  }
  bool busy = false;
  for (uintptr_t a : merged) {
    if (DropCached(a)) continue;
    // In use (often by the transfer the application just saw complete:
    // its lease goes a moment later, on the completing thread). Retired
    // instead: it takes no new lease, and the reservation below waits
    // for its last one, as for any retired registration.
    MutexLock lock(&cache_mu_);
    auto it = cache_.find(a);
    if (it != cache_.end()) RetireCachedLocked(it);
    busy = true;
  }
  if (busy) ProcessReleases();  // Finishes those that went idle meanwhile.
  MemoryRegion region;
  region.addr = lo;
  region.length = hi - lo;
  region.location = on_gpu ? absl::StrCat("cuda:", cover.gpu.device) : "*";
  region.remote_accessible = false;
  region.cuda_device = cover.gpu.device;
  region.cuda_buffer_id = cover.gpu.buffer_id;
  return region;
}

absl::StatusOr<MemoryRegistry::Lease> Registrations::AwaitOtherRegistration(
    const MemoryRegion& region, const Cover& cover, uintptr_t addr,
    size_t length, const absl::Status& reserved, bool* again) {
  {
    MutexLock lock(&cache_mu_);
    ForgetRegistering(region.addr);
  }
  // Another thread is registering (part of) it, a registration over
  // it was retired and its last transfer is ending (its completion
  // releases the lease a moment after the application saw it), or a
  // registered buffer overlaps: wait for the first two, finish what
  // retired, then look again.
  local_memory_.AwaitReservations(cover.start, cover.end - cover.start,
                                  clock_->Now() + kReservationWait);
  if (retired_count_.load(std::memory_order_acquire) > 0) {
    ProcessReleases();
  }
  auto lease = local_memory_.Acquire(addr, length, /*need_remote=*/false);
  if (lease.ok()) {
    FERRY_RETURN_IF_ERROR(KeepIfLive(&lease, addr, length));
    if (lease.ok()) return lease;
  }
  *again = true;
  return reserved;
}

absl::StatusOr<MemoryRegistry::Lease> Registrations::RegisterReserved(
    const MemoryRegion& region, uintptr_t addr, size_t length, bool* again) {
  const uintptr_t lo = region.addr;
  // The slow part, with no lock held.
  std::vector<const void*> handles;
  absl::Status s;
  for (auto& t : *transports_) {
    descriptor::Buffer unpublished;
    auto handle = t->RegisterMemory(region, &unpublished);
    if (!handle.ok()) {
      s = handle.status();
      break;
    }
    handles.push_back(*handle);
  }
  const size_t registered = handles.size();
  // A release recorded while it registered (and not yet processed by
  // another thread) must invalidate it before it serves this request.
  if (s.ok() && watcher_->MaybePending()) ProcessReleases();
  bool invalidated = false;
  absl::StatusOr<MemoryRegistry::Lease> lease;
  if (s.ok()) {
    MutexLock lock(&cache_mu_);
    invalidated = ForgetRegistering(lo);
    if (!invalidated) {
      // Usable and leased in one step, and cached under the same lock
      // the release processing takes: nothing can drop it in between.
      lease = local_memory_.ActivateAndAcquire(lo, std::move(handles), addr,
                                               length);
      cache_[lo] = CachedMr{region.length, ++cache_clock_, region.cuda_device,
                            region.cuda_buffer_id};
      cache_bytes_ += region.length;
    }
  } else {
    MutexLock lock(&cache_mu_);
    ForgetRegistering(lo);
  }
  if (!s.ok() || invalidated) {
    // Nothing else can register over the reservation meanwhile.
    for (size_t i = 0; i < registered; ++i) {
      (*transports_)[i]->UnregisterMemory(lo).IgnoreError();
    }
    local_memory_.CancelReservation(lo);
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("MR cache: cannot register 0x", absl::Hex(lo),
                                 "+", region.length, ": ", s.message()));
    }
    // Released while it was being registered: the pages it pinned may
    // not be the ones mapped now. Register again.
    mr_cache_invalidations_.fetch_add(1, std::memory_order_relaxed);
    *again = true;
    return absl::UnavailableError(
        "the memory was released while it was being registered");
  }
  EvictCached(lo);
  return lease;
}

bool Registrations::ForgetRegistering(uintptr_t lo) {
  cache_mu_.AssertHeld();
  for (auto it = registering_.begin(); it != registering_.end(); ++it) {
    if (it->addr == lo) {
      const bool invalidated = it->invalidated;
      registering_.erase(it);
      return invalidated;
    }
  }
  return false;
}

std::map<uintptr_t, Registrations::CachedMr>::iterator
Registrations::RetireCachedLocked(std::map<uintptr_t, CachedMr>::iterator it) {
  // Retired before the lock is released: from here on no request can
  // lease it, whatever thread it runs on.
  local_memory_.Retire(it->first).IgnoreError();
  retired_.push_back(it->first);
  retired_count_.store(retired_.size(), std::memory_order_release);
  cache_bytes_ -= it->second.length;
  return cache_.erase(it);
}

bool Registrations::DropCached(uintptr_t addr) {
  if (!local_memory_.RetireIfIdle(addr)) return false;
  ForgetCached(addr);
  UnregisterCached(addr);
  return true;
}

void Registrations::ProcessReleases() {
  std::vector<MemoryWatcher::Range> ranges;
  std::vector<uintptr_t> idle;
  {
    MutexLock lock(&cache_mu_);
    bool everything = false;
    const uint64_t token = watcher_->Drain(&ranges, &everything);
    auto hit = [&](uintptr_t a, size_t len) {
      if (everything) return true;
      for (const auto& r : ranges) {
        if (Overlaps(a, len, r.addr, r.length)) return true;
      }
      return false;
    };
    for (auto it = cache_.begin(); it != cache_.end();) {
      if (!hit(it->first, it->second.length)) {
        ++it;
        continue;
      }
      it = RetireCachedLocked(it);
      mr_cache_invalidations_.fetch_add(1, std::memory_order_relaxed);
    }
    for (Registering& r : registering_) {
      if (hit(r.addr, r.length)) r.invalidated = true;
    }
    for (auto it = retired_.begin(); it != retired_.end();) {
      if (local_memory_.RetiredAndIdle(*it)) {
        idle.push_back(*it);
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
    retired_count_.store(retired_.size(), std::memory_order_release);
    watcher_->Acknowledge(token);
  }
  // Their ranges stay reserved in the registry until this is done.
  for (uintptr_t a : idle) UnregisterCached(a);
}

void Registrations::DropFreedGpu() {
  struct Gpu {
    uintptr_t addr;
    int device;
    uint64_t buffer_id;
  };
  std::vector<Gpu> cached;
  {
    MutexLock lock(&cache_mu_);
    for (const auto& [a, c] : cache_) {
      if (c.device >= 0) cached.push_back({a, c.device, c.buffer_id});
    }
  }
  if (cached.empty()) return;
  bool dropped = false;
  for (const Gpu& g : cached) {
    // Asked with no lock held: a driver call may take a while.
    if (gpu::CheckGpuAllocation(g.addr, g.device, g.buffer_id).ok()) {
      continue;
    }
    MutexLock lock(&cache_mu_);
    auto it = cache_.find(g.addr);
    if (it == cache_.end() || it->second.buffer_id != g.buffer_id) continue;
    RetireCachedLocked(it);
    mr_cache_invalidations_.fetch_add(1, std::memory_order_relaxed);
    dropped = true;
  }
  if (dropped) ProcessReleases();
}

void Registrations::EvictCached(uintptr_t keep) {
  std::vector<std::pair<uint64_t, uintptr_t>> victims;
  size_t over = 0;
  {
    MutexLock lock(&cache_mu_);
    if (cache_bytes_ <= mr_cache_bytes_) return;
    over = cache_bytes_ - mr_cache_bytes_;
    for (const auto& [a, c] : cache_) {
      if (a != keep) victims.emplace_back(c.last_use, a);
    }
  }
  std::sort(victims.begin(), victims.end());  // Least recently used first.
  size_t freed = 0;
  for (const auto& [use, a] : victims) {
    if (freed >= over) break;
    size_t length = 0;
    {
      MutexLock lock(&cache_mu_);
      auto it = cache_.find(a);
      if (it == cache_.end()) continue;
      length = it->second.length;
    }
    // Never pulled from under a transfer: one in use is skipped.
    if (DropCached(a)) {
      freed += length;
      mr_cache_evictions_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

void Registrations::DropCachedOverlapping(uintptr_t addr, size_t length) {
  std::vector<uintptr_t> overlapping;
  {
    MutexLock lock(&cache_mu_);
    for (const auto& [a, c] : cache_) {
      if (Overlaps(a, c.length, addr, length)) overlapping.push_back(a);
    }
  }
  for (uintptr_t a : overlapping) DropCached(a);
}

void Registrations::ForgetCached(uintptr_t addr) {
  MutexLock lock(&cache_mu_);
  auto it = cache_.find(addr);
  if (it == cache_.end()) return;
  cache_bytes_ -= it->second.length;
  cache_.erase(it);
}

}  // namespace ferry
