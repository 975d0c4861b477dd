// What an etcd store holds and how long etcd keeps its history, against
// the limits of EtcdLimits: EtcdUsage counts the bytes and segments under
// the prefix (in all and per client) and says whether one more write fits;
// EtcdCompaction says when history is old enough, or large enough, to
// compact. Neither talks to etcd (the store reads the records and sends
// the compactions), and neither is thread-safe: the store holds its write
// lock around them.
#ifndef FERRY_METADATA_ETCD_ETCD_USAGE_H_
#define FERRY_METADATA_ETCD_ETCD_USAGE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ferry/etcd_limits.h"

namespace ferry::metadata {

// What the records in etcd said when last counted, and this store's
// writes since.
class EtcdUsage {
 public:
  // `prefix` only names the store in errors.
  EtcdUsage(const EtcdLimits& limits, std::string prefix)
      : limits_(limits), prefix_(std::move(prefix)) {}

  // Whether the counts are due to be counted from the records again
  // (usage_refresh old, or never counted).
  bool Stale(absl::Time now) const {
    return now - counted_at_ >= limits_.usage_refresh;
  }
  // Counts `bytes` (net) and `segments` (+1, 0 or -1) for `client` and the
  // total; "" is no client, which only the total binds.
  void Add(const std::string& client, int64_t bytes, int64_t segments);
  // Takes the counts of `counted` (the records read at `now`, each Add-ed
  // to a fresh EtcdUsage) in place of these.
  void Reset(EtcdUsage counted, absl::Time now);
  // ResourceExhausted if `client` (with `old_client_bytes` given back: a
  // segment of its own it replaces) cannot store `bytes` more, or one
  // more segment if `new_segment`, or the total (with `old_bytes` given
  // back) would pass its limit.
  absl::Status Check(const std::string& client, uint64_t old_client_bytes,
                     uint64_t old_bytes, uint64_t bytes,
                     bool new_segment) const;

 private:
  struct Usage {
    int64_t bytes = 0;
    int64_t segments = 0;
  };

  EtcdLimits limits_;
  std::string prefix_;
  absl::Time counted_at_ = absl::InfinitePast();
  Usage total_;
  std::map<std::string, Usage> by_client_;
};

// Which history to compact: etcd keeps every revision until it is
// compacted, so updates would fill its quota however small the live data.
// History goes when it is compact_after old, and all of it as soon as this
// store has written a share of max_bytes since the last compaction, so
// that a client rewriting its records fast (inside its quota) cannot
// write gigabytes of history within compact_after.
class EtcdCompaction {
 public:
  // History this store writes between compactions is at most
  // max_bytes / kVolumeShare (plus one write). The live records are at
  // most max_bytes (EtcdUsage, every store sharing the prefix together),
  // so the database, as counted, stays under (1 + k / kVolumeShare) x
  // max_bytes with k stores writing: 320 MiB for one store and 768 MiB for
  // eight at the default 256 MiB, which leaves etcd's default 2 GiB quota room
  // for its own overhead per revision and page. A smaller share would compact
  // more often for little: each compaction is etcd-wide and walks its index.
  // Several metadata_servers (or engines) sharing one etcd each count only
  // their own writes, which is what the k above is: each one bounds the
  // history it adds, none needs to see the others'.
  static constexpr uint64_t kVolumeShare = 4;

  // compact_after 0 or less: never, by volume either (other applications
  // that share the cluster and read older revisions rely on that).
  explicit EtcdCompaction(const EtcdLimits& limits)
      : compact_after_(limits.compact_after),
        compact_bytes_(limits.max_bytes / kVolumeShare) {}

  // Counts what a write put into etcd's history: the keys and values put,
  // the keys deleted.
  void Count(uint64_t bytes) { written_ += bytes; }
  // After a write at `revision` (its bytes Count-ed): the revision to
  // compact up to now, or 0 (none due, or compaction is off).
  int64_t Wrote(absl::Time now, int64_t revision);

 private:
  struct Sample {
    absl::Time at;
    int64_t revision;
    uint64_t written;  // written_ once that revision was written.
  };

  const absl::Duration compact_after_;
  const uint64_t compact_bytes_;
  // Revisions written at (about one a second), oldest first, to compact
  // up to the newest that is compact_after old; and the last compaction.
  std::deque<Sample> revisions_;
  int64_t compacted_ = 0;
  // Bytes Count-ed in all, and when history was last compacted (what is
  // written above the compacted revision is the difference).
  uint64_t written_ = 0;
  uint64_t written_at_compacted_ = 0;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_ETCD_ETCD_USAGE_H_
