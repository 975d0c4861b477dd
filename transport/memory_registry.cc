#include "transport/memory_registry.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ferry {

absl::Status ValidateRegion(uintptr_t addr, size_t length) {
  if (addr == 0) return absl::InvalidArgumentError("address is null");
  if (length == 0) return absl::InvalidArgumentError("length is zero");
  if (addr + length < addr) {
    return absl::InvalidArgumentError(
        absl::StrCat("range at 0x", absl::Hex(addr), " of length ", length,
                     " wraps around the address space"));
  }
  return absl::OkStatus();
}

MemoryRegistry::Lease& MemoryRegistry::Lease::operator=(
    Lease&& other) noexcept {
  if (this != &other) {
    Release();
    registry_ = other.registry_;
    entry_ = other.entry_;
    other.registry_ = nullptr;
    other.entry_ = nullptr;
  }
  return *this;
}

MemoryRegistry::Lease MemoryRegistry::Lease::Clone() const {
  if (registry_ == nullptr) return Lease();
  Lease lease(registry_, entry_);
  // Removal has begun: new leases fail, as Acquire's would.
  if (entry_->closing.load(std::memory_order_seq_cst)) lease.Release();
  return lease;
}

void MemoryRegistry::Lease::Release() {
  if (registry_ == nullptr) return;
  // The entry must not be touched after the decrement: a Remove waiting
  // for it may free it at once. The last lease wakes the waiters (under
  // the registry's lock, so none can miss it) -- only if there are any:
  // each waiter is counted before it looks at `users` (both seq_cst), so
  // either it sees this decrement or this sees it. Without waiters the
  // last lease takes no lock (the TCP target's every WRITE ends one).
  if (entry_->users.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
      registry_->waiters_.load(std::memory_order_seq_cst) > 0) {
    MutexLock lock(&registry_->mu_);
    registry_->drained_.SignalAll();
  }
  registry_ = nullptr;
  entry_ = nullptr;
}

MemoryRegistry::~MemoryRegistry() = default;

void MemoryRegistry::SetClock(Clock* clock) {
  MutexLock lock(&mu_);
  clock_ = ClockOrReal(clock);
}

absl::Status MemoryRegistry::CheckFreeLocked(const MemoryRegion& region) const {
  FERRY_RETURN_IF_ERROR(ValidateRegion(region.addr, region.length));
  const uintptr_t end = region.addr + region.length;
  auto next = entries_.lower_bound(region.addr);
  if (next != entries_.end() && next->first < end) {
    return absl::AlreadyExistsError(absl::StrCat(
        "range 0x", absl::Hex(region.addr), "+", region.length,
        " overlaps the registered buffer at 0x", absl::Hex(next->first)));
  }
  if (next != entries_.begin()) {
    const MemoryRegion& p = std::prev(next)->second->region;
    if (p.addr + p.length > region.addr) {
      return absl::AlreadyExistsError(absl::StrCat(
          "range 0x", absl::Hex(region.addr), "+", region.length,
          " overlaps the registered buffer at 0x", absl::Hex(p.addr)));
    }
  }
  return absl::OkStatus();
}

absl::Status MemoryRegistry::CheckAvailable(const MemoryRegion& region) const {
  MutexLock lock(&mu_);
  return CheckFreeLocked(region);
}

absl::Status MemoryRegistry::Add(const MemoryRegion& region,
                                 std::vector<const void*> handles) {
  MutexLock lock(&mu_);
  FERRY_RETURN_IF_ERROR(CheckFreeLocked(region));
  auto entry = std::make_unique<Entry>();
  entry->region = region;
  entry->handles = std::move(handles);
  entries_.emplace(region.addr, std::move(entry));
  return absl::OkStatus();
}

absl::Status MemoryRegistry::Reserve(const MemoryRegion& region) {
  MutexLock lock(&mu_);
  FERRY_RETURN_IF_ERROR(CheckFreeLocked(region));
  auto entry = std::make_unique<Entry>();
  entry->region = region;
  entry->pending = true;
  entry->closing.store(true);  // Not leasable until Activate.
  entries_.emplace(region.addr, std::move(entry));
  return absl::OkStatus();
}

absl::StatusOr<MemoryRegistry::Lease> MemoryRegistry::ActivateAndAcquire(
    uintptr_t addr, std::vector<const void*> handles, uintptr_t lease_addr,
    size_t lease_length) {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  if (it == entries_.end() || !it->second->pending) {
    return absl::InternalError(
        absl::StrCat("no reservation at 0x", absl::Hex(addr)));
  }
  Entry* entry = it->second.get();
  entry->handles = std::move(handles);
  entry->pending = false;
  entry->closing.store(false, std::memory_order_seq_cst);
  drained_.SignalAll();
  if (!entry->Covers(lease_addr, lease_length)) {
    return absl::InvalidArgumentError(
        absl::StrCat("range 0x", absl::Hex(lease_addr), "+", lease_length,
                     " is not inside the buffer being activated"));
  }
  return Lease(this, entry);
}

void MemoryRegistry::CancelReservation(uintptr_t addr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  if (it == entries_.end() || !it->second->pending) return;
  entries_.erase(it);
  drained_.SignalAll();
}

bool MemoryRegistry::AwaitReservations(uintptr_t addr, size_t length,
                                       absl::Time deadline) {
  MutexLock lock(&mu_);
  Waiting waiting(this);
  const uintptr_t end = addr + length < addr ? ~uintptr_t{0} : addr + length;
  while (true) {
    bool overlapping = false;
    // Entries never overlap each other, so those overlapping the range
    // are the one before `addr` and those starting inside it.
    auto it = entries_.upper_bound(addr);
    if (it != entries_.begin()) --it;
    for (; it != entries_.end() && it->first < end; ++it) {
      const MemoryRegion& r = it->second->region;
      const Entry& e = *it->second;
      const bool unsettled =
          e.pending ||
          (e.retired && e.users.load(std::memory_order_seq_cst) != 0);
      if (unsettled && r.addr + r.length > addr) overlapping = true;
    }
    if (!overlapping) return true;
    if (clock_->WaitWithDeadline(&drained_, &mu_, deadline)) return false;
  }
}

absl::Status MemoryRegistry::Retire(uintptr_t addr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  if (it == entries_.end() || it->second->pending) {
    return absl::NotFoundError(
        absl::StrCat("no registered buffer starts at 0x", absl::Hex(addr)));
  }
  it->second->retired = true;
  it->second->closing.store(true, std::memory_order_seq_cst);
  return absl::OkStatus();
}

bool MemoryRegistry::RetireIfIdle(uintptr_t addr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  if (it == entries_.end() || it->second->pending) return false;
  Entry* entry = it->second.get();
  // Closing first, then the count: a Clone racing with this either sees
  // closing (and gives its lease back) or is counted here.
  const bool was_closing = entry->closing.exchange(true);
  if (entry->users.load(std::memory_order_seq_cst) != 0) {
    if (!was_closing) entry->closing.store(false);
    return false;
  }
  entry->retired = true;
  return true;
}

bool MemoryRegistry::RetiredAndIdle(uintptr_t addr) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  return it != entries_.end() && it->second->retired &&
         it->second->users.load(std::memory_order_seq_cst) == 0;
}

void MemoryRegistry::EraseRetired(uintptr_t addr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  if (it == entries_.end() || !it->second->retired) return;
  entries_.erase(it);
  drained_.SignalAll();
}

absl::Status MemoryRegistry::Remove(uintptr_t addr, absl::Duration wait) {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  if (it == entries_.end() || it->second->closing.load() ||
      it->second->retired) {
    return absl::NotFoundError(
        absl::StrCat("no registered buffer starts at 0x", absl::Hex(addr)));
  }
  Entry* entry = it->second.get();
  entry->closing.store(true, std::memory_order_seq_cst);
  const absl::Time deadline = clock_->Now() + wait;
  Waiting waiting(this);
  while (entry->users.load(std::memory_order_seq_cst) != 0) {
    if (clock_->WaitWithDeadline(&drained_, &mu_, deadline) &&
        entry->users.load(std::memory_order_seq_cst) != 0) {
      if (!entry->retired) entry->closing.store(false);
      return absl::FailedPreconditionError(absl::StrCat(
          "buffer at 0x", absl::Hex(addr), " still has ", entry->users.load(),
          " transfer(s) in flight after ", absl::FormatDuration(wait)));
    }
  }
  entries_.erase(it);
  return absl::OkStatus();
}

const MemoryRegistry::Entry* MemoryRegistry::FindLocked(uintptr_t addr,
                                                        size_t length) const {
  auto it = entries_.upper_bound(addr);
  if (it == entries_.begin()) return nullptr;
  --it;
  return it->second->Covers(addr, length) ? it->second.get() : nullptr;
}

absl::StatusOr<MemoryRegistry::Lease> MemoryRegistry::Acquire(
    uintptr_t addr, size_t length, bool need_remote) {
  MutexLock lock(&mu_);
  Entry* entry = const_cast<Entry*>(FindLocked(addr, length));
  if (entry == nullptr || entry->closing.load()) {
    return absl::InvalidArgumentError(
        absl::StrCat("range 0x", absl::Hex(addr), "+", length,
                     " is not inside one registered buffer"));
  }
  if (need_remote && !entry->region.remote_accessible) {
    return absl::PermissionDeniedError(
        absl::StrCat("buffer at 0x", absl::Hex(entry->region.addr),
                     " is not registered as remote-accessible"));
  }
  return Lease(this, entry);
}

bool MemoryRegistry::Contains(uintptr_t addr, size_t length,
                              bool need_remote) const {
  MutexLock lock(&mu_);
  const Entry* e = FindLocked(addr, length);
  return e != nullptr && !e->closing.load() &&
         (!need_remote || e->region.remote_accessible);
}

std::optional<MemoryRegion> MemoryRegistry::Lookup(uintptr_t addr) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(addr);
  if (it == entries_.end() || it->second->closing.load()) return std::nullopt;
  return it->second->region;
}

std::vector<MemoryRegion> MemoryRegistry::List() const {
  MutexLock lock(&mu_);
  std::vector<MemoryRegion> out;
  for (const auto& [addr, e] : entries_) {
    if (!e->pending) out.push_back(e->region);
  }
  return out;
}

void MemoryRegistry::Clear() {
  MutexLock lock(&mu_);
  entries_.clear();
  drained_.SignalAll();
}

size_t MemoryRegistry::size() const {
  MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace ferry
