// GpuStaging: an initiator's path for slices whose local memory is on a
// GPU that the transport's data path cannot reach: TCP's sockets (the CPU
// reads and writes, which device memory refuses), or a NIC without
// GPUDirect RDMA (no dma-buf, no nvidia-peermem). Each such slice moves
// through a pinned host buffer:
//
//   WRITE: device --copy--> buffer --wire--> target
//   READ:  target --wire--> buffer --copy--> device
//
// A slice takes one buffer for its whole life; the buffers (`buffers` of
// the transport's largest slice each, allocated at the first GPU
// registration) are the bound on the memory the path uses. Slices beyond
// them wait, in order, for one to come free; one whose deadline passed
// meanwhile fails then, without a copy (DeadlineExceeded), so a wait is
// bounded by the deadlines of the slices holding the buffers. Copies run
// on the staging queue's own streams and thread (gpu/staging.h), so while
// one slice is copied, those before it are on the wire.
//
// The transport moves the buffer's bytes as host memory, on its own path
// (StagingPath). A copy that fails completes its slice with the driver's
// error; a slice never completes before its bytes are in place (a READ:
// in device memory).
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_GPU_STAGING_H_
#define FERRY_TRANSPORT_GPU_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "gpu/staging.h"
#include "transport/transport.h"

namespace ferry {

// What a transport gives GpuStaging: its own path for host memory.
class StagingPath {
 public:
  virtual ~StagingPath() = default;
  // Moves `slice`, whose local memory is one of the staging buffers, as
  // host memory, and completes it through its sink.
  virtual void SubmitStaged(Slice* slice) = 0;
  // Registers staging buffer [buffer, buffer + bytes) (pinned host memory)
  // with the transport; the handle goes into the slices of that buffer.
  // Called once per buffer when staging sets up, under its lock.
  virtual absl::StatusOr<MemoryHandle> RegisterStagingBuffer(uint8_t* buffer,
                                                             size_t bytes) {
    return nullptr;
  }
  // Undoes RegisterStagingBuffer, when staging is destroyed.
  virtual void UnregisterStagingBuffer(uint8_t* buffer) {}
};

class GpuStaging {
 public:
  struct Counters {
    uint64_t slices = 0;  // Staged slices submitted.
    uint64_t waits = 0;   // Of those, waited for a free buffer.
    uint64_t copies = 0;  // Device<->host copies issued.
    uint64_t copy_bytes = 0;
  };

  // `path` and `clock` must outlive this object. `buffers` >= 1.
  // `transport` ("TCP") and `buffers_option` ("tcp.staging_buffers") name
  // them in errors.
  GpuStaging(StagingPath* path, std::string transport,
             std::string buffers_option, size_t buffers, size_t buffer_bytes,
             Clock* clock = RealClock());
  ~GpuStaging();
  GpuStaging(const GpuStaging&) = delete;
  GpuStaging& operator=(const GpuStaging&) = delete;

  // Sets up what staging needs on first use -- the driver, the pinned
  // buffers (in GPU `device`'s context), the copy queue -- so that Submit
  // makes no CUDA call: it may run where CUDA forbids them (a host
  // function on a stream, engine/stream_transfers.h). Called when a GPU
  // buffer is registered, on the registering thread; an error (no driver,
  // no pinned memory) fails that registration. A failure is not kept: the
  // next call tries again.
  absl::Status Prepare(int device);

  // For a transport whose handles of host memory are null (tcp, shm):
  // Prepare(device) for a GPU buffer being registered, and the handle
  // that names its device to DeviceOf. InvalidArgument beyond GPU 63;
  // Prepare's error, saying the transport cannot stage, otherwise.
  absl::StatusOr<MemoryHandle> PrepareHandle(int device);
  // The GPU a handle from PrepareHandle names; -1 for any other handle.
  static int DeviceOf(MemoryHandle handle);

  // Moves `slice`, whose local range is device memory of GPU `device`
  // (at most buffer_bytes long), and completes it through its sink.
  // Makes no CUDA call.
  void Submit(Slice* slice, int device);

  // For the deadlines of waiting slices; set before the first Submit.
  void SetClock(Clock* clock) { clock_ = clock; }

  // Completes every slice not on the wire with Cancelled and stops the
  // copies; those that finish go on to the path, which must cancel them
  // (it is shutting down). Idempotent.
  void Stop();

  Counters counters() const;
  // Copies counters() into the transport's stats.
  void AddStats(TransportStats* stats) const;

 private:
  // One pinned buffer and the slice using it. The slot is the sink of
  // the slice it hands to the path (the "shadow": the slice's op and
  // target, with the buffer as its local memory).
  struct Slot : SliceSink {
    GpuStaging* owner = nullptr;
    uint8_t* buffer = nullptr;
    MemoryHandle handle = nullptr;  // The path's, for the buffer.
    Slice* slice = nullptr;         // The engine's.
    int device = -1;
    Slice shadow;
    void OnSliceDone(Slice* shadow, const absl::Status& status) override;
  };
  struct Waiting {
    Slice* slice;
    int device;
  };

  absl::Status ShutDown() const;
  // Sets up the pool, the queue and the slots.
  absl::Status Init(int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Start(Slot* slot);
  // The slot's slice ends with `status`; the slot goes to the next waiting
  // slice, if any, or back to the free list.
  void Finish(Slot* slot, const absl::Status& status);

  StagingPath* const path_;
  const std::string transport_;
  const std::string buffers_option_;
  const size_t buffers_;
  const size_t buffer_bytes_;
  Clock* clock_;
  mutable Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<gpu::PinnedPool> pool_;  // Set once, under mu_.
  std::unique_ptr<gpu::CopyQueue> queue_;  // Set once, under mu_.
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot*> free_ ABSL_GUARDED_BY(mu_);
  std::deque<Waiting> waiting_ ABSL_GUARDED_BY(mu_);
  uint64_t slices_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t waits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_GPU_STAGING_H_
