#include "metadata/etcd/etcd_usage.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ferry::metadata {

void EtcdUsage::Add(const std::string& client, int64_t bytes,
                    int64_t segments) {
  total_.bytes += bytes;
  total_.segments += segments;
  if (!client.empty()) {
    Usage& u = by_client_[client];
    u.bytes += bytes;
    u.segments += segments;
  }
}

void EtcdUsage::Reset(EtcdUsage counted, absl::Time now) {
  total_ = counted.total_;
  by_client_ = std::move(counted.by_client_);
  counted_at_ = now;
}

absl::Status EtcdUsage::Check(const std::string& client,
                              uint64_t old_client_bytes, uint64_t old_bytes,
                              uint64_t bytes, bool new_segment) const {
  const auto over = [&](int64_t held, uint64_t give_back, uint64_t limit) {
    return held - static_cast<int64_t>(give_back) +
               static_cast<int64_t>(bytes) >
           static_cast<int64_t>(limit);
  };
  if (over(total_.bytes, old_bytes, limits_.max_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the etcd store under '", prefix_, "' holds ", total_.bytes,
        " bytes of descriptors; ", bytes, " more would pass its limit of ",
        limits_.max_bytes,
        " (kept well below etcd's own quota, whose NOSPACE alarm would stop "
        "every write)"));
  }
  if (client.empty()) return absl::OkStatus();
  const auto it = by_client_.find(client);
  const Usage u = it == by_client_.end() ? Usage{} : it->second;
  if (over(u.bytes, old_client_bytes, limits_.max_client_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client ", client, " holds ", u.bytes,
        " bytes of descriptors in etcd; ", bytes,
        " more would pass its quota of ", limits_.max_client_bytes));
  }
  if (new_segment &&
      u.segments >= static_cast<int64_t>(limits_.max_client_segments)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("client ", client, " holds ", u.segments,
                     " segments in etcd, its quota"));
  }
  return absl::OkStatus();
}

int64_t EtcdCompaction::Wrote(absl::Time now, int64_t revision) {
  if (compact_after_ <= absl::ZeroDuration()) return 0;
  // Written enough since the last compaction: all of it goes now, without
  // waiting for it to age (the samples are all at or below it).
  if (written_ - written_at_compacted_ >= compact_bytes_ &&
      revision > compacted_) {
    revisions_.clear();
    compacted_ = revision;
    written_at_compacted_ = written_;
    return revision;
  }
  // A sample every tenth of compact_after (at most a second) compacts to
  // within that of it, and bounds the samples kept at any write rate.
  const absl::Duration every = std::min(absl::Seconds(1), compact_after_ / 10);
  if (revisions_.empty() || now - revisions_.back().at >= every) {
    revisions_.push_back(Sample{now, revision, written_});
  }
  // The newest revision written at least compact_after ago: history up to
  // it goes (a watcher that far behind reads its segment whole).
  int64_t upto = 0;
  uint64_t written_upto = 0;
  while (!revisions_.empty() && now - revisions_.front().at >= compact_after_) {
    upto = revisions_.front().revision;
    written_upto = revisions_.front().written;
    revisions_.pop_front();
  }
  if (upto <= compacted_) return 0;
  compacted_ = upto;
  // What was written above `upto` is still history, and still counts
  // toward the next compaction by volume.
  written_at_compacted_ = written_upto;
  return upto;
}

}  // namespace ferry::metadata
