#include "gpu/staging.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ferry::gpu {

PinnedPool::PinnedPool(const CudaDriver* driver, size_t count, size_t bytes)
    : driver_(driver), count_(count), bytes_(bytes) {}

namespace {

// Pinned memory is allocated and freed in a context: the caller's current
// one, else GPU `device`'s primary context, made current only for the
// call (the caller's thread is left as it was).
class AnyContext {
 public:
  AnyContext(const CudaDriver* driver, int device) : driver_(driver) {
    CUcontext current = nullptr;
    if (driver_->api().cuCtxGetCurrent(&current) == CUDA_SUCCESS &&
        current != nullptr) {
      return;
    }
    status_ = driver_->UseDevice(device);
    switched_ = status_.ok();
  }
  ~AnyContext() {
    if (switched_) driver_->api().cuCtxSetCurrent(nullptr);
  }
  const absl::Status& status() const { return status_; }

 private:
  const CudaDriver* const driver_;
  absl::Status status_;
  bool switched_ = false;
};

}  // namespace

PinnedPool::~PinnedPool() {
  MutexLock lock(&mu_);
  if (all_.empty()) return;
  AnyContext ctx(driver_, 0);
  for (uint8_t* b : all_) driver_->api().cuMemFreeHost(b);
}

absl::StatusOr<uint8_t*> PinnedPool::TryAcquire(int device) {
  MutexLock lock(&mu_);
  if (!allocated_) {
    allocated_ = true;
    AnyContext ctx(driver_, device);
    for (size_t i = 0; i < count_ && ctx.status().ok(); ++i) {
      void* p = nullptr;
      // Portable: the copies may run in any device's context.
      absl::Status s = driver_->Check(
          driver_->api().cuMemHostAlloc(&p, bytes_, CU_MEMHOSTALLOC_PORTABLE),
          "cuMemHostAlloc");
      if (!s.ok()) {
        for (uint8_t* b : all_) driver_->api().cuMemFreeHost(b);
        all_.clear();
        const bool no_memory = absl::StrContains(s.message(), "OUT_OF_MEMORY");
        alloc_status_ = absl::Status(
            no_memory ? absl::StatusCode::kResourceExhausted : s.code(),
            absl::StrCat("cannot pin ", count_, " staging buffers of ", bytes_,
                         " bytes for GPU memory (", s.message(), ")",
                         no_memory ? ": raise the locked-memory limit (ulimit "
                                     "-l, or LimitMEMLOCK in a systemd unit) "
                                     "or lower tcp.staging_buffers"
                                   : ""));
        break;
      }
      all_.push_back(static_cast<uint8_t*>(p));
    }
    if (!ctx.status().ok()) alloc_status_ = ctx.status();
    free_ = all_;
  }
  if (!alloc_status_.ok()) return alloc_status_;
  if (free_.empty()) return nullptr;
  uint8_t* b = free_.back();
  free_.pop_back();
  return b;
}

void PinnedPool::Release(uint8_t* buffer) {
  MutexLock lock(&mu_);
  free_.push_back(buffer);
}

size_t PinnedPool::in_use() const {
  MutexLock lock(&mu_);
  return all_.size() - free_.size();
}

CopyQueue::CopyQueue(const CudaDriver* driver, int streams_per_device)
    : driver_(driver), streams_per_device_(std::max(1, streams_per_device)) {}

CopyQueue::~CopyQueue() { Stop(); }

absl::Status CopyQueue::Start() {
  MutexLock lock(&mu_);
  if (started_ || stopping_) return absl::OkStatus();
  try {
    thread_ = std::thread([this] { Run(); });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start the GPU staging thread: ", e.what()));
  }
  started_ = true;
  return absl::OkStatus();
}

void CopyQueue::ToDevice(int device, CUdeviceptr dst, const void* src,
                         size_t bytes, Done done) {
  Op op;
  op.kind = Op::Kind::kToDevice;
  op.device = device;
  op.device_addr = dst;
  op.host = const_cast<void*>(src);
  op.bytes = bytes;
  op.done = std::move(done);
  Enqueue(std::move(op));
}

void CopyQueue::FromDevice(int device, void* dst, CUdeviceptr src, size_t bytes,
                           Done done) {
  Op op;
  op.kind = Op::Kind::kFromDevice;
  op.device = device;
  op.device_addr = src;
  op.host = dst;
  op.bytes = bytes;
  op.done = std::move(done);
  Enqueue(std::move(op));
}

void CopyQueue::Post(absl::AnyInvocable<void() &&> task) {
  Op op;
  op.task = std::move(task);
  Enqueue(std::move(op));
}

void CopyQueue::Enqueue(Op op) {
  {
    MutexLock lock(&mu_);
    if (started_ && !stopping_) {
      queued_.push_back(std::move(op));
      cv_.Signal();
      return;
    }
  }
  if (op.kind == Op::Kind::kTask) {
    std::move(op.task)();
  } else {
    std::move(op.done)(
        absl::CancelledError("the GPU staging queue is not running"));
  }
}

void CopyQueue::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    cv_.Signal();
  }
  if (thread_.joinable()) thread_.join();
}

uint64_t CopyQueue::copies() const {
  MutexLock lock(&mu_);
  return copies_;
}

uint64_t CopyQueue::bytes() const {
  MutexLock lock(&mu_);
  return bytes_;
}

absl::StatusOr<CUstream> CopyQueue::StreamFor(int device) {
  if (device < 0 || device >= driver_->device_count()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device ", device, " to stage through"));
  }
  if (streams_.size() <= static_cast<size_t>(device)) {
    streams_.resize(device + 1);
    next_stream_.resize(device + 1, 0);
  }
  std::vector<CUstream>& mine = streams_[device];
  if (mine.empty()) {
    for (int i = 0; i < streams_per_device_; ++i) {
      CUstream s = nullptr;
      // Non-blocking: the application's work on the legacy default
      // stream neither waits for staging nor makes it wait.
      absl::Status st = driver_->Check(
          driver_->api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING),
          "cuStreamCreate");
      if (!st.ok()) return st;
      mine.push_back(s);
    }
  }
  CUstream s = mine[next_stream_[device]];
  next_stream_[device] = (next_stream_[device] + 1) % mine.size();
  return s;
}

absl::Status CopyQueue::Issue(Op* op) {
  if (op->device != current_device_) {
    FERRY_RETURN_IF_ERROR(driver_->UseDevice(op->device));
    current_device_ = op->device;
  }
  absl::StatusOr<CUstream> stream = StreamFor(op->device);
  if (!stream.ok()) return stream.status();
  op->stream = *stream;
  const CudaDriver::Api& api = driver_->api();
  if (op->kind == Op::Kind::kToDevice) {
    return driver_->Check(
        api.cuMemcpyHtoDAsync(op->device_addr, op->host, op->bytes, op->stream),
        "cuMemcpyHtoDAsync");
  }
  return driver_->Check(
      api.cuMemcpyDtoHAsync(op->host, op->device_addr, op->bytes, op->stream),
      "cuMemcpyDtoHAsync");
}

void CopyQueue::Run() {
  // Issued, in order: each is waited for (or run, for a task) at the
  // front, while the copies behind it already run on their streams.
  std::deque<Op> issued;
  while (true) {
    std::deque<Op> batch;
    bool stopping = false;
    {
      MutexLock lock(&mu_);
      while (queued_.empty() && issued.empty() && !stopping_) cv_.Wait(&mu_);
      stopping = stopping_;
      batch.swap(queued_);
      if (!stopping) {
        for (const Op& op : batch) {
          if (op.kind == Op::Kind::kTask) continue;
          ++copies_;
          bytes_ += op.bytes;
        }
      }
    }
    if (stopping && batch.empty() && issued.empty()) {
      // On this thread, which has switched contexts all along: the caller
      // of Stop keeps its own current context. The streams are idle:
      // every copy issued was waited for.
      for (size_t d = 0; d < streams_.size(); ++d) {
        for (CUstream s : streams_[d]) {
          if (driver_->UseDevice(static_cast<int>(d)).ok()) {
            driver_->api().cuStreamDestroy(s);
          }
        }
      }
      streams_.clear();
      return;
    }
    for (Op& op : batch) {
      if (op.kind != Op::Kind::kTask) {
        op.status = stopping ? absl::CancelledError(
                                   "the GPU staging queue stopped before the "
                                   "copy was issued")
                             : Issue(&op);
      }
      issued.push_back(std::move(op));
    }
    if (issued.empty()) continue;
    Op op = std::move(issued.front());
    issued.pop_front();
    if (op.kind == Op::Kind::kTask) {
      std::move(op.task)();
      continue;
    }
    absl::Status s = op.status;
    if (s.ok() && op.device != current_device_) {
      s = driver_->UseDevice(op.device);
      if (s.ok()) current_device_ = op.device;
    }
    if (s.ok()) {
      s = driver_->Check(driver_->api().cuStreamSynchronize(op.stream),
                         "cuStreamSynchronize");
    }
    std::move(op.done)(s);
  }
}

}  // namespace ferry::gpu
