// ShmTable: the memory a target engine shares with the initiators on its
// host that copy into and out of its buffers with process_vm_readv/writev.
// Those copies bypass the target entirely, so the table is how the target
// still decides what may be touched, and when an unregistered buffer is
// free of copies:
//
// * An entry per registered buffer: generation << 1 | live. A buffer's key
//   (published as Buffer.shm_key) is its index << 32 | generation; an
//   initiator copies only while the entry says live with that generation,
//   so a stale descriptor never reaches a buffer registered since at the
//   same index.
// * Lanes: each initiator claims a few (one per thread that may copy),
//   holding an open-file-description lock on each lane's bytes of the
//   memfd for as long as it owns it (the kernel drops it when the
//   initiator exits, so the target tells a dead owner without trusting
//   pids), and bumps a lane's sequence number to odd before it checks an
//   entry and to even after its copy. Unregistering marks the entry dead, then
//   waits for every lane that is odd to move on. Both sides use sequentially
//   consistent operations, so either the initiator sees the entry dead, or
//   the target sees the lane odd (Dekker's argument): no copy touches a
//   buffer after RemoveBuffer returned OK.
//
// The table lives in a memfd; initiators open it as /proc/PID/fd/N (which
// needs the same ptrace permission as the copies) and map it. The header
// carries a random token that the target also publishes in its descriptor:
// an initiator checks both, so a recycled pid or a wrong fd is refused.
//
// Thread-safety: the target-side calls (AddBuffer, RemoveBuffer) are
// thread-safe; the lane calls are thread-safe across lanes and a lane is
// used by one thread at a time (the caller's contract).
#ifndef FERRY_TRANSPORT_SHM_SHM_TABLE_H_
#define FERRY_TRANSPORT_SHM_SHM_TABLE_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"

namespace ferry::shm {

inline constexpr size_t kTokenBytes = 16;
inline constexpr uint32_t kMinLanes = 16;
inline constexpr uint32_t kMaxLanes = 1 << 16;
inline constexpr uint32_t kMaxBuffers = 1 << 20;

class ShmTable {
 public:
  // Target side: a new table for `buffers` buffers and `lanes` lanes, in a
  // fresh memfd with a random token. InvalidArgument outside the limits
  // above; the kernel's error where the memfd cannot be made.
  static absl::StatusOr<std::unique_ptr<ShmTable>> Create(uint32_t buffers,
                                                          uint32_t lanes);
  // Initiator side: maps the table that process `pid` holds as fd `fd`,
  // and checks it: PermissionDenied where this process may not open it,
  // Unavailable where the process or fd is gone, FailedPrecondition where
  // it is not a table or its token is not `token`.
  static absl::StatusOr<std::unique_ptr<ShmTable>> Attach(
      pid_t pid, int fd, absl::string_view token);

  ~ShmTable();
  ShmTable(const ShmTable&) = delete;
  ShmTable& operator=(const ShmTable&) = delete;

  // The table's memfd: the target's own, or the initiator's descriptor of
  // it (through which it holds its lanes' locks).
  int fd() const { return fd_; }
  std::string token() const;
  // Where the token lies in this mapping (the target publishes it, so
  // that a peer can read it with process_vm_readv as its probe).
  uintptr_t token_address() const;
  uint32_t buffers() const { return buffers_; }
  uint32_t lanes() const { return lanes_; }

  // Target side. A key for a newly registered buffer, live from now on:
  // ResourceExhausted when all entries are taken.
  absl::StatusOr<uint64_t> AddBuffer();
  // Marks the buffer dead (no copy starts on it from now on) and waits up
  // to `wait`, on `clock`, for the copies in progress on any lane to end;
  // a lane whose owner is gone (its lock dropped: the process exited) is
  // freed instead. The entry is
  // free for reuse once this returns OK; after FailedPrecondition (a live
  // owner still copying; the message names its pid) it stays dead and
  // unused. InvalidArgument for a key this table did not hand out.
  absl::Status RemoveBuffer(uint64_t key, absl::Duration wait, Clock* clock);

  // Initiator side. Claims a free lane for `owner` (this process's pid in
  // the high 32 bits, a nonzero tag in the low; shown in the target's
  // errors), taking over a lane whose owner is gone if none is free, and
  // holds the lane's lock through fd() until ReleaseLane or this process
  // exits; ResourceExhausted if none.
  absl::StatusOr<uint32_t> ClaimLane(uint64_t owner);
  void ReleaseLane(uint32_t lane, uint64_t owner);
  // Brackets the checks and copies on one lane: Enter, then Live for each
  // buffer before touching it, then Exit.
  void Enter(uint32_t lane);
  bool Live(uint64_t key) const;
  void Exit(uint32_t lane);

 private:
  struct Header;
  struct Lane;
  ShmTable() = default;
  // Checks a mapped table's header against its size (a peer's table is
  // not trusted to be well formed) and sets the views.
  absl::Status Map(void* base, size_t bytes);
  Header* header() const;
  // Whether some owner holds lane `i`'s lock (see ClaimLane): never true
  // of this object's own lanes, hence Mine.
  bool LaneHeld(uint32_t i) const;
  bool Mine(uint32_t i);
  Lane* lane(uint32_t i) const;
  std::atomic<uint64_t>* entry(uint32_t i) const;

  int fd_ = -1;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  uint32_t buffers_ = 0;
  uint32_t lanes_ = 0;

  // Target side: the generation of each entry and the free ones, kept
  // here rather than read back from shared memory that peers can write.
  Mutex mu_;
  std::vector<uint32_t> generation_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
  uint32_t next_ ABSL_GUARDED_BY(mu_) = 0;
  // Initiator side: the lanes claimed through this object.
  absl::flat_hash_set<uint32_t> mine_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::shm

#endif  // FERRY_TRANSPORT_SHM_SHM_TABLE_H_
