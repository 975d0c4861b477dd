// SieveCache: a bounded map with SIEVE eviction (Zhang et al., NSDI'24):
// a FIFO queue, a "visited" bit set on every hit, and a hand that sweeps
// from the oldest entry clearing visited bits and evicts the first entry
// that was not visited since the hand last passed it. Cheaper than LRU (a
// hit only sets a bit) and better at keeping a hot set.
//
// Entries for which `busy(value)` is true are never evicted: an endpoint
// with work in flight stays, and the cache grows past its capacity instead
// (counted in over_capacity_inserts()).
//
// Hits can also be recorded outside the cache, without its lock (the data
// path sets a flag in the value): `take_visit(value)` is asked when the
// hand passes an entry, returns whether it was used since, and clears that.
//
// Not thread-safe: the owner locks.
#ifndef FERRY_TRANSPORT_RDMA_SIEVE_CACHE_H_
#define FERRY_TRANSPORT_RDMA_SIEVE_CACHE_H_

#include <cstddef>
#include <functional>
#include <iterator>
#include <list>
#include <map>
#include <utility>
#include <vector>

namespace ferry::rdma {

template <typename K, typename V>
class SieveCache {
 public:
  using Busy = std::function<bool(const V&)>;
  using TakeVisit = std::function<bool(const V&)>;

  SieveCache(size_t capacity, Busy busy, TakeVisit take_visit = nullptr)
      : capacity_(capacity == 0 ? 1 : capacity),
        busy_(std::move(busy)),
        take_visit_(std::move(take_visit)) {}

  // Returns the value for `key` (marking it visited), or nullptr.
  V* Find(const K& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    it->second.visited = true;
    return &it->second.value;
  }

  // Like Find, without marking it visited.
  const V* Peek(const K& key) const {
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : &it->second.value;
  }

  // Inserts or replaces `key`. Evicts entries to stay within capacity
  // (unless !allow_evict: then it grows past it); the evicted values are
  // appended to `evicted` (if given).
  void Insert(const K& key, V value, std::vector<V>* evicted = nullptr,
              bool allow_evict = true) {
    auto it = map_.find(key);
    if (it != map_.end()) {
      it->second.value = std::move(value);
      it->second.visited = true;
      return;
    }
    while (map_.size() >= capacity_) {
      if (!allow_evict || !EvictOne(evicted)) {
        ++over_capacity_;
        break;
      }
    }
    queue_.push_front(key);
    map_.emplace(key, Entry{std::move(value), false, queue_.begin()});
  }

  // Evicts entries until it is within capacity again, or until every
  // entry left is busy; the evicted values are appended to `evicted`.
  // (Insert with !allow_evict, or busy entries, may have let it grow.)
  void Trim(std::vector<V>* evicted) {
    while (map_.size() > capacity_ && EvictOne(evicted)) {
    }
  }

  // Removes `key`; returns whether it was present.
  bool Erase(const K& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return false;
    if (hand_valid_ && hand_ == it->second.pos) Advance();
    queue_.erase(it->second.pos);
    if (queue_.empty()) hand_valid_ = false;
    map_.erase(it);
    return true;
  }

  template <typename F>
  void ForEach(F f) const {
    for (const auto& [k, e] : map_) f(k, e.value);
  }

  void Clear() {
    map_.clear();
    queue_.clear();
    hand_valid_ = false;
  }

  size_t size() const { return map_.size(); }
  size_t capacity() const { return capacity_; }
  size_t over_capacity_inserts() const { return over_capacity_; }

 private:
  struct Entry {
    V value;
    bool visited;
    typename std::list<K>::iterator pos;
  };

  // Moves the hand one step towards the newest entry, wrapping around.
  void Advance() {
    if (hand_ == queue_.begin()) {
      hand_ = std::prev(queue_.end());
    } else {
      --hand_;
    }
  }

  bool EvictOne(std::vector<V>* evicted) {
    if (queue_.empty()) return false;
    if (!hand_valid_) {
      hand_ = std::prev(queue_.end());  // Start at the oldest.
      hand_valid_ = true;
    }
    // Two sweeps clear every visited bit; a third full pass finding only
    // busy entries means nothing can go.
    for (size_t steps = 0; steps < 3 * queue_.size(); ++steps) {
      auto it = map_.find(*hand_);
      Entry& e = it->second;
      const bool outside_hit = take_visit_ != nullptr && take_visit_(e.value);
      if (e.visited || outside_hit) {
        e.visited = false;
        Advance();
        continue;
      }
      if (busy_(e.value)) {
        Advance();
        continue;
      }
      auto victim = hand_;
      Advance();
      if (evicted != nullptr) evicted->push_back(std::move(e.value));
      map_.erase(it);
      queue_.erase(victim);
      if (queue_.empty()) hand_valid_ = false;
      return true;
    }
    return false;
  }

  const size_t capacity_;
  Busy busy_;
  TakeVisit take_visit_;
  std::map<K, Entry> map_;
  std::list<K> queue_;  // Front: newest.
  typename std::list<K>::iterator hand_;
  bool hand_valid_ = false;
  size_t over_capacity_ = 0;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_SIEVE_CACHE_H_
