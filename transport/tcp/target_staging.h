// TargetStaging: how the TCP target serves GPU-resident buffers, whose
// memory the socket calls cannot touch (the initiator's side of the same
// path is gpu_staging.h).
#ifndef FERRY_TRANSPORT_TCP_TARGET_STAGING_H_
#define FERRY_TRANSPORT_TCP_TARGET_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "gpu/cuda_driver.h"
#include "gpu/staging.h"

namespace ferry::tcp {

// The target side's staging: a bounded pool of pinned buffers
// (`buffers` of `buffer_bytes`, allocated when the first frame touches a
// GPU-resident buffer) and copies between them and device memory on a
// stream of its own per GPU, waited for by the calling (event-loop)
// thread. The session receives a WRITE's payload into a buffer and copies
// it to the device before acknowledging it; it copies a READ's range into
// a buffer, then sends from there. The kernel's socket buffers keep the
// wire busy meanwhile. Thread-safe.
class TargetStaging {
 public:
  // A buffer of the pool, given back when destroyed. Move-only.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(TargetStaging* owner, uint8_t* data) : owner_(owner), data_(data) {}
    Buffer(Buffer&& other) noexcept { *this = std::move(other); }
    Buffer& operator=(Buffer&& other) noexcept {
      if (this != &other) {
        Reset();
        owner_ = other.owner_;
        data_ = other.data_;
        other.owner_ = nullptr;
        other.data_ = nullptr;
      }
      return *this;
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { Reset(); }
    uint8_t* data() const { return data_; }
    explicit operator bool() const { return data_ != nullptr; }
    void Reset() {
      if (data_ != nullptr) owner_->pool_->Release(data_);
      owner_ = nullptr;
      data_ = nullptr;
    }

   private:
    TargetStaging* owner_ = nullptr;
    uint8_t* data_ = nullptr;
  };

  TargetStaging(size_t buffers, size_t buffer_bytes);
  // Every Buffer must be gone.
  ~TargetStaging();
  TargetStaging(const TargetStaging&) = delete;
  TargetStaging& operator=(const TargetStaging&) = delete;

  size_t buffer_bytes() const { return buffer_bytes_; }
  // A free buffer; an empty one while all are in use (the caller retries
  // later); an error when there is no driver or memory cannot be pinned.
  // `device`: the GPU the frame touches (whose context pins the buffers
  // if this allocates them).
  absl::StatusOr<Buffer> TryAcquire(int device);
  // Copies `bytes` between a buffer and device memory of GPU `device`,
  // waiting for the copy.
  absl::Status ToDevice(int device, uint64_t dst, const uint8_t* src,
                        size_t bytes);
  absl::Status FromDevice(int device, uint8_t* dst, uint64_t src, size_t bytes);

 private:
  absl::Status Init() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Copy(int device, uint64_t device_addr, uint8_t* host,
                    size_t bytes, bool to_device);
  // Makes `device` current on this thread and returns its stream.
  absl::StatusOr<CUstream> Prepare(int device);

  const size_t buffers_;
  const size_t buffer_bytes_;
  Mutex mu_;
  bool initialized_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status init_status_ ABSL_GUARDED_BY(mu_);
  const gpu::CudaDriver* driver_ = nullptr;             // Set once, under mu_.
  std::unique_ptr<gpu::PinnedPool> pool_;               // Set once, under mu_.
  std::vector<CUstream> streams_ ABSL_GUARDED_BY(mu_);  // By device.
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TARGET_STAGING_H_
