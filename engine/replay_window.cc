#include "engine/replay_window.h"

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ferry {
namespace {

uint64_t HashOf(absl::string_view s) { return absl::HashOf(s); }

}  // namespace

ReplayWindows::Window& ReplayWindows::NewWindow(const std::string& sender,
                                                const std::string& key) {
  if (windows_.size() >= kMaxSenders) {
    const std::string& gone = lru_.back();
    const Window& g = windows_.at(gone);
    const uint64_t h = HashOf(gone);
    if (!tombstones_.contains(h)) {
      if (tombstones_.size() >= kMaxTombstones) {
        tombstones_.erase(tomb_order_.front());
        tomb_order_.pop_front();
      }
      tomb_order_.push_back(h);
    }
    tombstones_[h] = Tombstone{HashOf(g.key), g.top};
    windows_.erase(gone);
    lru_.pop_back();
  }
  lru_.push_front(sender);
  Window& w = windows_[sender];
  w.lru = lru_.begin();
  w.key = key;
  if (auto t = tombstones_.find(HashOf(sender));
      t != tombstones_.end() && t->second.key_hash == HashOf(key)) {
    // Heard before under this key, and forgotten: nothing at or below its
    // highest number can be told from a replay.
    w.top = w.floor = t->second.top;
  }
  return w;
}

absl::Status ReplayWindows::Accept(const std::string& sender,
                                   const std::string& key, uint64_t seq) {
  if (seq == 0) {
    return absl::PermissionDeniedError(
        "the message carries no number (a signed message must)");
  }
  auto it = windows_.find(sender);
  Window* w;
  if (it == windows_.end()) {
    w = &NewWindow(sender, key);
  } else {
    w = &it->second;
    lru_.splice(lru_.begin(), lru_, w->lru);
    if (w->key != key) {
      // The sender restarted (the caller verified `key` is the one it
      // publishes now): its numbers start over.
      w->key = key;
      w->top = w->floor = 0;
      w->seen.reset();
    }
  }
  if (seq <= w->floor) {
    return absl::FailedPreconditionError(absl::StrCat(
        "message ", seq, " is at or below ", w->floor,
        ", the newest this receiver had from the sender before it forgot "
        "its window: too old to tell from a replay"));
  }
  if (seq > w->top) {
    if (seq - w->top >= kWindow) {
      w->seen.reset();
    } else {
      for (uint64_t s = w->top + 1; s < seq; ++s) w->seen.reset(s % kWindow);
    }
    w->top = seq;
    w->seen.set(seq % kWindow);
    return absl::OkStatus();
  }
  if (w->top - seq >= kWindow) {
    return absl::FailedPreconditionError(absl::StrCat(
        "message ", seq, " is ", kWindow,
        " or more behind the newest this receiver has had from the sender (",
        w->top, "): too old to tell from a replay"));
  }
  if (w->seen.test(seq % kWindow)) {
    return absl::PermissionDeniedError(
        absl::StrCat("message ", seq, " was received before: a replay"));
  }
  w->seen.set(seq % kWindow);
  return absl::OkStatus();
}

}  // namespace ferry
