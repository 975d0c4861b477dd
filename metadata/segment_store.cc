#include "metadata/segment_store.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "metadata/validation.h"

namespace ferry::metadata {

void SegmentStore::ExpireLocked() {
  const absl::Time now = clock_();
  while (!expiry_.empty() && expiry_.begin()->first <= now) {
    segments_.erase(expiry_.begin()->second);
    expiry_.erase(expiry_.begin());
  }
}

void SegmentStore::RenewLocked(const std::string& name, Entry* e) {
  if (e->expires != absl::InfiniteFuture()) expiry_.erase({e->expires, name});
  e->expires = e->ttl > absl::ZeroDuration() ? clock_() + e->ttl
                                             : absl::InfiniteFuture();
  if (e->expires != absl::InfiniteFuture()) expiry_.insert({e->expires, name});
}

absl::StatusOr<uint64_t> SegmentStore::Put(SegmentDescriptor segment,
                                           absl::Duration lease_ttl) {
  if (absl::Status s = ValidateSegmentDescriptor(segment); !s.ok()) return s;
  if (lease_ttl < absl::ZeroDuration() || lease_ttl > kMaxLeaseTtl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease TTL ", absl::FormatDuration(lease_ttl),
        " is outside 0 (none) .. ", absl::FormatDuration(kMaxLeaseTtl)));
  }
  MutexLock lock(&mu_);
  ExpireLocked();
  auto it = segments_.find(segment.name());
  if (it == segments_.end() && segments_.size() >= kMaxSegments) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "metadata store holds ", kMaxSegments, " segments, its limit"));
  }
  uint64_t version = next_version_++;
  segment.set_version(version);
  const std::string name = segment.name();
  Entry& e = segments_[name];
  e.segment = std::move(segment);
  e.ttl = lease_ttl;
  RenewLocked(name, &e);
  return version;
}

absl::StatusOr<absl::Duration> SegmentStore::KeepAlive(const std::string& name,
                                                       uint64_t incarnation) {
  MutexLock lock(&mu_);
  ExpireLocked();
  auto it = segments_.find(name);
  if (it == segments_.end()) {
    return absl::NotFoundError(
        absl::StrCat("segment '", name,
                     "' is not registered (its lease expired, or the "
                     "metadata service restarted)"));
  }
  if (it->second.segment.incarnation() != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment '", name, "' belongs to another engine instance"));
  }
  RenewLocked(name, &it->second);
  return it->second.ttl;
}

absl::StatusOr<uint64_t> SegmentStore::UpdateBuffers(
    const UpdateBuffersRequest& request) {
  if (absl::Status s = ValidateSegmentName(request.name()); !s.ok()) return s;
  for (const Buffer& b : request.add()) {
    if (absl::Status s = ValidateBuffer(b); !s.ok()) return s;
  }
  MutexLock lock(&mu_);
  ExpireLocked();
  auto it = segments_.find(request.name());
  if (it == segments_.end()) {
    return absl::NotFoundError(
        absl::StrCat("segment '", request.name(), "' is not registered"));
  }
  if (it->second.segment.incarnation() != request.incarnation()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment '", request.name(), "' belongs to another engine instance"));
  }
  // Build the result on a copy so that a failure changes nothing.
  SegmentDescriptor updated = it->second.segment;
  absl::flat_hash_set<uint64_t> remove(request.remove_addrs().begin(),
                                       request.remove_addrs().end());
  auto* buffers = updated.mutable_buffers();
  size_t before = buffers->size();
  buffers->erase(std::remove_if(buffers->begin(), buffers->end(),
                                [&](const Buffer& b) {
                                  return remove.contains(b.addr());
                                }),
                 buffers->end());
  if (before - buffers->size() != remove.size()) {
    return absl::NotFoundError(
        "a buffer to remove is not registered in the segment");
  }
  for (const Buffer& b : request.add()) *buffers->Add() = b;
  if (absl::Status s = ValidateSegmentDescriptor(updated); !s.ok()) return s;
  uint64_t version = next_version_++;
  updated.set_version(version);
  it->second.segment = std::move(updated);
  // An update from the owner shows it alive, as a KeepAlive does.
  RenewLocked(request.name(), &it->second);
  return version;
}

absl::StatusOr<SegmentDescriptor> SegmentStore::Get(
    const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = segments_.find(name);
  if (it == segments_.end() || Expired(it->second)) {
    return absl::NotFoundError(
        absl::StrCat("segment '", name, "' is not registered"));
  }
  return it->second.segment;
}

absl::Status SegmentStore::Remove(const std::string& name,
                                  uint64_t incarnation) {
  MutexLock lock(&mu_);
  ExpireLocked();
  auto it = segments_.find(name);
  if (it == segments_.end()) {
    return absl::NotFoundError(
        absl::StrCat("segment '", name, "' is not registered"));
  }
  if (incarnation != 0 && it->second.segment.incarnation() != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment '", name, "' belongs to another engine instance"));
  }
  if (it->second.expires != absl::InfiniteFuture()) {
    expiry_.erase({it->second.expires, name});
  }
  segments_.erase(it);
  return absl::OkStatus();
}

std::vector<std::string> SegmentStore::List() const {
  MutexLock lock(&mu_);
  std::vector<std::string> names;
  names.reserve(segments_.size());
  for (const auto& [name, e] : segments_) {
    if (!Expired(e)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace ferry::metadata
