// MemoryRegistry: the set of registered buffers of one engine or transport,
// with O(log n) lookup of the buffer that contains an address range.
//
// Users of a buffer take a Lease; Remove waits (bounded) until no lease
// is outstanding, so a buffer is never removed under an access in flight.
// Taking a lease is a shared lock and one atomic increment; releasing one
// is an atomic decrement (the lock is taken only to wake a waiting Remove).
// Each buffer also carries opaque handles (one per transport), so a lease
// gives the data path everything it needs without a second lookup.
// Remove's and AwaitReservations' bounded waits run on the registry's
// Clock, so a test on a SimulatedClock decides when they give up.
// Thread-safe.
#ifndef FERRY_TRANSPORT_MEMORY_REGISTRY_H_
#define FERRY_TRANSPORT_MEMORY_REGISTRY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"

namespace ferry {

struct MemoryRegion {
  uintptr_t addr = 0;
  size_t length = 0;
  std::string location = "*";  // "cpu:N", "cuda:N" or "*".
  bool remote_accessible = false;
  // The GPU whose memory the region is (gpu/gpu_memory.h), -1 for host
  // memory. A transport must not touch GPU memory with the CPU.
  int cuda_device = -1;
  // For GPU memory, the driver's id of the allocation holding it when it
  // was registered (gpu::GpuAllocation): a freed allocation is noticed by
  // its id no longer being at the address.
  uint64_t cuda_buffer_id = 0;
};

// Validates a region given by a user: non-null, nonzero length, no
// wrap-around.
absl::Status ValidateRegion(uintptr_t addr, size_t length);

class MemoryRegistry {
 private:
  struct Entry {
    MemoryRegion region;
    std::vector<const void*> handles;  // Fixed after Add.
    std::atomic<int64_t> users{0};
    std::atomic<bool> closing{false};
    // Reserved (Reserve), not yet usable; or retired (Retire): closing
    // for good, removed once its last lease went.
    bool pending = false;
    bool retired = false;

    // Whether [addr, addr + length) lies inside the region (no wrap).
    bool Covers(uintptr_t addr, size_t length) const {
      return addr >= region.addr && addr + length >= addr &&
             addr + length <= region.addr + region.length;
    }
  };

 public:
  // Keeps a registered buffer alive (not unregistered) while held. Movable;
  // releases on destruction.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Release(); }

    bool held() const { return registry_ != nullptr; }
    const MemoryRegion& region() const { return entry_->region; }
    // Another lease on the same buffer, without a lookup (one atomic
    // increment); an empty lease if this one is empty or the buffer is
    // being removed.
    Lease Clone() const;
    // Whether [addr, addr + length) lies inside the leased buffer.
    bool Covers(uintptr_t addr, size_t length) const {
      return held() && entry_->Covers(addr, length);
    }
    // Handle `i` given to Add, or nullptr.
    const void* handle(size_t i) const {
      return i < entry_->handles.size() ? entry_->handles[i] : nullptr;
    }
    void Release();

   private:
    friend class MemoryRegistry;
    // Counts one more user of `entry`.
    Lease(MemoryRegistry* registry, Entry* entry)
        : registry_(registry), entry_(entry) {
      entry_->users.fetch_add(1, std::memory_order_seq_cst);
    }

    MemoryRegistry* registry_ = nullptr;
    Entry* entry_ = nullptr;
  };

  // Waits run on `clock` (null: the system clock), which must outlive the
  // registry.
  explicit MemoryRegistry(Clock* clock = RealClock())
      : clock_(ClockOrReal(clock)) {}
  MemoryRegistry(const MemoryRegistry&) = delete;
  MemoryRegistry& operator=(const MemoryRegistry&) = delete;
  // All leases must have been released.
  ~MemoryRegistry();

  // For an owner that learns its clock after construction (an engine's
  // Init, a transport's Install): the clock of waits that begin from now
  // on (null: the system clock).
  void SetClock(Clock* clock);

  // Adds `region` with its `handles`. InvalidArgument if it is malformed,
  // AlreadyExists if it overlaps a registered buffer (naming that buffer).
  absl::Status Add(const MemoryRegion& region,
                   std::vector<const void*> handles = {});

  // OK if `region` is well formed and overlaps no registered buffer (what
  // Add would check), else the error Add would return.
  absl::Status CheckAvailable(const MemoryRegion& region) const;

  // Two-phase Add, so that the slow part (registering with the NICs) runs
  // without holding any lock across it: Reserve claims the range (as Add
  // checks it) without making it usable; ActivateAndAcquire makes it
  // usable with its handles and, atomically with that, leases
  // [lease_addr, lease_addr + lease_length) in it (so that nobody can
  // remove it in between); CancelReservation gives the range back.
  absl::Status Reserve(const MemoryRegion& region);
  absl::StatusOr<Lease> ActivateAndAcquire(uintptr_t addr,
                                           std::vector<const void*> handles,
                                           uintptr_t lease_addr,
                                           size_t lease_length);
  void CancelReservation(uintptr_t addr);
  // Waits until no reservation, and no retired buffer that still has
  // leases, overlaps [addr, addr + length), or until `deadline` (on the
  // registry's clock); false if one still does.
  bool AwaitReservations(uintptr_t addr, size_t length, absl::Time deadline);

  // Retiring: the buffer at `addr` takes no new lease, ever, but keeps its
  // range (nothing new can be registered over it) until EraseRetired, so
  // that the caller can unregister it from the transports in between.
  // Retire does it whatever the leases (idempotent; NotFound if no active
  // buffer starts at `addr`); RetireIfIdle only if no lease is held.
  absl::Status Retire(uintptr_t addr);
  bool RetireIfIdle(uintptr_t addr);
  // Whether the retired buffer at `addr` has no lease left.
  bool RetiredAndIdle(uintptr_t addr) const;
  // Removes a retired buffer (its leases must be gone).
  void EraseRetired(uintptr_t addr);

  // Removes the buffer that starts at `addr`. New leases on it fail at once;
  // waits up to `wait` for outstanding leases, then gives up with
  // FailedPrecondition and leaves the buffer registered. NotFound if no
  // buffer starts at `addr`.
  absl::Status Remove(uintptr_t addr, absl::Duration wait);

  // Leases the buffer that contains all of [addr, addr + length). Fails with
  // InvalidArgument (naming the range) if no single buffer contains it, or if
  // `need_remote` and the buffer is not remote-accessible.
  absl::StatusOr<Lease> Acquire(uintptr_t addr, size_t length,
                                bool need_remote);

  // Whether some buffer contains the whole range, without leasing it.
  bool Contains(uintptr_t addr, size_t length, bool need_remote) const;

  // The buffer that starts exactly at `addr`, if any.
  std::optional<MemoryRegion> Lookup(uintptr_t addr) const;

  std::vector<MemoryRegion> List() const;
  // Removes every buffer (no lease may be held).
  void Clear();
  size_t size() const;

 private:
  absl::Status CheckFreeLocked(const MemoryRegion& region) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns the entry containing the range, or nullptr.
  const Entry* FindLocked(uintptr_t addr, size_t length) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  Clock* clock_ ABSL_GUARDED_BY(mu_);
  CondVar drained_;  // A closing entry's last lease went away.
  // Threads waiting on drained_ for leases to go (Lease::Release signals
  // only when there are some).
  std::atomic<int> waiters_{0};
  // Counts a waiter for its scope; made before it first looks at `users`.
  class Waiting {
   public:
    explicit Waiting(MemoryRegistry* r) : r_(r) {
      r_->waiters_.fetch_add(1, std::memory_order_seq_cst);
    }
    ~Waiting() { r_->waiters_.fetch_sub(1, std::memory_order_seq_cst); }
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    MemoryRegistry* r_;
  };
  // Keyed by start address; buffers never overlap, so the candidate for an
  // address is the last entry that starts at or below it.
  std::map<uintptr_t, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_MEMORY_REGISTRY_H_
