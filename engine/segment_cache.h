// SegmentCache: segment handles and the cached descriptors behind them.
// A handle is (engine tag << 48) | (index + 1): handles of another engine or
// made-up values are rejected. Thread-safe.
#ifndef FERRY_ENGINE_SEGMENT_CACHE_H_
#define FERRY_ENGINE_SEGMENT_CACHE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "engine/transfer_engine.h"
#include "metadata/metadata_client.h"
#include "transport/segment_view.h"

namespace ferry {

class SegmentCache {
 public:
  // `client` must outlive the cache. `tag` distinguishes engines' handles.
  SegmentCache(metadata::MetadataClient* client, uint16_t tag)
      : client_(client), tag_(tag) {}

  // Returns the cached handle of `name`, fetching the descriptor the first
  // time. NotFound if the segment is not registered.
  absl::StatusOr<SegmentHandle> Open(const std::string& name);

  // The current snapshot, or NotFound for an invalid handle. A snapshot
  // marked stale is fetched again first, at most every 100 ms per segment
  // (if that fails, the cached one is returned).
  absl::StatusOr<std::shared_ptr<const SegmentView>> Get(SegmentHandle handle);

  // Marks the snapshot as possibly out of date (a request to the segment
  // failed: it may have unregistered the buffer, moved or restarted).
  // Cheap; safe from any thread, including completion threads.
  void MarkStale(SegmentHandle handle);

  // Fetches the descriptor again and returns the new snapshot.
  absl::StatusOr<std::shared_ptr<const SegmentView>> Refresh(
      SegmentHandle handle);

 private:
  struct Entry {
    std::string name;
    std::shared_ptr<const SegmentView> view;
    bool stale = false;
    absl::Time fetched = absl::InfinitePast();
  };

  absl::StatusOr<size_t> IndexOf(SegmentHandle handle) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<const SegmentView>> Fetch(
      const std::string& name);

  metadata::MetadataClient* const client_;
  const uint16_t tag_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, SegmentHandle> by_name_ ABSL_GUARDED_BY(mu_);
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_ENGINE_SEGMENT_CACHE_H_
