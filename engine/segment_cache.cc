#include "engine/segment_cache.h"

#include "absl/strings/str_cat.h"
#include "metadata/validation.h"

namespace ferry {
namespace {

// A segment whose requests keep failing is fetched again at most this
// often, however many failures mark it stale.
constexpr absl::Duration kMinRefreshInterval = absl::Milliseconds(100);

}  // namespace

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentCache::Fetch(
    const std::string& name) {
  auto desc = client_->GetSegment(name);
  if (!desc.ok()) return desc.status();
  return SegmentView::Create(std::move(*desc));
}

absl::StatusOr<SegmentHandle> SegmentCache::Open(const std::string& name) {
  if (absl::Status s = metadata::ValidateSegmentName(name); !s.ok()) return s;
  {
    MutexLock lock(&mu_);
    auto it = by_name_.find(name);
    if (it != by_name_.end()) return it->second;
  }
  // Fetch without the lock: a slow metadata server must not block lookups
  // of segments that are already open.
  auto view = Fetch(name);
  if (!view.ok()) return view.status();
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it != by_name_.end()) return it->second;  // Lost a race; same result.
  SegmentHandle handle =
      (static_cast<uint64_t>(tag_) << 48) | (entries_.size() + 1);
  entries_.push_back({name, std::move(*view), false, absl::Now()});
  by_name_[name] = handle;
  return handle;
}

absl::StatusOr<size_t> SegmentCache::IndexOf(SegmentHandle handle) const {
  uint64_t index_plus_one = handle & ((uint64_t{1} << 48) - 1);
  if ((handle >> 48) != tag_ || index_plus_one == 0 ||
      index_plus_one > entries_.size()) {
    return absl::NotFoundError(
        absl::StrCat("segment handle 0x", absl::Hex(handle),
                     " was not returned by OpenSegment of this engine"));
  }
  return index_plus_one - 1;
}

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentCache::Get(
    SegmentHandle handle) {
  {
    MutexLock lock(&mu_);
    auto index = IndexOf(handle);
    if (!index.ok()) return index.status();
    Entry& e = entries_[*index];
    if (!e.stale) return e.view;
    const absl::Time now = absl::Now();
    if (now - e.fetched < kMinRefreshInterval) return e.view;
    e.stale = false;  // One refresh per mark, even if it fails.
    e.fetched = now;
  }
  auto fresh = Refresh(handle);
  if (fresh.ok()) return fresh;
  MutexLock lock(&mu_);
  return entries_[*IndexOf(handle)].view;
}

void SegmentCache::MarkStale(SegmentHandle handle) {
  MutexLock lock(&mu_);
  auto index = IndexOf(handle);
  if (index.ok()) entries_[*index].stale = true;
}

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentCache::Refresh(
    SegmentHandle handle) {
  std::string name;
  {
    MutexLock lock(&mu_);
    auto index = IndexOf(handle);
    if (!index.ok()) return index.status();
    name = entries_[*index].name;
  }
  auto view = Fetch(name);
  if (!view.ok()) return view.status();
  MutexLock lock(&mu_);
  auto index = IndexOf(handle);
  if (!index.ok()) return index.status();
  // Keep the newer snapshot if a concurrent refresh got one (versions only
  // compare within one incarnation of the peer and of the server).
  const auto& old = entries_[*index].view;
  if (old->incarnation() != (*view)->incarnation() ||
      old->version() <= (*view)->version()) {
    entries_[*index].view = *view;
  }
  entries_[*index].fetched = absl::Now();
  return entries_[*index].view;
}

}  // namespace ferry
