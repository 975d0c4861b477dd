// Notifications: the receiving end of SendNotification. Decides whether a
// notification is meant for this run of this segment and whether its
// sender checks out, then queues it for GetNotifications within bounded
// totals and a bounded share per sender address, so that one peer flooding
// the queue cannot crowd out the others.
//
// Thread-safety: Receive (on the peer service's handler threads), Take and
// stats may run concurrently. mu_ guards the queue and its counts and is
// never held across the verifier, which may read the metadata. Configure
// is a lifecycle call: made before the peer service can call Receive, and
// never while a Receive runs.
#ifndef FERRY_ENGINE_NOTIFICATIONS_H_
#define FERRY_ENGINE_NOTIFICATIONS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "ferry/transfer_engine.h"
#include "metadata/proto/metadata.pb.h"

namespace ferry {

class Notifications {
 public:
  // EngineOptions' max_queued_notification* limits.
  struct Limits {
    size_t max_count = 0;
    size_t max_bytes = 0;
    size_t max_count_per_sender = 0;
    size_t max_bytes_per_sender = 0;
  };
  // Checks that a notification comes from the segment it names (the
  // engine's SenderCheck): OK if it does; Unavailable if that cannot be
  // told now.
  using Verifier = std::function<absl::Status(
      const metadata::NotifyRequest& request, const std::string& sender)>;
  struct Stats {
    size_t queued = 0;
    size_t bytes = 0;
    uint64_t refused = 0;
  };

  // This run: its limits, its name and incarnation (what a notification
  // must be addressed to, if it names a receiver), whether an unverified
  // notification is refused or queued as such, and the check of senders.
  // The queue itself is kept (across an engine's Shutdown and Init too).
  void Configure(const Limits& limits, std::string local_segment,
                 uint64_t incarnation, bool refuse_unverified, Verifier verify);

  // Queues a notification from `sender` (the caller's address, as the
  // connection shows it), or says why not: ResourceExhausted over a limit;
  // FailedPrecondition, hinted kRefreshReceiver, if it is addressed to
  // another segment or to an earlier run of this one; with
  // refuse_unverified, the sender check's error (Unavailable marked
  // retry-later). Every refusal is counted.
  absl::Status Receive(const metadata::NotifyRequest& request,
                       const std::string& sender);
  // Everything queued, oldest first, leaving the queue empty.
  std::vector<Notification> Take();
  Stats stats() const;

 private:
  // What each sender address holds in the queue.
  struct SenderShare {
    size_t count = 0;
    size_t bytes = 0;
  };

  // OK if a notification of `bytes` from `sender` fits the queue (counts a
  // refusal otherwise).
  absl::Status AdmitLocked(const std::string& sender, size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FailedPrecondition (hinted kRefreshReceiver) if `request` names a
  // receiver that is not this run of this segment.
  absl::Status CheckAddressee(const metadata::NotifyRequest& request) const;
  // Counts a refusal and returns `refusal`.
  absl::Status Refuse(absl::Status refusal);

  // Set by Configure, which never runs concurrently with Receive: read
  // without a lock.
  std::string local_segment_;
  uint64_t incarnation_ = 0;
  bool refuse_unverified_ = true;
  Verifier verify_;

  mutable Mutex mu_;
  Limits limits_ ABSL_GUARDED_BY(mu_);
  std::deque<Notification> queue_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, SenderShare> shares_ ABSL_GUARDED_BY(mu_);
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_NOTIFICATIONS_H_
