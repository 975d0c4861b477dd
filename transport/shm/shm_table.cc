#include "transport/shm/shm_table.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/secure_random.h"

namespace ferry::shm {
namespace {

constexpr uint64_t kMagic = 0x314d535952524546;  // "FERRYSM1", little-endian.
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kLaneBytes = 64;

pid_t OwnerPid(uint64_t owner) { return static_cast<pid_t>(owner >> 32); }

size_t TableBytes(uint32_t buffers, uint32_t lanes) {
  return kHeaderBytes + size_t{lanes} * kLaneBytes + size_t{buffers} * 8;
}

// A lane's owner holds an open-file-description lock on the lane's bytes of
// the memfd, through its own descriptor of it. The kernel drops the lock
// when the owner's descriptor closes, which its exit does: so whether a
// lane's owner lives is asked of the lock, never of a pid (a pid may be
// reused, a zombie looks alive).
flock LaneRange(uint32_t lane, short type) {  // NOLINT(runtime/int): flock's
  flock l{};
  l.l_type = type;
  l.l_whence = SEEK_SET;
  l.l_start = static_cast<off_t>(kHeaderBytes + size_t{lane} * kLaneBytes);
  l.l_len = static_cast<off_t>(kLaneBytes);
  return l;
}

}  // namespace

struct ShmTable::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t buffers;
  uint32_t lanes;
  uint32_t reserved;
  uint8_t token[kTokenBytes];
};

// One cache line each, so that lanes bumped by different initiators do
// not share a line.
struct alignas(64) ShmTable::Lane {
  std::atomic<uint64_t> owner;  // 0: free; else pid << 32 | tag.
  std::atomic<uint64_t> seq;    // Odd while its owner checks and copies.
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the table's atomics are shared between processes");

ShmTable::Header* ShmTable::header() const {
  return static_cast<Header*>(base_);
}

ShmTable::Lane* ShmTable::lane(uint32_t i) const {
  static_assert(sizeof(Lane) == kLaneBytes);
  return reinterpret_cast<Lane*>(static_cast<char*>(base_) + kHeaderBytes) + i;
}

std::atomic<uint64_t>* ShmTable::entry(uint32_t i) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) +
                                                  kHeaderBytes +
                                                  size_t{lanes_} * kLaneBytes) +
         i;
}

absl::StatusOr<std::unique_ptr<ShmTable>> ShmTable::Create(uint32_t buffers,
                                                           uint32_t lanes) {
  if (buffers < 1 || buffers > kMaxBuffers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm.max_buffers must be 1..", kMaxBuffers, " (", buffers, ")"));
  }
  if (lanes < kMinLanes || lanes > kMaxLanes) {
    return absl::InvalidArgumentError(absl::StrCat("shm.max_lanes must be ",
                                                   kMinLanes, "..", kMaxLanes,
                                                   " (", lanes, ")"));
  }
  std::unique_ptr<ShmTable> t(new ShmTable);
  t->fd_ = ::memfd_create("ferry-shm-table", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (t->fd_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  const size_t bytes = TableBytes(buffers, lanes);
  if (::ftruncate(t->fd_, static_cast<off_t>(bytes)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate of the shm table: ", std::strerror(errno)));
  }
  // Sealed at its size: a peer that mapped it must never find it shrunk
  // under its mapping (SIGBUS).
  if (::fcntl(t->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) !=
      0) {
    return absl::InternalError(
        absl::StrCat("sealing the shm table: ", std::strerror(errno)));
  }
  void* base =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, t->fd_, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of the shm table: ", std::strerror(errno)));
  }
  t->base_ = base;
  t->bytes_ = bytes;
  t->buffers_ = buffers;
  t->lanes_ = lanes;
  Header* h = t->header();  // The memfd starts zeroed: lanes free, dead.
  h->version = kVersion;
  h->buffers = buffers;
  h->lanes = lanes;
  SecureRandomBytes(h->token, kTokenBytes);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  MutexLock lock(&t->mu_);
  t->generation_.assign(buffers, 0);
  return t;
}

absl::StatusOr<std::unique_ptr<ShmTable>> ShmTable::Attach(
    pid_t pid, int fd, absl::string_view token) {
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  const int f = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) {
    const int e = errno;
    const std::string why = absl::StrCat("open ", path, ": ", std::strerror(e));
    if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(why);
    return absl::UnavailableError(why);
  }
  struct stat st {};
  const bool sized = ::fstat(f, &st) == 0;
  const size_t bytes = sized ? static_cast<size_t>(st.st_size) : 0;
  if (!sized || bytes < kHeaderBytes ||
      bytes > TableBytes(kMaxBuffers, kMaxLanes)) {
    ::close(f);
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not an shm table (", bytes, " bytes)"));
  }
  // Only a table sealed against shrinking is safe to map: a truncated one
  // would fault this process (SIGBUS) on its next look.
  const int seals = ::fcntl(f, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    ::close(f);
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a sealed shm table (it could shrink under a mapping)"));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  if (base == MAP_FAILED) {
    ::close(f);
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<ShmTable> t(new ShmTable);
  t->fd_ = f;  // Kept: the lanes' locks are held through it.
  t->base_ = base;
  t->bytes_ = bytes;
  if (absl::Status s = t->Map(base, bytes); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", s.message()));
  }
  if (t->token() != token) {
    return absl::FailedPreconditionError(absl::StrCat(
        path,
        " holds another engine's table (its token differs from the "
        "descriptor's: the process restarted, or its pid was reused)"));
  }
  return t;
}

absl::Status ShmTable::Map(void* base, size_t bytes) {
  const Header* h = static_cast<const Header*>(base);
  if (h->magic != kMagic || h->version != kVersion) {
    return absl::FailedPreconditionError("not a Ferry shm table, version 1");
  }
  const uint32_t buffers = h->buffers;
  const uint32_t lanes = h->lanes;
  if (buffers < 1 || buffers > kMaxBuffers || lanes < kMinLanes ||
      lanes > kMaxLanes || TableBytes(buffers, lanes) != bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("table of ", buffers, " buffers and ", lanes,
                     " lanes does not match its size, ", bytes, " bytes"));
  }
  buffers_ = buffers;
  lanes_ = lanes;
  return absl::OkStatus();
}

ShmTable::~ShmTable() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

std::string ShmTable::token() const {
  return std::string(reinterpret_cast<const char*>(header()->token),
                     kTokenBytes);
}

uintptr_t ShmTable::token_address() const {
  return reinterpret_cast<uintptr_t>(header()->token);
}

absl::StatusOr<uint64_t> ShmTable::AddBuffer() {
  MutexLock lock(&mu_);
  uint32_t index;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else if (next_ < buffers_) {
    index = next_++;
  } else {
    return absl::ResourceExhaustedError(
        absl::StrCat("the shm table holds ", buffers_,
                     " buffers already (shm.max_buffers)"));
  }
  // Generations start at 1 and skip 0 when they wrap: key 0 means "none".
  uint32_t gen = generation_[index] + 1;
  if (gen == 0) gen = 1;
  generation_[index] = gen;
  entry(index)->store(uint64_t{gen} << 1 | 1, std::memory_order_seq_cst);
  return uint64_t{index} << 32 | gen;
}

absl::Status ShmTable::RemoveBuffer(uint64_t key, absl::Duration wait,
                                    Clock* clock) {
  const uint32_t index = static_cast<uint32_t>(key >> 32);
  const uint32_t gen = static_cast<uint32_t>(key);
  {
    MutexLock lock(&mu_);
    if (index >= next_ || gen == 0 || generation_[index] != gen) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm key 0x", absl::Hex(key), " is not registered"));
    }
  }
  // Dead first, then look at the lanes: a copy that checked the entry
  // before this store has its lane odd by then.
  entry(index)->store(uint64_t{gen} << 1, std::memory_order_seq_cst);
  const absl::Time deadline = clock->Now() + wait;
  for (uint32_t i = 0; i < lanes_; ++i) {
    Lane* l = lane(i);
    const uint64_t seq = l->seq.load(std::memory_order_seq_cst);
    if ((seq & 1) == 0) continue;
    for (int spins = 0;; ++spins) {
      if (l->seq.load(std::memory_order_seq_cst) != seq) break;
      uint64_t owner = l->owner.load(std::memory_order_acquire);
      if (owner == 0) break;  // Released (it was done copying).
      if (!LaneHeld(i)) {
        // Its owner died inside a copy: nothing moves on that lane again.
        // Even first, then ownerless, so that a new owner never finds the
        // sequence moved under it.
        uint64_t odd = seq;
        if (l->seq.compare_exchange_strong(odd, seq + 1)) {
          l->owner.compare_exchange_strong(owner, 0);
        }
        break;
      }
      if (clock->Now() >= deadline) {
        return absl::FailedPreconditionError(absl::StrCat(
            "a peer on this host (pid ", OwnerPid(owner),
            ") has been copying for over ", absl::FormatDuration(wait),
            " (shm.unregister_wait) and may still touch the buffer; it is "
            "withdrawn from peers, but must not be freed yet"));
      }
      // Copies take microseconds: spin a little, then sleep.
      if (spins > 100) absl::SleepFor(absl::Microseconds(50));
    }
  }
  MutexLock lock(&mu_);
  free_.push_back(index);
  return absl::OkStatus();
}

bool ShmTable::LaneHeld(uint32_t i) const {
  flock l = LaneRange(i, F_WRLCK);
  // A lock held through another open file description conflicts; the
  // owner's lock is never ours (the target does not copy).
  if (::fcntl(fd_, F_OFD_GETLK, &l) != 0) return true;  // Cannot tell.
  return l.l_type != F_UNLCK;
}

absl::StatusOr<uint32_t> ShmTable::ClaimLane(uint64_t owner) {
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t i = 0; i < lanes_; ++i) {
      Lane* l = lane(i);
      uint64_t current = l->owner.load(std::memory_order_acquire);
      // First pass: free lanes; second: lanes whose owner is gone. A lock
      // of our own never shows in LaneHeld (one open file description),
      // so our own lanes are skipped by the record of them.
      if (pass == 0 ? current != 0 : (current == 0 || Mine(i) || LaneHeld(i))) {
        continue;
      }
      if (!l->owner.compare_exchange_strong(current, owner)) continue;
      flock lock = LaneRange(i, F_WRLCK);
      if (::fcntl(fd_, F_OFD_SETLK, &lock) != 0) {
        // Another owner's lock is still there: not ours after all.
        uint64_t mine = owner;
        l->owner.compare_exchange_strong(mine, current);
        continue;
      }
      // A target may have freed it between our claim and our lock (it
      // looked ownerless-and-unlocked): then it is not ours.
      if (l->owner.load(std::memory_order_acquire) != owner) {
        flock unlock = LaneRange(i, F_UNLCK);
        ::fcntl(fd_, F_OFD_SETLK, &unlock);
        continue;
      }
      // A lane is handed on even; a dead former owner may have left it
      // odd (a target that reclaims it makes it even too: one of the two
      // exchanges wins).
      uint64_t seq = l->seq.load(std::memory_order_acquire);
      if (seq & 1) l->seq.compare_exchange_strong(seq, seq + 1);
      MutexLock guard(&mu_);
      mine_.insert(i);
      return i;
    }
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("all ", lanes_,
                   " lanes of the peer's shm table are taken (its "
                   "shm.max_lanes)"));
}

void ShmTable::ReleaseLane(uint32_t i, uint64_t owner) {
  if (i >= lanes_) return;
  if (lane(i)->owner.compare_exchange_strong(owner, 0)) {
    flock unlock = LaneRange(i, F_UNLCK);
    ::fcntl(fd_, F_OFD_SETLK, &unlock);
  }
  MutexLock guard(&mu_);
  mine_.erase(i);
}

bool ShmTable::Mine(uint32_t i) {
  MutexLock guard(&mu_);
  return mine_.contains(i);
}

void ShmTable::Enter(uint32_t i) {
  // A read-modify-write: the store is ordered before the entry loads that
  // follow (on x86 a locked instruction, the fence a plain store lacks).
  lane(i)->seq.fetch_add(1, std::memory_order_seq_cst);
}

bool ShmTable::Live(uint64_t key) const {
  const uint32_t index = static_cast<uint32_t>(key >> 32);
  const uint32_t gen = static_cast<uint32_t>(key);
  if (index >= buffers_ || gen == 0) return false;
  return entry(index)->load(std::memory_order_seq_cst) ==
         (uint64_t{gen} << 1 | 1);
}

void ShmTable::Exit(uint32_t i) {
  lane(i)->seq.fetch_add(1, std::memory_order_seq_cst);
}

}  // namespace ferry::shm
