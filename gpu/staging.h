// Staging: moving GPU memory through pinned host memory, for a transport
// whose data path cannot reach device memory (TCP's sockets; a NIC without
// GPUDirect). Two parts:
//
// * PinnedPool: a bounded set of equal page-locked host buffers
//   (cuMemHostAlloc, portable to every context), allocated on first use.
//   Its bound is the staging path's whole memory use.
// * CopyQueue: asynchronous copies between device memory and such buffers,
//   on streams of its own (never the application's), issued and reaped by
//   one thread of its own; each copy's callback runs on that thread once
//   the copy finished. Copies are issued as soon as they are queued and
//   reaped in order, so a copy runs while the bytes of the previous one
//   are on the wire: copy and send overlap.
#ifndef FERRY_GPU_STAGING_H_
#define FERRY_GPU_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "gpu/cuda_driver.h"

namespace ferry::gpu {

// Thread-safe.
class PinnedPool {
 public:
  // `count` buffers of `bytes` each (both > 0); nothing is allocated yet.
  PinnedPool(const CudaDriver* driver, size_t count, size_t bytes);
  // Every buffer must have been released.
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A free buffer of buffer_bytes(), or nullptr while all are in use. The
  // first call allocates them all, in the calling thread's current
  // context, else in GPU `device`'s primary context (made current for the
  // call only); if the driver refuses (pinned memory is limited by
  // RLIMIT_MEMLOCK and the driver), the error says so, and every later
  // call returns it.
  absl::StatusOr<uint8_t*> TryAcquire(int device = 0);
  // Gives back a buffer TryAcquire returned.
  void Release(uint8_t* buffer);

  size_t buffer_bytes() const { return bytes_; }
  size_t capacity() const { return count_; }
  size_t in_use() const;

 private:
  const CudaDriver* const driver_;
  const size_t count_;
  const size_t bytes_;
  mutable Mutex mu_;
  bool allocated_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status alloc_status_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t*> all_ ABSL_GUARDED_BY(mu_);
  std::vector<uint8_t*> free_ ABSL_GUARDED_BY(mu_);
};

// Thread-safe.
class CopyQueue {
 public:
  // Runs on the queue's thread, with the copy's outcome: OK once the bytes
  // are in place, the driver's error, or Cancelled when the queue stopped
  // first. It may queue more copies; it must not Stop the queue.
  using Done = absl::AnyInvocable<void(const absl::Status&) &&>;

  // `streams_per_device` (>= 1) streams on each device used, created on
  // first use of the device.
  CopyQueue(const CudaDriver* driver, int streams_per_device);
  // Stops the queue.
  ~CopyQueue();
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  // Starts the thread; ResourceExhausted if the system refuses one.
  absl::Status Start();

  // Queues a copy of `bytes` from host `src` to device memory `dst` on
  // `device` (resp. from device `src` to host `dst`); `done` follows. The
  // host side should be pinned (PinnedPool) for the copy to be
  // asynchronous. Both ranges must stay valid until `done` runs. Copies
  // queued one after the other may run at the same time (on different
  // streams), though their callbacks run in order: a copy that needs
  // another's bytes is queued from that one's callback.
  void ToDevice(int device, CUdeviceptr dst, const void* src, size_t bytes,
                Done done);
  void FromDevice(int device, void* dst, CUdeviceptr src, size_t bytes,
                  Done done);
  // Runs `task` on the queue's thread after what is queued before it was
  // issued (not necessarily finished). For work that must not run on the
  // caller's stack.
  void Post(absl::AnyInvocable<void() &&> task);

  // Waits for the copies in flight, then runs every callback not run yet
  // with Cancelled (those of copies that finished get OK) and joins the
  // thread. Later calls run their callback at once, with Cancelled.
  // Idempotent; not from a callback.
  void Stop();

  // Copies issued so far, and their bytes.
  uint64_t copies() const;
  uint64_t bytes() const;

 private:
  struct Op {
    enum class Kind { kToDevice, kFromDevice, kTask } kind = Kind::kTask;
    int device = -1;
    CUdeviceptr device_addr = 0;
    void* host = nullptr;
    size_t bytes = 0;
    Done done;
    absl::AnyInvocable<void() &&> task;
    CUstream stream = nullptr;  // Once issued.
    absl::Status status;        // Of issuing it.
  };

  void Enqueue(Op op);
  void Run();
  // Issues `op` on a stream of its device (the thread's current context is
  // switched to it); the status says why not.
  absl::Status Issue(Op* op);
  absl::StatusOr<CUstream> StreamFor(int device);

  const CudaDriver* const driver_;
  const int streams_per_device_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Op> queued_ ABSL_GUARDED_BY(mu_);
  uint64_t copies_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
  // The queue's thread only.
  std::vector<std::vector<CUstream>> streams_;  // By device.
  std::vector<size_t> next_stream_;             // By device.
  int current_device_ = -1;
};

}  // namespace ferry::gpu

#endif  // FERRY_GPU_STAGING_H_
