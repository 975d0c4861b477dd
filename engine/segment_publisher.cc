#include "engine/segment_publisher.h"

#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace ferry {

absl::Status SegmentPublisher::Publish(
    const descriptor::SegmentDescriptor& segment, absl::Duration name_wait) {
  {
    MutexLock lock(&publish_mu_);
    segment_ = segment;
    segment_.clear_buffers();
    buffers_.clear();
    for (const descriptor::Buffer& b : segment.buffers())
      buffers_[b.addr()] = b;
    const absl::Time give_up = clock_->Now() + name_wait;
    bool told = false;
    int unavailable = 0;
    while (true) {
      const absl::Time tried = clock_->Now();
      absl::Status s = store_->Put(PutRequestLocked()).status();
      if (s.ok()) break;
      if (s.code() == absl::StatusCode::kUnavailable &&
          unavailable < kUnavailableRetries &&
          clock_->Now() - tried < kQuickFailure) {
        ++unavailable;
        FERRY_LOG(kInfo, "metadata", "publishing segment '", segment.name(),
                  "' again: ", s.message());
        clock_->SleepFor(kNameRetry);
        continue;
      }
      if (s.code() != absl::StatusCode::kAlreadyExists ||
          clock_->Now() >= give_up) {
        return s;
      }
      if (!told) {
        told = true;
        FERRY_LOG(kWarn, "metadata", "waiting up to ",
                  absl::FormatDuration(name_wait), " for segment name '",
                  segment.name(), "': ", s.message());
      }
      clock_->SleepFor(kNameRetry);
    }
  }
  if (lease_ttl_ > absl::ZeroDuration() && !renewer_.joinable()) {
    try {
      renewer_ = std::thread([this] { RenewLoop(); });
    } catch (const std::system_error& e) {
      // A pids limit (a probe at `ulimit -u` 16 aborted here): the
      // engine's Init fails, the process does not, and the segment just
      // published goes (peers would dial an engine that is not there).
      Withdraw();
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot start the lease renewal thread: ", e.what()));
    }
  }
  return absl::OkStatus();
}

metadata::PutSegmentRequest SegmentPublisher::PutRequestLocked() const {
  metadata::PutSegmentRequest req;
  *req.mutable_segment() = segment_;
  for (const auto& [addr, b] : buffers_)
    *req.mutable_segment()->add_buffers() = b;
  req.set_lease_ttl_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(lease_ttl_)));
  req.set_owner_key(owner_key_);
  return req;
}

absl::Status SegmentPublisher::RepublishLocked() {
  absl::Status s = store_->Put(PutRequestLocked()).status();
  if (s.ok()) {
    ++republished_;
    FERRY_LOG(kInfo, "metadata", "segment '", segment_.name(),
              "' published again to ", store_->Describe(), " (",
              buffers_.size(), " buffers): the service had lost it");
  }
  return s;
}

metadata::UpdateBuffersRequest SegmentPublisher::UpdateRequestLocked() const {
  metadata::UpdateBuffersRequest req;
  req.set_name(segment_.name());
  req.set_incarnation(segment_.incarnation());
  req.set_owner_key(owner_key_);
  return req;
}

absl::Status SegmentPublisher::AddBuffers(
    const std::vector<descriptor::Buffer>& buffers) {
  if (buffers.empty()) return absl::OkStatus();
  MutexLock lock(&publish_mu_);
  metadata::UpdateBuffersRequest req = UpdateRequestLocked();
  for (const descriptor::Buffer& b : buffers) *req.add_add() = b;
  absl::Status s = store_->UpdateBuffers(req).status();
  if (s.code() == absl::StatusCode::kNotFound) {
    // The service lost the segment: publish all of it, these buffers too.
    for (const descriptor::Buffer& b : buffers) buffers_[b.addr()] = b;
    s = RepublishLocked();
    if (!s.ok()) {
      for (const descriptor::Buffer& b : buffers) buffers_.erase(b.addr());
    }
    return s;
  }
  if (s.ok()) {
    for (const descriptor::Buffer& b : buffers) buffers_[b.addr()] = b;
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
  absl::Status s = store_->UpdateBuffers(req).status();
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
      const absl::Time until = clock_->Now() + every;
      while (!stopping_ &&
             !clock_->WaitWithDeadline(&stop_cv_, &stop_mu_, until)) {
      }
      if (stopping_) return;
    }
    metadata::KeepAliveRequest req;
    {
      MutexLock lock(&publish_mu_);
      req.set_name(segment_.name());
      req.set_incarnation(segment_.incarnation());
      req.set_owner_key(owner_key_);
    }
    const std::string& name = req.name();
    auto ttl = store_->KeepAlive(req);
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

void SegmentPublisher::Withdraw() {
  Stop();
  metadata::RemoveSegmentRequest req;
  {
    MutexLock lock(&publish_mu_);
    if (segment_.name().empty()) return;  // Never published.
    req.set_name(segment_.name());
    req.set_incarnation(segment_.incarnation());
    req.set_owner_key(owner_key_);
  }
  store_->Remove(req).IgnoreError();
}

uint64_t SegmentPublisher::republished() const {
  MutexLock lock(&publish_mu_);
  return republished_;
}

}  // namespace ferry
