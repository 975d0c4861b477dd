// SenderCheck: whether a notification's claimed sender is who the
// connection says it is. The claimed segment must be registered (as this
// engine sees the metadata) and its peer-service address must be on the
// host the call came from; in P2P mode a segment's name is its address,
// so the name's host is compared with no lookup at all.
//
// Lookups are bounded: results (found or not) are cached for kCacheFor, so
// a burst from one peer costs one metadata read; at most
// kMaxLookupsInFlight run at once (beyond, the check answers Unavailable at
// once rather than tie up the threads that serve calls); the cache holds
// at most kMaxCached names.
//
// What this proves: the sender runs on the host the segment is published
// from. Not which process there: another process on that host could still
// claim it (give engines on shared hosts the cluster's token and TLS).
//
// Thread-safe.
#ifndef FERRY_ENGINE_SENDER_CHECK_H_
#define FERRY_ENGINE_SENDER_CHECK_H_

#include <cstddef>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "metadata/store.h"

namespace ferry {

class SenderCheck {
 public:
  static constexpr size_t kMaxCached = 1024;
  static constexpr absl::Duration kCacheFor = absl::Seconds(2);
  static constexpr int kMaxLookupsInFlight = 4;

  // `store` (null in P2P mode, where names are addresses) and `clock`
  // (null: the system clock; it ages the cache) must outlive the check.
  explicit SenderCheck(metadata::Store* store, Clock* clock = RealClock())
      : store_(store), clock_(ClockOrReal(clock)) {}

  // OK if segment `claimed` is published with a peer-service address on
  // the host of `caller` ("ipv4:10.0.0.7", "ipv6:[fd00::7]", as
  // metadata::CallerAddress gives it); PermissionDenied saying what does
  // not match; Unavailable if the segment could not be looked up now.
  absl::Status Verify(const std::string& claimed, const std::string& caller);

 private:
  struct Cached {
    std::string host;  // Of the segment's rpc address; empty: not found.
    absl::Time at;
  };
  // The host segment `claimed` is published on ("" if it is not), from
  // the cache or the store.
  absl::StatusOr<std::string> PublishedHost(const std::string& claimed);

  metadata::Store* const store_;
  Clock* const clock_;
  Mutex mu_;
  absl::flat_hash_map<std::string, Cached> cache_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Names being looked up now: a second check of one waits for that
  // lookup instead of taking a slot of its own (a burst from one sender,
  // or many workers of one engine, costs one lookup, and is not refused
  // for want of slots).
  absl::flat_hash_set<std::string> looking_up_ ABSL_GUARDED_BY(mu_);
  CondVar looked_up_;
};

// "ipv4:10.0.0.7" or "ipv6:[fd00::7]" (or a bare address) -> the address;
// an IPv4 address mapped into IPv6 (a dual-stack listener) as IPv4.
std::string BareCallerHost(const std::string& caller);

}  // namespace ferry

#endif  // FERRY_ENGINE_SENDER_CHECK_H_
