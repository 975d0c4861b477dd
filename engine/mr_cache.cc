// EngineImpl: the opt-in MR cache.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"

namespace ferry {

absl::StatusOr<MemoryRegistry::Lease> EngineImpl::AcquireLocal(uintptr_t addr,
                                                               size_t length) {
  auto lease = local_memory_.Acquire(addr, length, /*need_remote=*/false);
  if (options_.mr_cache_bytes == 0) return lease;
  if (lease.ok()) {
    MutexLock lock(&cache_mu_);
    auto it = cache_.find(lease->region().addr);
    if (it != cache_.end()) it->second.last_use = ++cache_clock_;
    return lease;
  }
  if (addr + length < addr) return lease;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = addr & ~(page - 1);
  const uintptr_t end = (addr + length + page - 1) & ~(page - 1);
  // Registering unmapped memory would fault later (or, on a NIC, fail to
  // pin): msync reports ENOMEM for any unmapped page in the range.
  if (::msync(reinterpret_cast<void*>(start), end - start, MS_ASYNC) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "local source 0x", absl::Hex(addr), "+", length,
        " is not mapped memory, so the MR cache cannot register it"));
  }
  MemoryRegion region;
  region.addr = start;
  region.location = "*";
  region.remote_accessible = false;
  {
    MutexLock lock(&register_mu_);
    // Another request may have registered it meanwhile.
    if (!local_memory_.Contains(addr, length, false)) {
      // Cached registrations sharing pages with the cover (neighbouring
      // allocations often do) are merged into it: registered buffers may
      // not overlap, and a request must lie inside one.
      uintptr_t lo = start, hi = end;
      std::vector<uintptr_t> merged;
      {
        MutexLock cache_lock(&cache_mu_);
        for (bool grew = true; grew;) {
          grew = false;
          for (const auto& [a, c] : cache_) {
            if (a < hi && a + c.length > lo &&
                std::find(merged.begin(), merged.end(), a) == merged.end()) {
              merged.push_back(a);
              lo = std::min(lo, a);
              hi = std::max(hi, a + c.length);
              grew = true;
            }
          }
        }
      }
      for (uintptr_t a : merged) {
        // Zero wait: one that transfers use now cannot be merged.
        if (absl::Status s = UnregisterLocked(a, absl::ZeroDuration());
            !s.ok()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "MR cache: local source 0x", absl::Hex(addr), "+", length,
              " shares pages with a cached registration that transfers are "
              "using; retry, or register the memory with "
              "RegisterLocalMemory"));
        }
        ForgetCached(a);
      }
      region.addr = lo;
      region.length = hi - lo;
      if (absl::Status s = RegisterLocked(region); !s.ok()) {
        return absl::Status(
            s.code(),
            absl::StrCat("MR cache: cannot register 0x", absl::Hex(lo), "+",
                         hi - lo, ": ", s.message()));
      }
      MutexLock cache_lock(&cache_mu_);
      cache_[lo] = CachedMr{hi - lo, ++cache_clock_};
      cache_bytes_ += hi - lo;
    }
  }
  EvictCached(region.addr);
  return local_memory_.Acquire(addr, length, /*need_remote=*/false);
}

void EngineImpl::EvictCached(uintptr_t keep) {
  std::vector<std::pair<uint64_t, uintptr_t>> victims;
  size_t over = 0;
  {
    MutexLock lock(&cache_mu_);
    if (cache_bytes_ <= options_.mr_cache_bytes) return;
    over = cache_bytes_ - options_.mr_cache_bytes;
    for (const auto& [a, c] : cache_) {
      if (a != keep) victims.emplace_back(c.last_use, a);
    }
  }
  std::sort(victims.begin(), victims.end());  // Least recently used first.
  size_t freed = 0;
  for (const auto& [use, a] : victims) {
    if (freed >= over) break;
    absl::Status s;
    {
      MutexLock lock(&register_mu_);
      // Zero wait: a registration in use by a transfer is skipped, never
      // pulled from under it.
      s = UnregisterLocked(a, absl::ZeroDuration());
    }
    if (!s.ok()) continue;
    MutexLock lock(&cache_mu_);
    auto it = cache_.find(a);
    if (it == cache_.end()) continue;
    freed += it->second.length;
    cache_bytes_ -= it->second.length;
    cache_.erase(it);
  }
}

void EngineImpl::ForgetCached(uintptr_t addr) {
  MutexLock lock(&cache_mu_);
  auto it = cache_.find(addr);
  if (it == cache_.end()) return;
  cache_bytes_ -= it->second.length;
  cache_.erase(it);
}

}  // namespace ferry
