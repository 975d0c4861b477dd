#include "engine/batch_table.h"

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "engine/segment_cache.h"

namespace ferry {
namespace {

constexpr uint64_t kSlotMask = 0xffffffffu;

BatchId MakeId(uint32_t generation, uint32_t slot) {
  return (static_cast<uint64_t>(generation) << 32) | (slot + 1);
}

absl::Status BadId(BatchId id, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("batch id 0x", absl::Hex(id), " is ", why));
}

}  // namespace

void TaskSink::FinishTask(Task* task, MemoryRegistry::Lease* lease) {
  task->state.store(
      task->error.ok() ? TransferState::kCompleted : task->failed_state,
      std::memory_order_release);
  // Taken out now, released only after the batch's pending count dropped:
  // once that count is zero the batch may be freed and its tasks reused,
  // and whoever waited for the buffer (UnregisterLocalMemory) must find
  // the batch finished, freeable.
  *lease = std::move(task->local_lease);
}

void TaskSink::TasksDone(Batch* batch, size_t n) {
  if (batch->pending.fetch_sub(n, std::memory_order_acq_rel) == n) {
    // Waiters check `pending` under the lock before they sleep, so taking
    // it here means none can miss this.
    MutexLock lock(&batch->mu);
    batch->done_cv.SignalAll();
  }
}

void TaskSink::FailTask(Task* task, const absl::Status& status) {
  Batch* batch = task->batch;
  {
    MutexLock lock(&batch->mu);
    task->error = status;
    task->failed_state = status.code() == absl::StatusCode::kDeadlineExceeded
                             ? TransferState::kTimeout
                             : TransferState::kFailed;
  }
  MemoryRegistry::Lease lease;
  FinishTask(task, &lease);
  TasksDone(batch, 1);
}

void TaskSink::OnSliceDone(Slice* slice, const absl::Status& status) {
  Task* task = static_cast<EngineSlice*>(slice)->task;
  Batch* batch = task->batch;
  if (status.ok()) {
    task->bytes_done.fetch_add(slice->length, std::memory_order_relaxed);
  } else {
    // Refused (InvalidArgument), addressed to an earlier run of the target
    // (FailedPrecondition), sent with a key the buffer no longer has
    // (PermissionDenied: registered again since) or unreachable
    // (Unavailable: it may have moved or restarted): the next submission
    // re-reads its descriptor.
    const absl::StatusCode code = status.code();
    if (segments_ != nullptr &&
        (code == absl::StatusCode::kInvalidArgument ||
         code == absl::StatusCode::kFailedPrecondition ||
         code == absl::StatusCode::kPermissionDenied ||
         code == absl::StatusCode::kUnavailable)) {
      segments_->MarkStale(task->target);
    }
    MutexLock lock(&batch->mu);
    if (task->error.ok()) {
      task->error = status;
      task->failed_state = status.code() == absl::StatusCode::kDeadlineExceeded
                               ? TransferState::kTimeout
                               : TransferState::kFailed;
    }
  }
  if (task->slices_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  // Last slice: the task is done.
  MemoryRegistry::Lease lease;
  FinishTask(task, &lease);
  TasksDone(batch, 1);
}

void TaskSink::OnSlicesDone(Slice* const* slices, size_t n) {
  Batch* batch = nullptr;
  size_t finished = 0;
  // Released when this returns, after the pending counts dropped.
  absl::InlinedVector<MemoryRegistry::Lease, 32> leases;
  for (size_t i = 0; i < n; ++i) {
    Task* task = static_cast<EngineSlice*>(slices[i])->task;
    if (task->slices.size() == 1) {
      // Its only slice: no other thread touches the counters.
      task->bytes_done.store(slices[i]->length, std::memory_order_relaxed);
    } else {
      task->bytes_done.fetch_add(slices[i]->length, std::memory_order_relaxed);
      if (task->slices_left.fetch_sub(1, std::memory_order_acq_rel) != 1) {
        continue;
      }
    }
    if (task->batch != batch) {
      if (finished > 0) TasksDone(batch, finished);
      batch = task->batch;
      finished = 0;
    }
    FinishTask(task, &leases.emplace_back());
    ++finished;
  }
  if (finished > 0) TasksDone(batch, finished);
}

absl::StatusOr<BatchId> BatchTable::Allocate(size_t capacity) {
  Batch* batch = nullptr;
  uint32_t slot = 0;
  {
    MutexLock lock(&mu_);
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      if (slots_.size() >= kMaxSlots) {
        return absl::ResourceExhaustedError(
            absl::StrCat(kMaxSlots, " batches are allocated; free some first"));
      }
      slot = static_cast<uint32_t>(slots_.size());
      slots_.push_back(std::make_unique<Batch>());
    }
    batch = slots_[slot].get();
  }
  MutexLock lock(&batch->mu);
  batch->in_use = true;
  batch->capacity = capacity;
  batch->count = 0;
  return MakeId(batch->generation, slot);
}

absl::StatusOr<LockedBatch> BatchTable::LockBatch(BatchId id) {
  uint64_t slot_plus_one = id & kSlotMask;
  Batch* batch = nullptr;
  {
    MutexLock lock(&mu_);
    if (slot_plus_one == 0 || slot_plus_one > slots_.size()) {
      return BadId(id, "not a batch of this engine");
    }
    batch = slots_[slot_plus_one - 1].get();
  }
  batch->mu.Lock();
  if (!batch->in_use || batch->generation != (id >> 32)) {
    batch->mu.Unlock();
    return BadId(id, "stale: the batch was freed");
  }
  return LockedBatch(batch);
}

absl::StatusOr<Batch*> BatchTable::Peek(BatchId id) {
  uint64_t slot_plus_one = id & kSlotMask;
  MutexLock lock(&mu_);
  if (slot_plus_one == 0 || slot_plus_one > slots_.size()) {
    return BadId(id, "not a batch of this engine");
  }
  return slots_[slot_plus_one - 1].get();
}

absl::Status BatchTable::Free(BatchId id) {
  uint32_t slot = 0;
  {
    auto batch = LockBatch(id);
    if (!batch.ok()) return batch.status();
    (*batch)->mu.AssertHeld();
    if (size_t in_flight = (*batch)->pending.load(); in_flight != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("batch 0x", absl::Hex(id), " has ", in_flight,
                       " request(s) in flight; wait for them before freeing"));
    }
    (*batch)->in_use = false;
    // Generation 0 is never issued, so wrap-around skips it.
    if (++(*batch)->generation == 0) (*batch)->generation = 1;
    (*batch)->count = 0;
    (*batch)->views.clear();
    slot = static_cast<uint32_t>((id & kSlotMask) - 1);
  }
  MutexLock lock(&mu_);
  free_.push_back(slot);
  return absl::OkStatus();
}

TransferStatus TaskStatusLocked(const Task& task) {
  TransferStatus st;
  st.state = task.state.load(std::memory_order_acquire);
  st.transferred_bytes = task.bytes_done.load(std::memory_order_relaxed);
  if (st.state == TransferState::kFailed ||
      st.state == TransferState::kTimeout) {
    st.error = task.error;
  }
  return st;
}

BatchStatus SummarizeLocked(const Batch& batch) {
  BatchStatus bs;
  bs.total = batch.count;
  for (size_t i = 0; i < batch.count; ++i) {
    TransferStatus st = TaskStatusLocked(batch.task(i));
    bs.transferred_bytes += st.transferred_bytes;
    if (st.state == TransferState::kCompleted) {
      ++bs.completed;
    } else if (st.state == TransferState::kFailed ||
               st.state == TransferState::kTimeout) {
      if (bs.failed++ == 0) {
        bs.first_error = st.error;
        bs.state = st.state;
      }
    }
  }
  if (bs.completed + bs.failed < bs.total) {
    bs.state = TransferState::kPending;
  } else if (bs.failed == 0) {
    bs.state = TransferState::kCompleted;
  }
  return bs;
}

}  // namespace ferry
