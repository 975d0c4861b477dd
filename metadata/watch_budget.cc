#include "metadata/watch_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace ferry::metadata {

WatchBudget::WatchBudget(size_t max_bytes, size_t max_bytes_per_caller) {
  SetLimits(max_bytes, max_bytes_per_caller);
}

void WatchBudget::SetLimits(size_t max_bytes, size_t max_bytes_per_caller) {
  MutexLock lock(&mu_);
  max_bytes_ = std::max<size_t>(max_bytes, 1);
  max_bytes_per_caller_ = std::max<size_t>(max_bytes_per_caller, 1);
}

absl::Status WatchBudget::Charge(const std::string& caller, size_t bytes) {
  MutexLock lock(&mu_);
  auto it = held_.find(caller);
  const size_t mine = it == held_.end() ? 0 : it->second;
  // Written as subtractions: `bytes` may be anything a message encodes to,
  // and what is held may pass a limit lowered since (SetLimits).
  if (mine > max_bytes_per_caller_ || bytes > max_bytes_per_caller_ - mine) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the watch streams of caller ", caller, " hold ", mine,
        " bytes of events it has not taken; this one (", bytes,
        " bytes) would pass the limit per caller (", max_bytes_per_caller_,
        "): the stream ends, and its watcher refreshes the segment on a "
        "miss"));
  }
  if (total_ > max_bytes_ || bytes > max_bytes_ - total_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the watch streams of this metadata service hold ", total_,
        " bytes of events their callers have not taken; this one (", bytes,
        " bytes, for caller ", caller, ", which holds ", mine,
        ") would pass the service's limit (", max_bytes_,
        "): the stream ends, and its watcher refreshes the segment on a "
        "miss"));
  }
  if (bytes == 0) return absl::OkStatus();  // Keeps no entry for nothing.
  if (it == held_.end()) {
    held_.emplace(caller, bytes);
  } else {
    it->second += bytes;
  }
  total_ += bytes;
  return absl::OkStatus();
}

void WatchBudget::Release(const std::string& caller, size_t bytes) {
  if (bytes == 0) return;
  MutexLock lock(&mu_);
  auto it = held_.find(caller);
  const size_t held = it == held_.end() ? 0 : it->second;
  if (bytes > held) {
    // A stream gave back what it had not charged: a bookkeeping bug that
    // would eat another stream's charge. Said, not hidden.
    FERRY_LOG_EVERY(kError, "metadata", absl::Seconds(1),
                    "watch budget: ", caller, " gives back ", bytes,
                    " bytes but holds ", held);
  }
  if (it == held_.end()) return;
  const size_t given = std::min(it->second, bytes);
  it->second -= given;
  total_ -= given;
  if (it->second == 0) held_.erase(it);
}

size_t WatchBudget::held(const std::string& caller) const {
  MutexLock lock(&mu_);
  auto it = held_.find(caller);
  return it == held_.end() ? 0 : it->second;
}

size_t WatchBudget::total() const {
  MutexLock lock(&mu_);
  return total_;
}

}  // namespace ferry::metadata
