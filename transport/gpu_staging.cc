#include "transport/gpu_staging.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_driver.h"

namespace ferry {
namespace {

// Streams per GPU: enough that the copies of the slices in flight do not
// queue behind each other on one stream.
constexpr int kStreamsPerDevice = 4;

absl::Status Staged(const absl::Status& s, const char* what) {
  return absl::Status(
      s.code(), absl::StrCat("staging GPU memory through host memory (", what,
                             "): ", s.message()));
}

// What PrepareHandle hands out: one address per GPU, the same for every
// transport (only a null handle or one of these reaches DeviceOf).
constexpr int kMaxGpus = 64;
const char kDeviceTags[kMaxGpus] = {};

}  // namespace

absl::StatusOr<MemoryHandle> GpuStaging::PrepareHandle(int device) {
  if (device < 0 || device >= kMaxGpus) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", transport_, " transport stages GPUs 0..",
                     kMaxGpus - 1, ", not cuda:", device));
  }
  // Here, on the registering thread, so that moving the buffer later makes
  // no CUDA call (a transfer may run in a stream's host function).
  if (absl::Status s = Prepare(device); !s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("the ", transport_,
                               " transport cannot stage GPU memory through "
                               "host memory: ",
                               s.message()));
  }
  return &kDeviceTags[device];
}

int GpuStaging::DeviceOf(MemoryHandle handle) {
  const char* p = static_cast<const char*>(handle);
  if (p < kDeviceTags || p >= kDeviceTags + kMaxGpus) return -1;
  return static_cast<int>(p - kDeviceTags);
}

void GpuStaging::AddStats(TransportStats* st) const {
  const Counters g = counters();
  st->staged_slices = g.slices;
  st->staging_waits = g.waits;
  st->staging_copies = g.copies;
  st->staging_copy_bytes = g.copy_bytes;
}

GpuStaging::GpuStaging(StagingPath* path, std::string transport,
                       std::string buffers_option, size_t buffers,
                       size_t buffer_bytes, Clock* clock)
    : path_(path),
      transport_(std::move(transport)),
      buffers_option_(std::move(buffers_option)),
      buffers_(buffers),
      buffer_bytes_(buffer_bytes),
      clock_(clock) {}

GpuStaging::~GpuStaging() {
  Stop();
  MutexLock lock(&mu_);
  for (auto& slot : slots_) {
    path_->UnregisterStagingBuffer(slot->buffer);
    pool_->Release(slot->buffer);
  }
}

absl::Status GpuStaging::Prepare(int device) {
  MutexLock lock(&mu_);
  if (stopped_) return ShutDown();
  return Init(device);
}

absl::Status GpuStaging::Init(int device) {
  if (initialized_) return absl::OkStatus();
  // The engine classified the buffer as device memory, so the process has
  // a driver.
  absl::StatusOr<const gpu::CudaDriver*> driver = gpu::CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  auto pool =
      std::make_unique<gpu::PinnedPool>(*driver, buffers_, buffer_bytes_);
  std::vector<uint8_t*> buffers;
  for (size_t i = 0; i < buffers_; ++i) {
    absl::StatusOr<uint8_t*> b = pool->TryAcquire(device);
    if (!b.ok()) return b.status();  // The pool frees what it pinned.
    buffers.push_back(*b);
  }
  std::vector<MemoryHandle> handles;
  auto undo = [&] {
    for (size_t i = 0; i < handles.size(); ++i) {
      path_->UnregisterStagingBuffer(buffers[i]);
    }
    for (uint8_t* b : buffers) pool->Release(b);
  };
  for (uint8_t* b : buffers) {
    absl::StatusOr<MemoryHandle> h =
        path_->RegisterStagingBuffer(b, buffer_bytes_);
    if (!h.ok()) {
      undo();
      return h.status();
    }
    handles.push_back(*h);
  }
  auto queue = std::make_unique<gpu::CopyQueue>(*driver, kStreamsPerDevice);
  if (absl::Status s = queue->Start(); !s.ok()) {
    undo();
    return s;
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto slot = std::make_unique<Slot>();
    slot->owner = this;
    slot->buffer = buffers[i];
    slot->handle = handles[i];
    free_.push_back(slot.get());
    slots_.push_back(std::move(slot));
  }
  pool_ = std::move(pool);
  queue_ = std::move(queue);
  initialized_ = true;
  return absl::OkStatus();
}

void GpuStaging::Submit(Slice* slice, int device) {
  Slot* slot = nullptr;
  absl::Status refused;
  {
    MutexLock lock(&mu_);
    if (stopped_) {
      refused = ShutDown();
    } else if (!initialized_) {
      refused = absl::FailedPreconditionError(
          "GPU staging is not set up: the buffer was not registered with "
          "this transport");
    } else if (slice->length > buffer_bytes_) {
      refused = absl::InvalidArgumentError(
          absl::StrCat("a staged slice may be at most ", buffer_bytes_,
                       " bytes, not ", slice->length));
    } else {
      ++slices_;
      if (!free_.empty() && waiting_.empty()) {
        slot = free_.back();
        free_.pop_back();
        slot->slice = slice;
        slot->device = device;
      } else {
        ++waits_;
        waiting_.push_back({slice, device});
      }
    }
  }
  if (!refused.ok()) return slice->Complete(Staged(refused, "not started"));
  if (slot != nullptr) Start(slot);
}

void GpuStaging::Start(Slot* slot) {
  const Slice& s = *slot->slice;
  Slice& shadow = slot->shadow;
  shadow = Slice();
  shadow.op = s.op;
  shadow.local = slot->buffer;
  shadow.local_handle = slot->handle;
  shadow.remote = s.remote;
  shadow.length = s.length;
  shadow.target = s.target;
  shadow.remote_buffer = s.remote_buffer;
  shadow.deadline = s.deadline;
  shadow.sink = slot;
  const auto device_addr = reinterpret_cast<CUdeviceptr>(s.local);
  if (s.op == OpCode::kWrite) {
    queue_->FromDevice(slot->device, slot->buffer, device_addr, s.length,
                       [this, slot](const absl::Status& st) {
                         if (!st.ok()) {
                           return Finish(slot, Staged(st, "device to host"));
                         }
                         path_->SubmitStaged(&slot->shadow);
                       });
  } else {
    path_->SubmitStaged(&shadow);
  }
}

void GpuStaging::Slot::OnSliceDone(Slice*, const absl::Status& status) {
  if (!status.ok() || slice->op == OpCode::kWrite) {
    return owner->Finish(this, status);
  }
  // The READ's bytes are in the buffer: they reach the device, and only
  // then does the slice complete.
  owner->queue_->ToDevice(
      device, reinterpret_cast<CUdeviceptr>(slice->local), buffer,
      slice->length, [this](const absl::Status& st) {
        owner->Finish(this, st.ok() ? st : Staged(st, "host to device"));
      });
}

void GpuStaging::Finish(Slot* slot, const absl::Status& status) {
  Slice* done = slot->slice;
  bool next = false;
  std::vector<Slice*> expired;
  {
    MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    // Those whose deadline passed while they waited end here, uncopied.
    while (!waiting_.empty() && waiting_.front().slice->deadline <= now) {
      expired.push_back(waiting_.front().slice);
      waiting_.pop_front();
    }
    if (!waiting_.empty()) {
      slot->slice = waiting_.front().slice;
      slot->device = waiting_.front().device;
      waiting_.pop_front();
      next = true;
    } else {
      slot->slice = nullptr;
      free_.push_back(slot);
    }
  }
  done->Complete(status);
  for (Slice* s : expired) {
    s->Complete(absl::DeadlineExceededError(absl::StrCat(
        transport_,
        " slice of GPU memory waited for a staging buffer past its "
        "deadline (every buffer was in use: ",
        buffers_option_, ")")));
  }
  // On the queue's thread: a slice that fails at once on the path (a
  // backed-off peer) must not start the next one on this stack, and so
  // on through the whole queue.
  if (next) queue_->Post([this, slot] { Start(slot); });
}

void GpuStaging::Stop() {
  std::deque<Waiting> waiting;
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    waiting.swap(waiting_);
  }
  for (const Waiting& w : waiting) w.slice->Complete(ShutDown());
  // Runs the callbacks of the copies in flight; their slices complete
  // (the path, shutting down, cancels those that would go on to the wire).
  gpu::CopyQueue* queue = nullptr;
  {
    MutexLock lock(&mu_);
    queue = queue_.get();
  }
  if (queue != nullptr) queue->Stop();
}

absl::Status GpuStaging::ShutDown() const {
  return absl::CancelledError(
      absl::StrCat(transport_, " transport is shut down"));
}

GpuStaging::Counters GpuStaging::counters() const {
  Counters c;
  gpu::CopyQueue* queue = nullptr;
  {
    MutexLock lock(&mu_);
    c.slices = slices_;
    c.waits = waits_;
    queue = queue_.get();
  }
  if (queue != nullptr) {
    c.copies = queue->copies();
    c.copy_bytes = queue->bytes();
  }
  return c;
}

}  // namespace ferry
