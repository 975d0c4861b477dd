#include "engine/segment_publisher.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace ferry {

absl::Status SegmentPublisher::Publish(
    const metadata::SegmentDescriptor& segment) {
  {
    MutexLock lock(&publish_mu_);
    segment_ = segment;
    segment_.clear_buffers();
    buffers_.clear();
    for (const metadata::Buffer& b : segment.buffers()) buffers_[b.addr()] = b;
    if (auto v = client_->PutSegment(segment, lease_ttl_); !v.ok()) {
      return v.status();
    }
  }
  if (lease_ttl_ > absl::ZeroDuration() && !renewer_.joinable()) {
    renewer_ = std::thread([this] { RenewLoop(); });
  }
  return absl::OkStatus();
}

absl::Status SegmentPublisher::RepublishLocked() {
  metadata::SegmentDescriptor full = segment_;
  for (const auto& [addr, b] : buffers_) *full.add_buffers() = b;
  absl::Status s = client_->PutSegment(full, lease_ttl_).status();
  if (s.ok()) {
    ++republished_;
    FERRY_LOG(kInfo, "metadata", "segment '", segment_.name(),
              "' published again to ", client_->address(), " (",
              buffers_.size(), " buffers): the service had lost it");
  }
  return s;
}

metadata::UpdateBuffersRequest SegmentPublisher::UpdateRequestLocked() const {
  metadata::UpdateBuffersRequest req;
  req.set_name(segment_.name());
  req.set_incarnation(segment_.incarnation());
  return req;
}

absl::Status SegmentPublisher::AddBuffers(
    const std::vector<metadata::Buffer>& buffers) {
  if (buffers.empty()) return absl::OkStatus();
  MutexLock lock(&publish_mu_);
  metadata::UpdateBuffersRequest req = UpdateRequestLocked();
  for (const metadata::Buffer& b : buffers) *req.add_add() = b;
  absl::Status s = client_->UpdateBuffers(req).status();
  if (s.code() == absl::StatusCode::kNotFound) {
    // The service lost the segment: publish all of it, these buffers too.
    for (const metadata::Buffer& b : buffers) buffers_[b.addr()] = b;
    s = RepublishLocked();
    if (!s.ok()) {
      for (const metadata::Buffer& b : buffers) buffers_.erase(b.addr());
    }
    return s;
  }
  if (s.ok()) {
    for (const metadata::Buffer& b : buffers) buffers_[b.addr()] = b;
  }
  return s;
}

absl::Status SegmentPublisher::RemoveBuffers(
    const std::vector<uint64_t>& addrs) {
  if (addrs.empty()) return absl::OkStatus();
  MutexLock lock(&publish_mu_);
  metadata::UpdateBuffersRequest req = UpdateRequestLocked();
  for (uint64_t a : addrs) {
    if (buffers_.erase(a) > 0) req.add_remove_addrs(a);
  }
  if (req.remove_addrs_size() == 0) return absl::OkStatus();
  absl::Status s = client_->UpdateBuffers(req).status();
  if (s.code() == absl::StatusCode::kNotFound) {
    // Lost with the segment: publish the segment as it is now.
    s = RepublishLocked();
  }
  return s;
}

void SegmentPublisher::RenewLoop() {
  const absl::Duration every = lease_ttl_ / 3;
  while (true) {
    {
      MutexLock lock(&stop_mu_);
      const absl::Time until = absl::Now() + every;
      while (!stopping_ && !stop_cv_.WaitWithDeadline(&stop_mu_, until)) {
      }
      if (stopping_) return;
    }
    std::string name;
    uint64_t incarnation;
    {
      MutexLock lock(&publish_mu_);
      name = segment_.name();
      incarnation = segment_.incarnation();
    }
    auto ttl = client_->KeepAlive(name, incarnation);
    if (ttl.ok()) continue;
    if (ttl.status().code() == absl::StatusCode::kNotFound) {
      MutexLock lock(&publish_mu_);
      if (absl::Status s = RepublishLocked(); !s.ok()) {
        FERRY_LOG_EVERY(kWarn, "metadata", absl::Seconds(10),
                        "cannot publish segment '", name,
                        "' again: ", s.message());
      }
    } else if (ttl.status().code() == absl::StatusCode::kFailedPrecondition) {
      FERRY_LOG_EVERY(
          kError, "metadata", absl::Seconds(10), "segment '", name,
          "' is held by another engine run: ", ttl.status().message());
    } else {
      FERRY_LOG_EVERY(kWarn, "metadata", absl::Seconds(10),
                      "lease of segment '", name,
                      "' not renewed (transfers "
                      "over open connections go on): ",
                      ttl.status().message());
    }
  }
}

void SegmentPublisher::Stop() {
  {
    MutexLock lock(&stop_mu_);
    stopping_ = true;
  }
  stop_cv_.SignalAll();
  if (renewer_.joinable()) renewer_.join();
}

uint64_t SegmentPublisher::republished() const {
  MutexLock lock(&publish_mu_);
  return republished_;
}

}  // namespace ferry
