// SegmentStore: the metadata service's in-memory table of segment
// descriptors. Thread-safe: every method may be called concurrently.
#ifndef FERRY_METADATA_SEGMENT_STORE_H_
#define FERRY_METADATA_SEGMENT_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "metadata/proto/metadata.pb.h"

namespace ferry::metadata {

class SegmentStore {
 public:
  // Bounds the table so a client cannot exhaust the server's memory.
  static constexpr size_t kMaxSegments = 1 << 16;

  // Validates and stores `segment`, replacing any entry of the same name.
  // Returns the version assigned to it.
  absl::StatusOr<uint64_t> Put(SegmentDescriptor segment);

  // Adds and removes buffers of an existing segment. Fails with NotFound if
  // the segment does not exist, FailedPrecondition if `incarnation` is not
  // the stored one (a stale engine), InvalidArgument if a buffer is bad or
  // overlaps another, NotFound if an address to remove is not registered.
  // Nothing changes on failure.
  absl::StatusOr<uint64_t> UpdateBuffers(const UpdateBuffersRequest& request);

  // Returns a copy of the named descriptor or NotFound.
  absl::StatusOr<SegmentDescriptor> Get(const std::string& name) const;

  // Removes the named segment. With a nonzero `incarnation`, removes it only
  // if it matches (FailedPrecondition otherwise). NotFound if absent.
  absl::Status Remove(const std::string& name, uint64_t incarnation);

  std::vector<std::string> List() const;

 private:
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, SegmentDescriptor> segments_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_version_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_SEGMENT_STORE_H_
