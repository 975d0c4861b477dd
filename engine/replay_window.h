// ReplayWindows: which numbered messages a receiver has had from each
// sender, so that a captured message is accepted once. Each number is
// accepted once; one kWindow or more below the highest a sender has sent
// here is refused too, since it can no longer be told from a replay (the
// anti-replay window of IPsec, RFC 4303 section 3.4.3).
//
// A sender numbers what it sends to every receiver from one count, so a
// receiver sees gaps, which are fine; a message overtaken by kWindow later
// ones of the same sender (many concurrent notifications stuck behind a
// slow one) is refused as too old.
//
// One window per sender name, for the identity key it signs with now: a
// sender that restarts has a new key, its numbers start over, and its old
// messages no longer verify. So a name holds one window however often its
// owner changes keys.
//
// Bounded: at most kMaxSenders windows, the least recently used forgotten
// first. A forgotten window leaves a tombstone (a hash of the name and of
// the key, and the highest number accepted), kMaxTombstones of them, the
// oldest dropped first: a sender heard again under the same key starts
// above that number, so its earlier messages are not accepted twice. A
// replay gets through only once both are gone, which takes kMaxSenders +
// kMaxTombstones other segment names, each registered with the metadata
// service and signing messages to this receiver, since the victim was last
// heard.
//
// Not thread-safe: the caller serializes.
#ifndef FERRY_ENGINE_REPLAY_WINDOW_H_
#define FERRY_ENGINE_REPLAY_WINDOW_H_

#include <bitset>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace ferry {

class ReplayWindows {
 public:
  static constexpr uint64_t kWindow = 4096;
  static constexpr size_t kMaxSenders = 4096;  // 2 MiB of windows at most.
  static constexpr size_t kMaxTombstones = 1 << 16;  // About 2 MiB.

  // OK, and `seq` recorded, if message `seq` of `sender`, signed with
  // `key`, is new here. PermissionDenied if it was received before (or is
  // 0, no message's number); FailedPrecondition if it is too old to tell
  // (a sender that sends it again gives it a new number).
  absl::Status Accept(const std::string& sender, const std::string& key,
                      uint64_t seq);

  size_t senders() const { return windows_.size(); }
  size_t tombstones() const { return tombstones_.size(); }

 private:
  struct Window {
    std::string key;
    uint64_t top = 0;  // The highest number accepted.
    // Numbers at or below: refused as too old (a window restored from a
    // tombstone knows no more of them).
    uint64_t floor = 0;
    // Bit seq % kWindow, for seq in (top - kWindow, top]: accepted.
    std::bitset<kWindow> seen;
    std::list<std::string>::iterator lru;
  };
  struct Tombstone {
    uint64_t key_hash = 0;
    uint64_t top = 0;
  };

  Window& NewWindow(const std::string& sender, const std::string& key);

  absl::flat_hash_map<std::string, Window> windows_;
  std::list<std::string> lru_;  // Most recently used first.
  // By a hash of the sender's name; oldest first in tomb_order_.
  absl::flat_hash_map<uint64_t, Tombstone> tombstones_;
  std::deque<uint64_t> tomb_order_;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_REPLAY_WINDOW_H_
