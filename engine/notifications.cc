// Notifications: admission, addressing and queueing of what peers send.
#include "engine/notifications.h"

#include <iterator>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "metadata/auth.h"
#include "metadata/grpc_status.h"

namespace ferry {

void Notifications::Configure(const Limits& limits, std::string local_segment,
                              uint64_t incarnation, bool refuse_unverified,
                              Verifier verify) {
  local_segment_ = std::move(local_segment);
  incarnation_ = incarnation;
  refuse_unverified_ = refuse_unverified;
  verify_ = std::move(verify);
  MutexLock lock(&mu_);
  limits_ = limits;
}

absl::Status Notifications::AdmitLocked(const std::string& sender,
                                        size_t bytes) {
  // Per sender address too: one peer flooding the queue must not crowd out
  // the others (the names it claims cost it nothing to vary).
  auto it = shares_.find(sender);
  const SenderShare held = it == shares_.end() ? SenderShare{} : it->second;
  if (held.count + 1 > limits_.max_count_per_sender ||
      held.bytes + bytes > limits_.max_bytes_per_sender) {
    ++refused_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "receiver holds ", held.count, " notifications (", held.bytes,
        " bytes) from ", sender, ", its limit per sender (",
        limits_.max_count_per_sender, ", ", limits_.max_bytes_per_sender,
        " bytes): it has not called GetNotifications"));
  }
  if (queue_.size() >= limits_.max_count ||
      bytes_ + bytes > limits_.max_bytes) {
    ++refused_;
    return absl::ResourceExhaustedError(
        absl::StrCat("receiver's notification queue is full (", queue_.size(),
                     " notifications, ", bytes_,
                     " bytes queued): it has not called GetNotifications"));
  }
  return absl::OkStatus();
}

absl::Status Notifications::CheckAddressee(
    const metadata::NotifyRequest& request) const {
  if (request.to_segment().empty()) return absl::OkStatus();
  if (request.to_segment() != local_segment_) {
    // For another engine: a sender whose descriptor is stale (the receiver
    // it meant restarted elsewhere and this engine now has the address),
    // or a replay. Never queued, whatever refuse_unverified_notifications
    // says; the sender is told to read the receiver's descriptor again.
    return metadata::WithHint(
        absl::FailedPreconditionError(absl::StrCat(
            "addressed to segment '", request.to_segment(), "'; this is '",
            local_segment_, "' (the address changed hands)")),
        metadata::Hint::kRefreshReceiver);
  }
  if (request.to_incarnation() != incarnation_) {
    // For an earlier run of this segment: a replay, or a sender whose
    // descriptor of this engine predates its restart. Told to read it
    // again (and to send again, signed for this run).
    return metadata::WithHint(
        absl::FailedPreconditionError(absl::StrCat(
            "addressed to incarnation ", request.to_incarnation(),
            " of segment '", request.to_segment(), "'; this is incarnation ",
            incarnation_, ": the receiver restarted")),
        metadata::Hint::kRefreshReceiver);
  }
  return absl::OkStatus();
}

absl::Status Notifications::Refuse(absl::Status refusal) {
  MutexLock lock(&mu_);
  ++refused_;
  return refusal;
}

absl::Status Notifications::Receive(const metadata::NotifyRequest& request,
                                    const std::string& sender) {
  const std::string& from = request.from_segment();
  const std::string& name = request.name();
  const std::string& message = request.message();
  const size_t bytes = from.size() + name.size() + message.size();
  // Shares are per host: an IPv6 sender's /64 is one sender, as elsewhere
  // (metadata::AddressGroup).
  const std::string group = metadata::AddressGroup(sender);
  {
    // A sender over its share costs no lookup.
    MutexLock lock(&mu_);
    FERRY_RETURN_IF_ERROR(AdmitLocked(group, bytes));
  }
  absl::Status verified;
  if (!request.signature().empty() && request.to_segment().empty()) {
    // Signed for no receiver in particular: good at every one.
    verified = absl::PermissionDeniedError(
        "a signed notification must name its receiver (to_segment)");
  } else if (absl::Status s = CheckAddressee(request); !s.ok()) {
    return Refuse(std::move(s));
  } else {
    // Outside the queue's lock: it may read the metadata (bounded).
    verified = verify_(request, sender);
  }
  if (!verified.ok() && refuse_unverified_) {
    // Unavailable stays what it is, marked so that a Ferry sender tries
    // again (metadata::IsRetryLater).
    if (verified.code() == absl::StatusCode::kUnavailable) {
      return Refuse(metadata::MarkRetryLater(absl::UnavailableError(
          absl::StrCat("receiver cannot check the sender now, try again: ",
                       verified.message()))));
    }
    return Refuse(
        absl::Status(verified.code(),
                     absl::StrCat("receiver refuses unverified notifications: ",
                                  verified.message())));
  }
  MutexLock lock(&mu_);
  FERRY_RETURN_IF_ERROR(AdmitLocked(group, bytes));  // Others queued meanwhile.
  bytes_ += bytes;
  SenderShare& share = shares_[group];
  ++share.count;
  share.bytes += bytes;
  queue_.push_back({from, name, message, sender, verified.ok()});
  return absl::OkStatus();
}

std::vector<Notification> Notifications::Take() {
  MutexLock lock(&mu_);
  std::vector<Notification> out(std::make_move_iterator(queue_.begin()),
                                std::make_move_iterator(queue_.end()));
  queue_.clear();
  bytes_ = 0;
  shares_.clear();
  return out;
}

Notifications::Stats Notifications::stats() const {
  MutexLock lock(&mu_);
  return {queue_.size(), bytes_, refused_};
}

}  // namespace ferry
