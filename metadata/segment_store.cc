#include "metadata/segment_store.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "metadata/validation.h"

namespace ferry::metadata {

absl::StatusOr<uint64_t> SegmentStore::Put(SegmentDescriptor segment) {
  if (absl::Status s = ValidateSegmentDescriptor(segment); !s.ok()) return s;
  MutexLock lock(&mu_);
  auto it = segments_.find(segment.name());
  if (it == segments_.end() && segments_.size() >= kMaxSegments) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "metadata store holds ", kMaxSegments, " segments, its limit"));
  }
  uint64_t version = next_version_++;
  segment.set_version(version);
  std::string name = segment.name();
  segments_[name] = std::move(segment);
  return version;
}

absl::StatusOr<uint64_t> SegmentStore::UpdateBuffers(
    const UpdateBuffersRequest& request) {
  if (absl::Status s = ValidateSegmentName(request.name()); !s.ok()) return s;
  for (const Buffer& b : request.add()) {
    if (absl::Status s = ValidateBuffer(b); !s.ok()) return s;
  }
  MutexLock lock(&mu_);
  auto it = segments_.find(request.name());
  if (it == segments_.end()) {
    return absl::NotFoundError(
        absl::StrCat("segment '", request.name(), "' is not registered"));
  }
  if (it->second.incarnation() != request.incarnation()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment '", request.name(), "' belongs to another engine instance"));
  }
  // Build the result on a copy so that a failure changes nothing.
  SegmentDescriptor updated = it->second;
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
  it->second = std::move(updated);
  return version;
}

absl::StatusOr<SegmentDescriptor> SegmentStore::Get(
    const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = segments_.find(name);
  if (it == segments_.end()) {
    return absl::NotFoundError(
        absl::StrCat("segment '", name, "' is not registered"));
  }
  return it->second;
}

absl::Status SegmentStore::Remove(const std::string& name,
                                  uint64_t incarnation) {
  MutexLock lock(&mu_);
  auto it = segments_.find(name);
  if (it == segments_.end()) {
    return absl::NotFoundError(
        absl::StrCat("segment '", name, "' is not registered"));
  }
  if (incarnation != 0 && it->second.incarnation() != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "segment '", name, "' belongs to another engine instance"));
  }
  segments_.erase(it);
  return absl::OkStatus();
}

std::vector<std::string> SegmentStore::List() const {
  MutexLock lock(&mu_);
  std::vector<std::string> names;
  names.reserve(segments_.size());
  for (const auto& [name, seg] : segments_) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace ferry::metadata
