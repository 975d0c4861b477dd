#include "transport/rdma/peer.h"

#include <algorithm>

#include "transport/rdma/endpoint.h"

namespace ferry::rdma {

Peer::Rail* Peer::FindRail(int local, absl::string_view remote_nic) {
  for (Rail& r : rails) {
    if (r.local == local && r.remote_nic == remote_nic) return &r;
  }
  return nullptr;
}

Peer::Rail& Peer::GetRail(int local, absl::string_view remote_nic) {
  if (Rail* r = FindRail(local, remote_nic)) return *r;
  return rails.emplace_back(local, std::string(remote_nic), we_win_ties_,
                            timeout_ns_);
}

bool Peer::SeeIncarnation(uint64_t inc,
                          std::vector<std::shared_ptr<Endpoint>>* old) {
  if (inc == 0 || inc == incarnation) return true;
  if (std::find(dead_.begin(), dead_.end(), inc) != dead_.end()) return false;
  if (incarnation != 0) {
    dead_.push_back(incarnation);
    if (dead_.size() > kDeadIncarnations) dead_.erase(dead_.begin());
  }
  incarnation = inc;
  rpc_address.clear();  // The new run's comes with its descriptor.
  for (Rail& r : rails) {
    // The connector's only action here is failing the rail's endpoint,
    // which the caller does for every endpoint returned.
    RailConnector::Actions ignored;
    r.conn.Restart(&ignored);
    if (r.ep != nullptr) old->push_back(std::move(r.ep));
    r.ep = nullptr;
    r.health = RailHealth{};
  }
  backoff.Succeeded();
  unresponsive_until_ns = 0;
  reached.store(false, std::memory_order_relaxed);
  return true;
}

bool Peer::HasEndpoints() const {
  for (const Rail& r : rails) {
    if (r.ep != nullptr) return true;
  }
  return false;
}

PeerTable::PeerPtr PeerTable::Get(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = map_.find(name);
  if (it != map_.end()) {
    if (it->second.lru != lru_.begin()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
    }
    return it->second.peer;
  }
  PeerPtr p = factory_(name);
  lru_.push_front(name);
  map_.emplace(name, Entry{p, lru_.begin()});
  if (map_.size() > max_peers_) EvictLocked();
  return p;
}

PeerTable::PeerPtr PeerTable::Find(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = map_.find(name);
  return it == map_.end() ? nullptr : it->second.peer;
}

PeerTable::PeerPtr PeerTable::Remove(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = map_.find(name);
  if (it == map_.end()) return nullptr;
  PeerPtr p = std::move(it->second.peer);
  lru_.erase(it->second.lru);
  map_.erase(it);
  return p;
}

std::vector<PeerTable::PeerPtr> PeerTable::TakeAll() {
  std::vector<PeerPtr> v;
  MutexLock lock(&mu_);
  for (auto& [name, e] : map_) v.push_back(std::move(e.peer));
  map_.clear();
  lru_.clear();
  return v;
}

void PeerTable::Trim() {
  MutexLock lock(&mu_);
  if (map_.size() > max_peers_) EvictLocked();
}

size_t PeerTable::size() const {
  MutexLock lock(&mu_);
  return map_.size();
}

uint64_t PeerTable::evictions() const {
  MutexLock lock(&mu_);
  return evictions_;
}

void PeerTable::EvictLocked() {
  // Oldest first; the newest is never a candidate (it may have been made
  // just now, for endpoints still to come).
  auto it = lru_.end();
  size_t steps = lru_.size();
  while (map_.size() > max_peers_ && steps-- > 1) {
    --it;
    auto e = map_.find(*it);
    bool idle;
    {
      MutexLock plock(&e->second.peer->mu);
      idle = !e->second.peer->HasEndpoints();
    }
    if (!idle) continue;
    auto victim = it;
    ++it;  // Stays valid: erasing `victim` does not touch it.
    map_.erase(e);
    lru_.erase(victim);
    ++evictions_;
  }
}

}  // namespace ferry::rdma
