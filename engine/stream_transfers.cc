#include "engine/stream_transfers.h"

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/mutex.h"
#include "gpu/cuda_driver.h"

namespace ferry {

// Shared by the queued jobs: a job the stream reaches after Close finds
// no engine and fails instead of touching a freed one.
struct StreamTransfers::State {
  Mutex mu;
  CondVar idle;
  TransferEngine* engine ABSL_GUARDED_BY(mu) = nullptr;
  int running ABSL_GUARDED_BY(mu) = 0;
  absl::Status first_error ABSL_GUARDED_BY(mu);
  uint64_t failed ABSL_GUARDED_BY(mu) = 0;

  void Record(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (first_error.ok()) first_error = s;
    ++failed;
  }
};

struct StreamTransfers::Job {
  std::shared_ptr<State> state;
  std::vector<TransferRequest> requests;
};

StreamTransfers::StreamTransfers(TransferEngine* engine)
    : state_(std::make_shared<State>()) {
  MutexLock lock(&state_->mu);
  state_->engine = engine;
}

StreamTransfers::~StreamTransfers() { Close(); }

absl::Status StreamTransfers::Enqueue(uintptr_t stream,
                                      std::vector<TransferRequest> requests) {
  if (requests.empty()) {
    return absl::InvalidArgumentError("no request to queue on the stream");
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].length == 0 || requests[i].source == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", i, ": a null source or a zero length"));
    }
  }
  {
    MutexLock lock(&state_->mu);
    if (state_->engine == nullptr) {
      return absl::FailedPreconditionError("the engine is shut down");
    }
  }
  absl::StatusOr<const gpu::CudaDriver*> driver = gpu::CudaDriver::Get();
  if (!driver.ok()) {
    return absl::Status(
        driver.status().code(),
        absl::StrCat("transfers on a CUDA stream need a CUDA driver: ",
                     driver.status().message()));
  }
  auto* job = new Job{state_, std::move(requests)};
  absl::Status s = (*driver)->Check(
      (*driver)->api().cuLaunchHostFunc(reinterpret_cast<CUstream>(stream),
                                        &StreamTransfers::Run, job),
      "cuLaunchHostFunc");
  if (!s.ok()) delete job;
  return s;
}

void StreamTransfers::Run(void* p) {
  std::unique_ptr<Job> job(static_cast<Job*>(p));
  State& st = *job->state;
  TransferEngine* engine = nullptr;
  {
    MutexLock lock(&st.mu);
    if (st.engine == nullptr) {
      st.Record(absl::CancelledError(
          "the engine shut down before the stream reached the transfer"));
      return;
    }
    engine = st.engine;
    ++st.running;
  }
  absl::Status s;
  absl::StatusOr<BatchId> batch = engine->AllocateBatch(job->requests.size());
  if (!batch.ok()) {
    s = batch.status();
  } else {
    s = engine->SubmitTransfer(*batch, job->requests);
    if (s.ok()) {
      // Ends: each request is bounded by the engine's transfer_timeout.
      absl::StatusOr<BatchStatus> done =
          engine->WaitBatch(*batch, absl::InfiniteDuration());
      if (!done.ok()) {
        s = done.status();
      } else if (done->state != TransferState::kCompleted) {
        s = done->first_error.ok()
                ? absl::UnknownError("a stream transfer did not complete")
                : done->first_error;
      }
    }
    engine->FreeBatch(*batch).IgnoreError();
  }
  if (!s.ok()) {
    FERRY_LOG_EVERY(kError, "engine", absl::Seconds(1),
                    "a transfer queued on a CUDA stream failed (the stream "
                    "went on without its bytes): ",
                    s.ToString());
  }
  MutexLock lock(&st.mu);
  if (!s.ok()) st.Record(s);
  --st.running;
  st.idle.SignalAll();
}

absl::Status StreamTransfers::TakeError() {
  MutexLock lock(&state_->mu);
  if (state_->failed == 0) return absl::OkStatus();
  absl::Status s(state_->first_error.code(),
                 absl::StrCat(state_->failed,
                              " transfer(s) queued on CUDA streams failed; "
                              "the first: ",
                              state_->first_error.message()));
  state_->first_error = absl::OkStatus();
  state_->failed = 0;
  return s;
}

void StreamTransfers::Close() {
  MutexLock lock(&state_->mu);
  state_->engine = nullptr;
  while (state_->running > 0) state_->idle.Wait(&state_->mu);
}

}  // namespace ferry
