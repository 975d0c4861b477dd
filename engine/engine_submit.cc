// EngineImpl: batches, submission, slicing and status.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"

namespace ferry {
namespace {

std::string Where(size_t index) {
  return absl::StrCat("request ", index, ": ");
}

}  // namespace

absl::StatusOr<BatchId> EngineImpl::AllocateBatch(size_t capacity) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  if (capacity == 0 || capacity > options_.max_batch_capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch capacity ", capacity, " is outside 1..",
                     options_.max_batch_capacity));
  }
  return batches_.Allocate(capacity);
}

absl::Status EngineImpl::Prepare(size_t index, const TransferRequest& req,
                                 Prepared* out) {
  if (req.opcode != OpCode::kRead && req.opcode != OpCode::kWrite) {
    return absl::InvalidArgumentError(absl::StrCat(Where(index), "bad opcode"));
  }
  if (req.length == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(index), "length is zero"));
  }
  const uintptr_t src = reinterpret_cast<uintptr_t>(req.source);
  auto lease = AcquireLocal(src, req.length);
  if (!lease.ok()) {
    if (options_.mr_cache_bytes > 0) {
      // The MR cache tried and says why it could not register the range.
      return absl::Status(lease.status().code(),
                          absl::StrCat(Where(index), lease.status().message()));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        Where(index), "local source 0x", absl::Hex(src), "+", req.length,
        " is not inside memory registered with RegisterLocalMemory"));
  }
  auto view = segments_->Get(req.target_id);
  if (!view.ok()) {
    return absl::Status(view.status().code(),
                        absl::StrCat(Where(index), view.status().message()));
  }
  if ((*view)->FindBuffer(req.target_offset, req.length) == nullptr) {
    // The peer may have registered the buffer after we cached its
    // descriptor: look once more before failing.
    auto fresh = segments_->Refresh(req.target_id);
    if (fresh.ok()) view = std::move(fresh);
    if ((*view)->FindBuffer(req.target_offset, req.length) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(index), "remote range 0x", absl::Hex(req.target_offset), "+",
          req.length,
          " is not inside one remote-accessible buffer of segment '",
          (*view)->name(), "'"));
    }
  }
  for (size_t t = 0; t < transports_.size(); ++t) {
    if ((*view)->FindTransport(transports_[t]->name()) != nullptr) {
      out->request = &req;
      out->lease = std::move(*lease);
      out->target = std::move(*view);
      out->transport = t;
      return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError(
      absl::StrCat(Where(index), "segment '", (*view)->name(),
                   "' serves none of this engine's transports"));
}

absl::Status EngineImpl::SubmitTransfer(
    BatchId batch_id, absl::Span<const TransferRequest> requests) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  if (requests.empty()) return absl::OkStatus();
  // Validate everything before touching the batch: all or nothing.
  std::vector<Prepared> prepared(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (absl::Status s = Prepare(i, requests[i], &prepared[i]); !s.ok()) {
      return s;
    }
  }
  std::vector<std::vector<Slice*>> per_transport(transports_.size());
  const absl::Time deadline = absl::Now() + options_.transfer_timeout;
  {
    auto locked = batches_.LockBatch(batch_id);
    if (!locked.ok()) return locked.status();
    Batch* batch = &**locked;
    if (batch->tasks.size() + requests.size() > batch->capacity) {
      size_t used = batch->tasks.size();
      size_t cap = batch->capacity;
      return absl::InvalidArgumentError(
          absl::StrCat("batch has capacity ", cap, " and holds ", used,
                       " request(s); ", requests.size(), " more do not fit"));
    }
    for (Prepared& p : prepared) {
      Task& task = batch->tasks.emplace_back();
      task.batch = batch;
      task.length = p.request->length;
      task.local_lease = std::move(p.lease);
      task.target = std::move(p.target);
      const size_t max_slice = transports_[p.transport]->max_slice_bytes();
      const size_t n = (task.length + max_slice - 1) / max_slice;
      task.slices.resize(n);
      task.slices_left.store(static_cast<uint32_t>(n),
                             std::memory_order_relaxed);
      char* local = static_cast<char*>(p.request->source);
      for (size_t i = 0; i < n; ++i) {
        EngineSlice& s = task.slices[i];
        const size_t off = i * max_slice;
        s.op = p.request->opcode;
        s.local = local + off;
        s.remote = p.request->target_offset + off;
        s.length = std::min(max_slice, task.length - off);
        s.target = task.target.get();
        s.deadline = deadline;
        s.sink = &sink_;
        s.task = &task;
        per_transport[p.transport].push_back(&s);
      }
      task.state.store(TransferState::kPending, std::memory_order_relaxed);
    }
  }
  // Outside the batch lock: transports may complete slices inline.
  for (size_t t = 0; t < transports_.size(); ++t) {
    if (!per_transport[t].empty()) transports_[t]->Submit(per_transport[t]);
  }
  return absl::OkStatus();
}

absl::StatusOr<TransferStatus> EngineImpl::GetTransferStatus(BatchId batch_id,
                                                             size_t index) {
  auto locked = batches_.LockBatch(batch_id);
  if (!locked.ok()) return locked.status();
  Batch* batch = &**locked;
  if (index >= batch->tasks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("index ", index, " is out of range: the batch holds ",
                     batch->tasks.size(), " request(s)"));
  }
  return TaskStatusLocked(batch->tasks[index]);
}

absl::StatusOr<BatchStatus> EngineImpl::GetBatchStatus(BatchId batch_id) {
  auto locked = batches_.LockBatch(batch_id);
  if (!locked.ok()) return locked.status();
  Batch* batch = &**locked;
  return SummarizeLocked(*batch);
}

absl::StatusOr<BatchStatus> EngineImpl::WaitBatch(BatchId batch_id,
                                                  absl::Duration timeout) {
  auto locked = batches_.LockBatch(batch_id);
  if (!locked.ok()) return locked.status();
  Batch* batch = &**locked;
  const absl::Time deadline = absl::Now() + timeout;
  while (batch->done < batch->tasks.size()) {
    if (batch->done_cv.WaitWithDeadline(&batch->mu, deadline)) {
      if (batch->done < batch->tasks.size()) {
        return absl::DeadlineExceededError(absl::StrCat(
            batch->tasks.size() - batch->done, " of ", batch->tasks.size(),
            " request(s) still in flight after ",
            absl::FormatDuration(timeout)));
      }
    }
  }
  return SummarizeLocked(*batch);
}

absl::Status EngineImpl::FreeBatch(BatchId batch_id) {
  return batches_.Free(batch_id);
}

}  // namespace ferry
