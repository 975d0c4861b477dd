// ShmTransport ("shm"): the same-host path. An initiator on the target's
// host copies straight between its memory and the target process's with
// process_vm_readv/writev: one copy, no socket, no NIC, no target thread.
// Mooncake TE sends such transfers through the NIC (or loopback TCP).
//
// Which targets: the engine asks CanReach when it picks a transport for a
// target, and takes the next one in EngineOptions::transports where the
// answer is no. Yes needs the target to publish an shm endpoint with this
// host's boot id and PID namespace (pids name processes only within one),
// and this process to pass the attach check below. So {"shm", "rdma"}
// copies to engines on this host and uses RDMA for the others.
//
// Consent and access. The copies need the kernel's ptrace permission over
// the target: the same user (or CAP_SYS_PTRACE), the target dumpable, and
// Yama's ptrace_scope allowing it. Installing shm is the target's consent:
// under ptrace_scope 1 it calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY),
// which lets processes of the same user (only) attach, as the descendants
// rule would otherwise forbid; under 2 or 3 only a privileged initiator
// passes. Where the kernel says no, the initiator falls back to the next
// transport (TransportStats::connect_failures counts it, the log says why).
// The copies bypass the target, so what it still controls is the shared
// table (shm_table.h): an initiator copies only into a buffer whose entry
// says live with the key its descriptor holds, and UnregisterMemory waits
// for copies in progress, so that once it returns no peer touches the
// buffer. Writes outside registered buffers are refused by the initiator's
// own descriptor check; a hostile process of the same user could do more
// anyway (ptrace), so shm adds no access that user did not already have.
//
// Attach (on the first CanReach or Submit for a target): open the target's
// table through /proc/PID/fd/N, check its token against the descriptor's,
// read the token again from the target's memory with process_vm_readv (the
// copy permission, proven once), hold a pidfd, and claim copy_threads + 1
// lanes. A failed attach is not retried for a second for that target run.
//
// Failure model:
// * The target exits: the next copy sees its pidfd readable (or ESRCH) and
//   fails with Unavailable; the peer is dropped, and a restarted target
//   (new incarnation) is attached afresh.
// * A stale descriptor: a buffer unregistered since fails with
//   FailedPrecondition ("unregistered"), nothing copied.
// * A copy the kernel refuses part of (EFAULT: the target unmapped memory
//   it had registered) fails those slices with FailedPrecondition; the
//   rest of the run still completes.
// * Deadlines: a slice whose deadline passed before its copy fails with
//   DeadlineExceeded uncopied. A copy, once started, is one system call.
// * Shutdown completes queued slices with Cancelled.
// * GPU memory (shm_cuda_ipc.cc). A target's GPU buffer publishes, with
//   its shm key, the driver's IPC handle of its allocation; an initiator
//   opens it once (cuIpcOpenMemHandle; the same process uses the pointer
//   as it is) and copies with the GPU on a copy thread's stream, waiting
//   for the copy before it leaves the lane, so the table's withdrawal
//   covers it. The mapping is closed when its buffer is found withdrawn or
//   the peer goes. A local GPU buffer to a target's host memory moves
//   through GpuStaging's pinned host buffers (shm.staging_buffers). GPU
//   copies never run on the submitting thread (it may be one that must not
//   call CUDA, engine/stream_transfers.h). Where the driver cannot export
//   a buffer, the buffer gets no shm key and peers use their next
//   transport; an initiator with no CUDA driver fails such slices with
//   FailedPrecondition.
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_SHM_SHM_TRANSPORT_H_
#define FERRY_TRANSPORT_SHM_SHM_TRANSPORT_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "common/mutex.h"
#include "gpu/cuda_abi.h"
#include "transport/gpu_staging.h"
#include "transport/shm/shm_table.h"
#include "transport/transport.h"

namespace ferry::shm {

// This process's host as shm endpoints name it: the boot id and the PID
// namespace.
const std::string& LocalShmHost();

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const TransportOptions& options);
  ~ShmTransport() override;

  absl::string_view name() const override { return "shm"; }
  absl::Status Install(const TransportEnv& env,
                       descriptor::TransportEndpoint* endpoint) override;
  absl::StatusOr<MemoryHandle> RegisterMemory(
      const MemoryRegion& region, descriptor::Buffer* published) override;
  absl::Status UnregisterMemory(uintptr_t addr) override;
  bool CanReach(const SegmentView& target) override;
  size_t max_slice_bytes() const override { return options_.shm.slice_bytes; }
  void Submit(absl::Span<Slice* const> slices) override;
  void ClosePeer(const SegmentView& segment) override;
  TransportStats Stats() const override;
  void Shutdown() override;

 private:
  struct Peer;
  // A peer's GPU allocation opened in this process: where it starts here,
  // how large it is (what bounds a copy into it), the device whose context
  // opened it (and must close it), and the copy threads using it now.
  struct OpenedGpuMemory {
    CUdeviceptr ptr = 0;
    size_t size = 0;
    int device = 0;
    int users = 0;
    bool withdrawn = false;  // Closed by its last user.
  };
  struct Job {
    std::shared_ptr<Peer> peer;
    Slice* slice;
    bool gpu;  // The target buffer is GPU memory (CopyRunGpu).
  };

  // The attached peer for `target`'s run, attaching if needed; null with
  // `why` set where it cannot be reached.
  std::shared_ptr<Peer> FindPeer(const SegmentView& target, absl::Status* why);
  absl::StatusOr<std::shared_ptr<Peer>> Attach(const SegmentView& target);
  // Host-memory slices (all to `peer`): copied here if small and the
  // peer's inline lane is free, else queued for the copy threads.
  void SubmitHost(const std::shared_ptr<Peer>& peer,
                  absl::Span<Slice* const> slices);
  // Checks and copies `slices` on lane `lane` of `peer`, then completes
  // them.
  void CopyRun(Peer& peer, uint32_t lane, absl::Span<Slice* const> slices);
  void Queue(const std::shared_ptr<Peer>& peer, absl::Span<Slice* const> slices,
             bool gpu);
  void WorkerLoop(int index);
  // GPU memory (shm_cuda_ipc.cc). Target side: publishes the IPC handle of
  // the allocation holding `region` in `published`.
  absl::Status PublishIpc(const MemoryRegion& region,
                          descriptor::Buffer* published);
  // Initiator side, on copy thread `worker`: checks and copies `slices`,
  // whose target buffers are GPU memory, with the GPU, then completes them.
  void CopyRunGpu(Peer& peer, uint32_t lane, int worker,
                  absl::Span<Slice* const> slices);
  // Mappings of a peer's GPU memory to close (a Peer that went): on a
  // copy thread, which may call CUDA.
  void CloseLater(const absl::flat_hash_map<uint64_t, OpenedGpuMemory>& opened);
  void CloseIpc(const std::vector<OpenedGpuMemory>& mappings);
  void DestroyStreams();
  // Drops peers whose process exited and closes mappings of withdrawn GPU
  // buffers that no copy uses (the first copy thread, once a second while
  // idle).
  void Housekeep();
  void FailAll(absl::Span<Slice* const> slices, const absl::Status& status);
  // Counts and completes slices, each with its status (OK runs to one sink
  // as a group).
  void Complete(absl::Span<Slice* const> slices,
                const std::vector<absl::Status>& status);

  const TransportOptions options_;
  Clock* clock_ = RealClock();
  std::unique_ptr<ShmTable> table_;  // This engine's, as a target.
  // Lane owner id of this process: pid << 32 | random tag.
  uint64_t owner_ = 0;

  mutable Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Peer>> peers_
      ABSL_GUARDED_BY(mu_);
  struct Failure {
    uint64_t incarnation;
    absl::Time retry_at;
    absl::Status status;
  };
  absl::flat_hash_map<std::string, Failure> failures_ ABSL_GUARDED_BY(mu_);
  // Targets being attached now (by one thread, outside mu_).
  absl::flat_hash_set<std::string> attaching_ ABSL_GUARDED_BY(mu_);
  // Keys of this engine's remote-accessible buffers, by address.
  absl::flat_hash_map<uintptr_t, uint64_t> keys_ ABSL_GUARDED_BY(mu_);

  Mutex queue_mu_;
  CondVar queue_cv_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(queue_mu_);
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::vector<OpenedGpuMemory> to_close_ ABSL_GUARDED_BY(queue_mu_);
  // Per copy thread, per GPU: the stream its copies run on (created on
  // first use; only that thread touches its row until Shutdown).
  std::vector<std::vector<CUstream>> streams_;
  // Shutdown began: nothing more is copied.
  std::atomic<bool> closed_{false};
  // This transport set PR_SET_PTRACER_ANY (Yama scope 1) and must release it.
  bool ptracer_set_ = false;
  std::vector<std::thread> workers_;

  // Counters.
  std::atomic<uint64_t> slices_{0}, bytes_{0}, errors_{0}, copies_{0};
  std::atomic<uint64_t> attaches_{0}, attach_failures_{0};

  // GPU memory of this engine goes through pinned host buffers, then the
  // host path.
  struct HostPath final : StagingPath {
    explicit HostPath(ShmTransport* t) : transport(t) {}
    void SubmitStaged(Slice* slice) override;
    ShmTransport* transport;
  };
  HostPath staging_path_{this};
  GpuStaging gpu_staging_;
};

}  // namespace ferry::shm

#endif  // FERRY_TRANSPORT_SHM_SHM_TRANSPORT_H_
