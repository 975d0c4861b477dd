// SenderCheck: whether a call (a notification, a handshake or rail notice
// through Exchange) comes from the segment it names. The segment must be
// registered (as this engine sees the metadata) and publish an identity
// key (common/identity.h), and the call must carry that key's signature of
// what it says: only the process that published the segment holds the
// key, whatever host or token a spoofer has. A numbered call (a
// notification) is also accepted once (ReplayWindows). Segments that
// publish no key (engines of a release before identity keys) get a host
// check: the call must come from the host the segment is published at --
// or no check, where the caller asks for none (Exchange: releases before
// keys checked nothing there, and multi-homed or NATed peers fail a host
// check). In P2P mode, where a segment's name is its address and there is
// no metadata service, a call is held to the claimed address's host first
// (a lookup first would dial whatever a caller names), and then checked
// against the key that address publishes, read from it; where the caller
// asks for no host check (Exchange), the claimed address is read for its
// key wherever it is (on the caller's lookup budget below; never a
// loopback address for a remote caller).
//
// A refusal is PermissionDenied only when it rests on what was read of the
// segment after the check began; one that rests on an older read is
// Unavailable ("try again": the segment may have just restarted or
// registered), once the check could not read it again now.
//
// The metadata is read on a caller's behalf at a bounded rate, so that a
// flood of calls naming made-up or spoofed segments cannot turn this into
// load on the metadata service or hold the threads that serve calls:
//   * answers are cached: segments found for kCacheFor, the kMaxCached
//     most recently used (a key changes only when its segment restarts,
//     which a signature that does not match shows: then it is read again);
//     names not found for kAbsentFor, apart, at most kMaxAbsent (made-up
//     names never push out real ones); a call refused on a cached answer
//     older than kRecheckAfter reads it again, on the caller's budget;
//   * each caller address may cause kLookupBurst reads at once and
//     kLookupsPerSecond after (a token bucket) for checks that fail: a
//     read whose answer then verifies a call of the caller that paid for
//     it gives that caller its token back, once (not in P2P mode, where a
//     read dials the claimed address), so a
//     host that starts many engines at once (a handshake storm,
//     bench/storm_bench) is not refused for them, while reads for
//     made-up names, forged signatures or rechecks still drain the
//     budget; checks of a name being read share that read;
//   * reads run on threads of the check's own, at most
//     kMaxLookupsInFlight at once, from a queue of at most kMaxQueued
//     names; a check whose name is read waits for it (up to kReadWait),
//     and at most kMaxWaiting checks wait at once; beyond, the check is
//     told to try again (Unavailable) at once, while its read stays
//     queued: the next try finds the answer cached. So a handshake storm
//     is admitted at the pace of the reads, not refused, and a metadata
//     store that hangs holds at most kMaxWaiting of the threads that
//     serve calls (the readers are the check's own);
//   * a read that fails (the metadata is out of reach) stops new reads for
//     kStoreDownFor, and meanwhile the key last read for a segment is used
//     for up to `outage_grace` past its cache time (the segments' lease: no
//     longer than the segment could have lived unrenewed).
// Times are steady (monotonic) real time, not the engine's clock: a test's
// simulated clock that never moves would keep an answer for ever, and a
// wall clock that steps back would too.
//
// Thread-safe.
#ifndef FERRY_ENGINE_SENDER_CHECK_H_
#define FERRY_ENGINE_SENDER_CHECK_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "engine/replay_window.h"
#include "metadata/store.h"

namespace ferry {

class SenderCheck {
 public:
  static constexpr size_t kMaxCached = 1024;
  static constexpr size_t kMaxAbsent = 256;
  static constexpr absl::Duration kCacheFor = absl::Seconds(30);
  static constexpr absl::Duration kAbsentFor = absl::Seconds(2);
  // A cached answer younger than this that refuses a call is not read
  // again (the call is told to try again).
  static constexpr absl::Duration kRecheckAfter = absl::Milliseconds(250);
  // Generous: the reads in flight are bounded anyway; this keeps one
  // address from holding them all. A host that starts many engines at
  // once (rdma_fault_test starts 50 in a few seconds) stays well within.
  static constexpr double kLookupBurst = 64;
  static constexpr double kLookupsPerSecond = 32;
  // Reads at once: a storm of new senders is read at this many times one
  // read's pace (a read is a round trip to the metadata service, which
  // serves more at once than one).
  static constexpr int kMaxLookupsInFlight = 16;
  static constexpr size_t kMaxQueued = 1024;
  static constexpr int kMaxWaiting = 8;
  static constexpr absl::Duration kReadWait = absl::Seconds(1);
  static constexpr absl::Duration kStoreDownFor = absl::Seconds(1);

  // Steady (monotonic) real time as an absl::Time: what the check ages
  // its answers and budgets by unless told otherwise.
  static absl::Time SteadyNow();
  using NowFn = absl::Time (*)();

  // `store` must outlive the check. `now`: where time is read (tests);
  // null: SteadyNow. `p2p`: names are addresses (P2PHANDSHAKE) and `store`
  // reads a descriptor from the address it names (P2pStore): a check that
  // holds the caller to the claimed host does, and only then reads the
  // claimed address, on the caller's own host, for its key (a lookup
  // before the host check would dial whatever a caller names); one that
  // does not hold it reads the claimed address wherever it is, on the
  // caller's lookup budget. A null store: host checks only.
  explicit SenderCheck(metadata::Store* store,
                       absl::Duration outage_grace = absl::ZeroDuration(),
                       NowFn now = nullptr, bool p2p = false)
      : store_(store),
        outage_grace_(outage_grace),
        now_(now != nullptr ? now : &SteadyNow),
        p2p_(p2p || store == nullptr) {}
  // Waits for the reads running (each bounded by the store's own timeout).
  ~SenderCheck();
  SenderCheck(const SenderCheck&) = delete;
  SenderCheck& operator=(const SenderCheck&) = delete;

  // OK if `signature` is segment `claimed`'s signature of `content`, by
  // the identity key its descriptor publishes, and `seq` (if given) is a
  // number not accepted from that key before. For a segment that
  // publishes no key: if `check_host`, OK if `caller` ("ipv4:10.0.0.7",
  // "ipv6:[fd00::7]", as metadata::CallerAddress gives it) is on the
  // segment's host; else OK. In P2P mode, before any of that, a
  // `check_host` call must come from the claimed address's host, and any
  // other must claim an address worth reading (P2pReadable).
  // PermissionDenied saying what does not match; Unavailable (try again)
  // if that could not be told now.
  absl::Status Verify(const std::string& claimed, const std::string& caller,
                      const std::string& content, const std::string& signature,
                      std::optional<uint64_t> seq = std::nullopt,
                      bool check_host = true);

  // Checks waiting now for a read (tests wait for a known number before
  // they go on).
  int WaitingForTesting() {
    MutexLock lock(&mu_);
    return waiting_;
  }

 private:
  struct Cached {
    bool found = false;
    std::string identity_key;  // Empty: the descriptor publishes none.
    std::string host;          // Of its rpc address (keyless engines).
    absl::Time at;             // When it was read (SteadyNow).
    // The caller whose budget paid for the read, until refunded.
    std::string charged;
  };
  struct Read {
    std::string name;
    std::string charged;  // metadata::AddressGroup of the caller.
  };
  struct Entry {
    Cached value;
    std::list<std::string>::iterator lru;
  };
  struct Bucket {
    double tokens = kLookupBurst;
    absl::Time at;
  };

  // What segment `claimed` publishes: an answer read at or after `since`,
  // or (unless `fresh`) one still cached; else read (on `caller`'s
  // budget, unless a read of it is queued or running already) and waited
  // for.
  absl::StatusOr<Cached> Published(const std::string& claimed,
                                   const std::string& caller, bool fresh,
                                   absl::Time since);
  // Queues a read of `claimed` on `caller`'s budget, starting a reader if
  // the idle ones are too few; Unavailable saying why not.
  absl::Status QueueReadLocked(const std::string& claimed,
                               const std::string& caller, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A reader thread: reads queued names until the check is destroyed.
  void Reader();
  // Gives back the token that the read of `claimed` took, if caller group
  // `group` paid for it and was not refunded yet.
  void RefundLocked(const std::string& claimed, const std::string& group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<Cached> FindLocked(const std::string& claimed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CacheLocked(const std::string& claimed, const Cached& value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // While the metadata is out of reach: the key last read, within the
  // grace, or Unavailable.
  absl::StatusOr<Cached> GraceLocked(const std::string& claimed, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK, and one read taken from `caller`'s budget; Unavailable saying
  // whose budget (or the table of budgets) is spent.
  // Gives back a token TakeLookupLocked took (the check it was read for
  // passed: the sender holds the segment's key).
  void ReturnLookupLocked(const std::string& caller)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status TakeLookupLocked(const std::string& caller, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status VerifyP2p(const std::string& claimed, const std::string& caller);
  // P2P, no host check: OK if `claimed` is an address worth reading for
  // its key on `caller`'s say-so (not a wildcard, and not loopback unless
  // the caller is).
  absl::Status P2pReadable(const std::string& claimed,
                           const std::string& caller);

  metadata::Store* const store_;
  const absl::Duration outage_grace_;
  const NowFn now_;
  const bool p2p_;
  Mutex mu_;
  absl::flat_hash_map<std::string, Entry> cache_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // Most recent first.
  absl::flat_hash_map<std::string, absl::Time> absent_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Bucket> budgets_ ABSL_GUARDED_BY(mu_);
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Read> queue_ ABSL_GUARDED_BY(mu_);
  // Names queued or being read: a check of one waits for that read
  // instead of queueing its own.
  absl::flat_hash_set<std::string> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> readers_ ABSL_GUARDED_BY(mu_);
  int idle_readers_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  CondVar work_;       // For the readers.
  CondVar looked_up_;  // For the checks.
  absl::Time store_down_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::string store_error_ ABSL_GUARDED_BY(mu_);
  // Per segment; a restarted segment has a new key, and its numbers start
  // over.
  ReplayWindows replay_ ABSL_GUARDED_BY(mu_);
};

// "ipv4:10.0.0.7" or "ipv6:[fd00::7]" (or a bare address) -> the address;
// an IPv4 address mapped into IPv6 (a dual-stack listener) as IPv4.
std::string BareCallerHost(const std::string& caller);

}  // namespace ferry

#endif  // FERRY_ENGINE_SENDER_CHECK_H_
