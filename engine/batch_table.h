// Batches and the tasks (requests) inside them, and the table that turns
// BatchIds into batches safely.
//
// A BatchId is (generation << 32) | (slot + 1). Slots are never freed, only
// reused with a new generation, so a stale or forged id can always be
// checked against its slot without touching freed memory. A slot keeps its
// task array (and each task its slice vector) across reuse, so a steady
// stream of batches allocates nothing.
//
// Locking: BatchTable::mu_ guards the slot list; each Batch::mu guards that
// batch's bookkeeping. Completion is lock-free in the common case: task
// and batch counters are atomics written by whichever thread completes a
// slice; the batch lock is taken only to record a failure or to wake a
// waiter after the batch's last task.
#ifndef FERRY_ENGINE_BATCH_TABLE_H_
#define FERRY_ENGINE_BATCH_TABLE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "ferry/transfer_engine.h"
#include "transport/memory_registry.h"
#include "transport/segment_view.h"
#include "transport/transport.h"

namespace ferry {

struct Batch;
struct Task;

// A Slice that knows its task.
struct EngineSlice : Slice {
  Task* task = nullptr;
};

struct Task {
  Batch* batch = nullptr;
  // The request, kept for one that waits for a descriptor (kWaiting) and
  // is sliced only once it came.
  OpCode op = OpCode::kRead;
  void* source = nullptr;
  uint64_t remote = 0;
  size_t length = 0;
  SegmentHandle target = 0;
  absl::Time deadline = absl::InfiniteFuture();
  std::atomic<uint32_t> slices_left{0};
  std::atomic<uint64_t> bytes_done{0};
  std::atomic<TransferState> state{TransferState::kWaiting};
  // First failure; written once under batch->mu, read after the task is
  // done (its last slice's release of slices_left orders it).
  absl::Status error;
  TransferState failed_state = TransferState::kFailed;
  std::vector<EngineSlice> slices;
  // Keeps the local buffer registered while slices are in flight;
  // released when the task finishes.
  MemoryRegistry::Lease local_lease;
};

struct Batch {
  Mutex mu;
  CondVar done_cv;
  uint32_t generation ABSL_GUARDED_BY(mu) = 1;
  bool in_use ABSL_GUARDED_BY(mu) = false;
  size_t capacity ABSL_GUARDED_BY(mu) = 0;
  // Tasks [0, count) are submitted. They live in chunks that are added as
  // requests come (never all of `capacity` up front) and kept across
  // reuse; a task's address never changes (slices point at it).
  static constexpr size_t kTaskChunk = 64;
  std::vector<std::unique_ptr<Task[]>> chunks ABSL_GUARDED_BY(mu);
  size_t count ABSL_GUARDED_BY(mu) = 0;
  Task& task(size_t i) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return chunks[i / kTaskChunk][i % kTaskChunk];
  }
  const Task& task(size_t i) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return chunks[i / kTaskChunk][i % kTaskChunk];
  }
  // The next task, adding a chunk if needed.
  Task& AddTask() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (count == chunks.size() * kTaskChunk) {
      chunks.emplace_back(new Task[kTaskChunk]);
    }
    return task(count++);
  }
  // Submitted tasks not finished yet.
  std::atomic<size_t> pending{0};
  // Target snapshots the slices point into, kept until the batch is freed.
  std::vector<std::shared_ptr<const SegmentView>> views ABSL_GUARDED_BY(mu);
};

class SegmentCache;

// Completes slices: accounts bytes, records the first error, finishes the
// task after its last slice, wakes waiters after the batch's last task. A
// request that failed because the target refused it, restarted or could
// not be reached marks the target's cached descriptor stale, so the next
// submission sees the target's current buffers and incarnation.
class TaskSink final : public SliceSink {
 public:
  void set_segments(SegmentCache* segments) { segments_ = segments; }
  void OnSliceDone(Slice* slice, const absl::Status& status) override;
  // One atomic decrement of the batch's pending count per batch in the
  // group, and none per slice for single-slice tasks.
  void OnSlicesDone(Slice* const* slices, size_t n) override;
  // Ends a task that has no slice in flight (it never got any) with
  // `status`: TIMEOUT for DeadlineExceeded, FAILED otherwise.
  void FailTask(Task* task, const absl::Status& status);

 private:
  // Finishes a task whose last slice completed; moves its lease to
  // *lease, to be released after TasksDone.
  static void FinishTask(Task* task, MemoryRegistry::Lease* lease);
  // Takes `n` finished tasks off the batch's pending count.
  static void TasksDone(Batch* batch, size_t n);

  SegmentCache* segments_ = nullptr;
};

// A batch whose mutex is held; unlocks on destruction.
class LockedBatch {
 public:
  explicit LockedBatch(Batch* batch) : batch_(batch) {}
  LockedBatch(LockedBatch&& other) noexcept : batch_(other.batch_) {
    other.batch_ = nullptr;
  }
  LockedBatch& operator=(LockedBatch&&) = delete;
  ~LockedBatch() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (batch_ != nullptr) batch_->mu.Unlock();
  }
  Batch* operator->() const { return batch_; }
  Batch& operator*() const { return *batch_; }

 private:
  Batch* batch_;
};

class BatchTable {
 public:
  static constexpr size_t kMaxSlots = 1 << 20;

  // A new batch, or ResourceExhausted when kMaxSlots batches are allocated.
  absl::StatusOr<BatchId> Allocate(size_t capacity);

  // Locks and returns the batch of `id`, or InvalidArgument (stale, freed
  // or forged id).
  absl::StatusOr<LockedBatch> LockBatch(BatchId id)
      ABSL_NO_THREAD_SAFETY_ANALYSIS;

  // The batch of `id` without locking it, for reading its atomics; it may
  // be freed and reused meanwhile (recheck with LockBatch). InvalidArgument
  // for an id that was never valid.
  absl::StatusOr<Batch*> Peek(BatchId id);

  // Frees the batch; FailedPrecondition while tasks are in flight.
  absl::Status Free(BatchId id);

 private:
  Mutex mu_;
  std::vector<std::unique_ptr<Batch>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);
};

// Summarizes a locked batch.
BatchStatus SummarizeLocked(const Batch& batch) ABSL_NO_THREAD_SAFETY_ANALYSIS;
TransferStatus TaskStatusLocked(const Task& task)
    ABSL_NO_THREAD_SAFETY_ANALYSIS;

}  // namespace ferry

#endif  // FERRY_ENGINE_BATCH_TABLE_H_
