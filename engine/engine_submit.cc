// EngineImpl: batches, submission, slicing, completion driving and status.
//
// The submission path is built to allocate nothing and take few locks per
// request: per-thread scratch vectors keep their capacity, a batch slot
// keeps its tasks (and their slice vectors) across reuse, the target
// snapshot is looked up once per run of requests to the same segment, and
// the batch lock is taken once per call.
#include <sched.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/engine_impl.h"

namespace ferry {
namespace {

std::string Where(size_t index) {
  return absl::StrCat("request ", index, ": ");
}

// Reused by every SubmitTransfer on this thread (never re-entered: slices
// complete through the sink, which does not submit).
struct Scratch {
  std::vector<Prepared> prepared;
  std::vector<Task*> parked;
  std::vector<std::shared_ptr<const SegmentView>> views;
  std::vector<std::vector<Slice*>> per_transport;
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
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
                                 const Prepared* prev, TargetCursor* cursor,
                                 Prepared* out) {
  if (req.opcode != OpCode::kRead && req.opcode != OpCode::kWrite) {
    return absl::InvalidArgumentError(absl::StrCat(Where(index), "bad opcode"));
  }
  if (req.length == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(index), "length is zero"));
  }
  const uintptr_t src = reinterpret_cast<uintptr_t>(req.source);
  // Requests of a batch usually come from one buffer: share the previous
  // request's lease (no registry lookup, no lock).
  absl::StatusOr<MemoryRegistry::Lease> lease;
  if (prev != nullptr && prev->lease.Covers(src, req.length)) {
    lease = prev->lease.Clone();
  }
  if (!lease.ok() || !lease->held()) {
    lease = registrations_.AcquireLocal(src, req.length);
  }
  if (!lease.ok()) {
    if (options_.mr_cache_bytes > 0 ||
        lease.status().code() != absl::StatusCode::kInvalidArgument) {
      // The MR cache tried and says why it could not register the range,
      // or the range's GPU allocation was freed under its registration
      // (or the driver could not say).
      return absl::Status(lease.status().code(),
                          absl::StrCat(Where(index), lease.status().message()));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        Where(index), "local source 0x", absl::Hex(src), "+", req.length,
        " is not inside memory registered with RegisterLocalMemory"));
  }
  // The target snapshot and transport, looked up once per run of requests
  // to the same segment.
  if (cursor->view == nullptr || cursor->handle != req.target_id) {
    auto snap = segments_->Get(req.target_id);
    if (!snap.ok()) {
      return absl::Status(snap.status().code(),
                          absl::StrCat(Where(index), snap.status().message()));
    }
    cursor->fresh = snap->fresh;
    if (absl::Status s =
            cursor->Set(req.target_id, std::move(snap->view), this);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(Where(index), s.message()));
    }
  }
  if (req.target_offset + req.length < req.target_offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(index), "remote range 0x", absl::Hex(req.target_offset), "+",
        req.length, " wraps around the address space"));
  }
  const int buffer = cursor->fresh ? cursor->view->FindBufferIndex(
                                         req.target_offset, req.length)
                                   : -1;
  // Not placeable with what is cached (the peer may have registered the
  // buffer since, or a failure marked the descriptor stale): wait for a
  // fresh descriptor rather than fetch one here, on the caller's thread.
  out->park = buffer < 0;
  out->request = &req;
  out->lease = std::move(*lease);
  out->view = cursor->view;
  out->buffer = buffer;
  out->transport = cursor->transport;
  if (buffer >= 0 && !cursor->view->Reaches(cursor->view_transport, buffer)) {
    // Per buffer, not per segment: a target's GPU memory without
    // GPUDirect RDMA goes over TCP while its host memory stays on RDMA.
    out->transport = TransportFor(*cursor->view, buffer, cursor->transport);
  }
  return absl::OkStatus();
}

void EngineImpl::SliceTask(Task* task, const SegmentView* view, int buffer,
                           size_t transport, std::vector<Slice*>* out) {
  const MemoryHandle handle = task->local_lease.handle(transport);
  const size_t max_slice = slice_bytes_[transport];
  const size_t n = (task->length + max_slice - 1) / max_slice;
  task->slices.resize(n);
  task->slices_left.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  char* local = static_cast<char*>(task->source);
  for (size_t i = 0; i < n; ++i) {
    EngineSlice& s = task->slices[i];
    const size_t off = i * max_slice;
    s.op = task->op;
    s.local = local + off;
    s.remote = task->remote + off;
    s.length = std::min(max_slice, task->length - off);
    s.target = view;
    s.remote_buffer = buffer;
    s.local_handle = handle;
    s.deadline = task->deadline;
    s.sink = &sink_;
    s.next = nullptr;
    s.attempts = 0;
    s.scratch[0] = 0;
    s.scratch[1] = 0;
    s.task = task;
    out->push_back(&s);
  }
}

void EngineImpl::OnDescriptorReady(Task* task,
                                   std::shared_ptr<const SegmentView> view,
                                   const absl::Status& fetch) {
  const absl::StatusCode code = fetch.code();
  if (code == absl::StatusCode::kDeadlineExceeded ||
      code == absl::StatusCode::kCancelled ||
      code == absl::StatusCode::kFailedPrecondition || view == nullptr) {
    sink_.FailTask(task,
                   fetch.ok() ? absl::InternalError("no descriptor") : fetch);
    return;
  }
  if (code == absl::StatusCode::kNotFound) {
    sink_.FailTask(task, absl::NotFoundError(absl::StrCat(
                             "segment '", view->name(),
                             "' is no longer registered with the metadata "
                             "service (its engine stopped?): ",
                             fetch.message())));
    return;
  }
  const int buffer = view->FindBufferIndex(task->remote, task->length);
  if (buffer < 0) {
    sink_.FailTask(
        task,
        fetch.ok()
            ? absl::InvalidArgumentError(absl::StrCat(
                  "remote range 0x", absl::Hex(task->remote), "+", task->length,
                  " is not inside one remote-accessible buffer of "
                  "segment '",
                  view->name(), "' (descriptor version ", view->version(),
                  ", fetched after the request)"))
            : absl::Status(fetch.code(),
                           absl::StrCat("the remote range is not in the "
                                        "cached descriptor, and "
                                        "fetching a new one failed: ",
                                        fetch.message())));
    return;
  }
  size_t t = 0;
  while (t < transports_.size() && !Serves(*view, t)) ++t;
  if (t == transports_.size()) {
    sink_.FailTask(task, absl::FailedPreconditionError(absl::StrCat(
                             "segment '", view->name(),
                             "' serves none of this engine's transports")));
    return;
  }
  if (clock_->Now() >= task->deadline) {
    sink_.FailTask(task, absl::DeadlineExceededError(
                             "the request's deadline passed while it waited "
                             "for the target's descriptor"));
    return;
  }
  std::vector<Slice*> slices;
  {
    // The snapshot the slices point into lives as long as the batch.
    Batch* batch = task->batch;
    MutexLock lock(&batch->mu);
    batch->views.push_back(view);
  }
  t = TransportFor(*view, buffer, t);
  SliceTask(task, view.get(), buffer, t, &slices);
  task->state.store(TransferState::kPending, std::memory_order_release);
  transports_[t]->Submit(slices);
}

size_t EngineImpl::TransportFor(const SegmentView& v, int buffer,
                                size_t first) const {
  for (size_t t = first; t < transports_.size(); ++t) {
    const int vt = v.FindTransportIndex(transports_[t]->name());
    if (vt >= 0 && v.Reaches(vt, buffer) && transports_[t]->CanReach(v)) {
      return t;
    }
  }
  return first;
}

bool EngineImpl::Serves(const SegmentView& v, size_t t) const {
  return v.FindTransport(transports_[t]->name()) != nullptr &&
         transports_[t]->CanReach(v);
}

absl::Status TargetCursor::Set(SegmentHandle h,
                               std::shared_ptr<const SegmentView> v,
                               const EngineImpl* engine) {
  size_t t = 0;
  while (t < engine->transports_.size() && !engine->Serves(*v, t)) ++t;
  if (t == engine->transports_.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment '", v->name(), "' serves none of this engine's transports"));
  }
  handle = h;
  view = v.get();
  transport = t;
  view_transport = v->FindTransportIndex(engine->transports_[t]->name());
  keep->push_back(std::move(v));
  return absl::OkStatus();
}

void EngineImpl::AddTaskLocked(
    Batch* batch, Prepared* p, absl::Time deadline, std::vector<Task*>* parked,
    std::vector<std::vector<Slice*>>* per_transport) {
  Task& task = batch->AddTask();
  task.batch = batch;
  task.op = p->request->opcode;
  task.source = p->request->source;
  task.remote = p->request->target_offset;
  task.length = p->request->length;
  task.target = p->request->target_id;
  task.deadline = deadline;
  task.error = absl::OkStatus();
  task.failed_state = TransferState::kFailed;
  task.bytes_done.store(0, std::memory_order_relaxed);
  task.local_lease = std::move(p->lease);
  if (p->park) {
    task.slices_left.store(0, std::memory_order_relaxed);
    task.state.store(TransferState::kWaiting, std::memory_order_relaxed);
    parked->push_back(&task);
    return;
  }
  SliceTask(&task, p->view, p->buffer, p->transport,
            &(*per_transport)[p->transport]);
  task.state.store(TransferState::kPending, std::memory_order_relaxed);
}

absl::Status EngineImpl::SubmitTransfer(
    BatchId batch_id, absl::Span<const TransferRequest> requests) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  if (requests.empty()) return absl::OkStatus();
  Scratch& scratch = ThreadScratch();
  scratch.prepared.clear();
  scratch.views.clear();
  scratch.per_transport.resize(transports_.size());
  for (auto& v : scratch.per_transport) v.clear();
  // Validate everything before touching the batch: all or nothing. On an
  // error the leases taken so far are released with the scratch entries.
  TargetCursor cursor{&scratch.views};
  scratch.prepared.resize(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const Prepared* prev = i > 0 ? &scratch.prepared[i - 1] : nullptr;
    if (absl::Status s =
            Prepare(i, requests[i], prev, &cursor, &scratch.prepared[i]);
        !s.ok()) {
      scratch.prepared.clear();
      scratch.views.clear();
      return s;
    }
  }
  const absl::Time deadline = clock_->Now() + options_.transfer_timeout;
  {
    auto locked = batches_.LockBatch(batch_id);
    if (!locked.ok()) {
      scratch.prepared.clear();
      scratch.views.clear();
      return locked.status();
    }
    Batch* batch = &**locked;
    batch->mu.AssertHeld();
    if (batch->count + requests.size() > batch->capacity) {
      const size_t used = batch->count;
      const size_t cap = batch->capacity;
      scratch.prepared.clear();
      scratch.views.clear();
      return absl::InvalidArgumentError(
          absl::StrCat("batch has capacity ", cap, " and holds ", used,
                       " request(s); ", requests.size(), " more do not fit"));
    }
    for (auto& v : scratch.views) {
      if (batch->views.empty() || batch->views.back() != v) {
        batch->views.push_back(std::move(v));
      }
    }
    for (Prepared& p : scratch.prepared) {
      AddTaskLocked(batch, &p, deadline, &scratch.parked,
                    &scratch.per_transport);
    }
    batch->pending.fetch_add(scratch.prepared.size(),
                             std::memory_order_release);
  }
  scratch.prepared.clear();
  scratch.views.clear();
  // Outside the batch lock: transports may complete slices inline, and a
  // parked task may be handed back at once.
  for (Task* task : scratch.parked) {
    if (absl::Status s = segments_->Park(task->target, task, deadline);
        !s.ok()) {
      sink_.FailTask(task, s);
    }
  }
  scratch.parked.clear();
  for (size_t t = 0; t < transports_.size(); ++t) {
    if (!scratch.per_transport[t].empty()) {
      transports_[t]->Submit(scratch.per_transport[t]);
    }
  }
  return absl::OkStatus();
}

size_t EngineImpl::PollTransports() {
  size_t n = 0;
  for (auto& t : transports_) n += t->Poll();
  return n;
}

absl::StatusOr<TransferStatus> EngineImpl::GetTransferStatus(BatchId batch_id,
                                                             size_t index) {
  PollTransports();  // Status pollers drive completions too.
  FERRY_ASSIGN_OR_RETURN(LockedBatch locked, batches_.LockBatch(batch_id));
  Batch* batch = &*locked;
  batch->mu.AssertHeld();
  if (index >= batch->count) {
    return absl::InvalidArgumentError(
        absl::StrCat("index ", index, " is out of range: the batch holds ",
                     batch->count, " request(s)"));
  }
  return TaskStatusLocked(batch->task(index));
}

absl::StatusOr<BatchStatus> EngineImpl::GetBatchStatus(BatchId batch_id) {
  PollTransports();
  FERRY_ASSIGN_OR_RETURN(LockedBatch locked, batches_.LockBatch(batch_id));
  return SummarizeLocked(*locked);
}

void EngineImpl::DriveUntilDone(Batch* batch, absl::Time deadline) {
  if (options_.wait_spin <= absl::ZeroDuration()) return;
  // Reap completions here while they keep coming; give up after wait_spin
  // without any. The clock is read only every few idle polls. wait_spin
  // is a budget of CPU time, so it runs on the system clock whatever the
  // engine's: on a SimulatedClock the spin would never end, and WaitBatch
  // never reach the timed wait that a test's Advance ends. The deadline
  // is the engine clock's (one read when the two are the same).
  Clock* const spin_clock = RealClock();
  constexpr int kClockEvery = 32;
  constexpr int kYieldEvery = 8;
  int idle = 0;
  absl::Time idle_since = absl::InfiniteFuture();
  while (batch->pending.load(std::memory_order_acquire) != 0) {
    if (PollTransports() > 0) {
      idle = 0;
      idle_since = absl::InfiniteFuture();
      continue;
    }
    ++idle;
    // Other threads (transport receivers, a peer process on this core)
    // may be what we wait for.
    if (idle % kYieldEvery == 0) sched_yield();
    if (idle % kClockEvery != 0) continue;
    const absl::Time now = spin_clock->Now();
    if ((clock_ == spin_clock ? now : clock_->Now()) >= deadline) return;
    if (idle_since == absl::InfiniteFuture()) {
      idle_since = now;
    } else if (now - idle_since >= options_.wait_spin) {
      return;
    }
  }
}

absl::StatusOr<BatchStatus> EngineImpl::WaitBatch(BatchId batch_id,
                                                  absl::Duration timeout) {
  const absl::Time deadline = clock_->Now() + timeout;
  Batch* batch;
  {
    FERRY_ASSIGN_OR_RETURN(LockedBatch locked, batches_.LockBatch(batch_id));
    batch = &*locked;
    if (batch->pending.load(std::memory_order_acquire) == 0) {
      return SummarizeLocked(*batch);
    }
  }
  // Not under the batch lock: completions take it to record failures.
  // The slot outlives any id, so `batch` stays a valid object; LockBatch
  // below re-checks the id.
  DriveUntilDone(batch, deadline);
  FERRY_ASSIGN_OR_RETURN(LockedBatch locked, batches_.LockBatch(batch_id));
  batch->mu.AssertHeld();
  while (batch->pending.load(std::memory_order_acquire) != 0) {
    if (clock_->WaitWithDeadline(&batch->done_cv, &batch->mu, deadline)) {
      if (const size_t left = batch->pending.load(); left != 0) {
        return absl::DeadlineExceededError(absl::StrCat(
            left, " of ", batch->count, " request(s) still in flight after ",
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
