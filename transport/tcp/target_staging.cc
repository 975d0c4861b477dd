#include "transport/tcp/target_staging.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace ferry::tcp {

TargetStaging::TargetStaging(size_t buffers, size_t buffer_bytes)
    : buffers_(buffers), buffer_bytes_(buffer_bytes) {}

TargetStaging::~TargetStaging() {
  MutexLock lock(&mu_);
  if (driver_ == nullptr) return;
  // Whoever destroys the server keeps its own current context.
  CUcontext caller = nullptr;
  driver_->api().cuCtxGetCurrent(&caller);
  for (size_t d = 0; d < streams_.size(); ++d) {
    if (streams_[d] != nullptr && driver_->UseDevice(d).ok()) {
      driver_->api().cuStreamDestroy(streams_[d]);
    }
  }
  driver_->api().cuCtxSetCurrent(caller);
}

absl::Status TargetStaging::Init() {
  if (initialized_) return init_status_;
  initialized_ = true;
  absl::StatusOr<const gpu::CudaDriver*> driver = gpu::CudaDriver::Get();
  if (!driver.ok()) {
    init_status_ = driver.status();
    return init_status_;
  }
  driver_ = *driver;
  pool_ = std::make_unique<gpu::PinnedPool>(driver_, buffers_, buffer_bytes_);
  streams_.assign(driver_->device_count(), nullptr);
  return init_status_;
}

absl::StatusOr<TargetStaging::Buffer> TargetStaging::TryAcquire(int device) {
  {
    MutexLock lock(&mu_);
    if (absl::Status s = Init(); !s.ok()) {
      FERRY_LOG_EVERY(
          kWarn, "tcp", absl::Seconds(1),
          "cannot serve a peer's access to GPU memory: ", s.message());
      return s;
    }
  }
  absl::StatusOr<uint8_t*> b = pool_->TryAcquire(device);
  if (!b.ok()) {
    FERRY_LOG_EVERY(
        kWarn, "tcp", absl::Seconds(1),
        "cannot serve a peer's access to GPU memory: ", b.status().message());
    return b.status();
  }
  return Buffer(*b == nullptr ? nullptr : this, *b);
}

absl::StatusOr<CUstream> TargetStaging::Prepare(int device) {
  FERRY_RETURN_IF_ERROR(driver_->UseDevice(device));
  MutexLock lock(&mu_);
  if (static_cast<size_t>(device) >= streams_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device ", device, " to stage through"));
  }
  if (streams_[device] == nullptr) {
    CUstream s = nullptr;
    FERRY_RETURN_IF_ERROR(driver_->Check(
        driver_->api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING),
        "cuStreamCreate"));
    streams_[device] = s;
  }
  return streams_[device];
}

absl::Status TargetStaging::ToDevice(int device, uint64_t dst,
                                     const uint8_t* src, size_t bytes) {
  absl::Status s = Copy(device, dst, const_cast<uint8_t*>(src), bytes,
                        /*to_device=*/true);
  if (!s.ok()) {
    FERRY_LOG_EVERY(kWarn, "tcp", absl::Seconds(1),
                    "staging a peer's WRITE into GPU ", device, " at 0x",
                    absl::Hex(dst), "+", bytes, " failed: ", s.message());
  }
  return s;
}

absl::Status TargetStaging::FromDevice(int device, uint8_t* dst, uint64_t src,
                                       size_t bytes) {
  absl::Status s = Copy(device, src, dst, bytes, /*to_device=*/false);
  if (!s.ok()) {
    FERRY_LOG_EVERY(kWarn, "tcp", absl::Seconds(1),
                    "staging a peer's READ from GPU ", device, " at 0x",
                    absl::Hex(src), "+", bytes, " failed: ", s.message());
  }
  return s;
}

absl::Status TargetStaging::Copy(int device, uint64_t device_addr,
                                 uint8_t* host, size_t bytes, bool to_device) {
  absl::StatusOr<CUstream> stream = Prepare(device);
  if (!stream.ok()) return stream.status();
  const gpu::CudaDriver::Api& api = driver_->api();
  absl::Status s =
      to_device ? driver_->Check(
                      api.cuMemcpyHtoDAsync(device_addr, host, bytes, *stream),
                      "cuMemcpyHtoDAsync")
                : driver_->Check(
                      api.cuMemcpyDtoHAsync(host, device_addr, bytes, *stream),
                      "cuMemcpyDtoHAsync");
  if (!s.ok()) return s;
  return driver_->Check(api.cuStreamSynchronize(*stream),
                        "cuStreamSynchronize");
}

}  // namespace ferry::tcp
