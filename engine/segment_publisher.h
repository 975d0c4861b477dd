// SegmentPublisher: keeps this engine's segment published in the metadata
// service. It holds what was published (the descriptor from Init and the
// buffers registered since), sends each registration as an incremental
// update, renews the segment's lease, and publishes the whole segment
// again when the service no longer knows it: a metadata_server restarted
// without its data, or the lease expired while the engine could not reach
// it. Transfers never wait for it; a metadata service that is down only
// delays the next renewal.
//
// Renewals and the wait for a taken name run on the publisher's Clock.
//
// Thread-safe. Publish, AddBuffer and RemoveBuffer are serialized with the
// renewals, so that a re-publication never drops a buffer being added.
#ifndef FERRY_ENGINE_SEGMENT_PUBLISHER_H_
#define FERRY_ENGINE_SEGMENT_PUBLISHER_H_

#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "metadata/proto/metadata.pb.h"
#include "metadata/store.h"

namespace ferry {

class SegmentPublisher {
 public:
  // While another engine run holds the name, Publish asks again this
  // often.
  static constexpr absl::Duration kNameRetry = absl::Milliseconds(200);
  // A put refused on the way at once (Unavailable within kQuickFailure: a
  // connection reset by a loaded server, seen when a thousand engines of
  // one process started together) is tried again this many times,
  // kNameRetry apart; one that waited out its deadline is not (the
  // service is out of reach: Init says so at once).
  static constexpr int kUnavailableRetries = 2;
  static constexpr absl::Duration kQuickFailure = absl::Seconds(1);

  // `store` and `clock` (null: the system clock) must outlive the
  // publisher. Every change carries `owner_key` (this engine run's). A zero
  // `lease_ttl` publishes without a lease (the segment stays until
  // removed) and renews nothing.
  SegmentPublisher(metadata::Store* store, std::string owner_key,
                   absl::Duration lease_ttl, Clock* clock = RealClock())
      : store_(store),
        clock_(ClockOrReal(clock)),
        owner_key_(std::move(owner_key)),
        lease_ttl_(lease_ttl) {}
  ~SegmentPublisher() { Stop(); }
  SegmentPublisher(const SegmentPublisher&) = delete;
  SegmentPublisher& operator=(const SegmentPublisher&) = delete;

  // Publishes `segment` (its buffers included) and, with a lease, starts
  // renewing it every lease_ttl / 3. While another engine run holds the
  // name (AlreadyExists), tries again for up to `name_wait`; a quick
  // Unavailable, kUnavailableRetries times.
  absl::Status Publish(const descriptor::SegmentDescriptor& segment,
                       absl::Duration name_wait = absl::ZeroDuration());
  // Adds buffers to the published segment: one UpdateBuffers for all of
  // them (the whole segment again if the service lost it). On failure none
  // is added.
  absl::Status AddBuffers(const std::vector<descriptor::Buffer>& buffers);
  // Removes the buffers at `addrs` from the published segment, in one
  // UpdateBuffers.
  absl::Status RemoveBuffers(const std::vector<uint64_t>& addrs);
  // Stops renewing. Idempotent.
  void Stop();
  // Stops renewing and removes the segment from the store (best effort).
  void Withdraw();

  // Times the segment was published again after the service lost it.
  uint64_t republished() const;

 private:
  void RenewLoop();
  // An UpdateBuffers request for this segment, to fill in.
  metadata::UpdateBuffersRequest UpdateRequestLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_);
  // Publishes the whole segment again.
  absl::Status RepublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_);

  // Publishes the whole segment: the descriptor and every buffer.
  metadata::PutSegmentRequest PutRequestLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_);

  metadata::Store* const store_;
  Clock* const clock_;
  const std::string owner_key_;
  const absl::Duration lease_ttl_;

  // Held across the RPCs that change what is published.
  mutable Mutex publish_mu_;
  descriptor::SegmentDescriptor segment_ ABSL_GUARDED_BY(publish_mu_);
  std::map<uint64_t, descriptor::Buffer> buffers_ ABSL_GUARDED_BY(publish_mu_);
  uint64_t republished_ ABSL_GUARDED_BY(publish_mu_) = 0;

  Mutex stop_mu_;
  CondVar stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread renewer_;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_SEGMENT_PUBLISHER_H_
