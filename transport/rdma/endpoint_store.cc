#include "transport/rdma/endpoint_store.h"

namespace ferry::rdma {

EndpointStore::EndpointStore(size_t max_live)
    : live_(
          max_live,
          // Only idle endpoints may go: never one with work queued or in
          // flight, one still connecting, or one its initiator has not
          // confirmed (it may be about to send on it).
          [](const EndpointPtr& ep) { return !ep->Idle(); },
          [](const EndpointPtr& ep) {
            return ep->used.exchange(false, std::memory_order_relaxed);
          }) {}

void EndpointStore::Insert(const EndpointPtr& ep,
                           std::vector<EndpointPtr>* evicted) {
  MutexLock lock(&mu_);
  // A racing failure may have drained and dropped it before it got here.
  if (ep->left_store.load(std::memory_order_relaxed)) return;
  live_.Insert(ep->id(), ep, evicted);
}

void EndpointStore::Trim(std::vector<EndpointPtr>* evicted) {
  MutexLock lock(&mu_);
  live_.Trim(evicted);
}

void EndpointStore::Keep(const EndpointPtr& ep) {
  MutexLock lock(&mu_);
  if (ep->left_store.load(std::memory_order_relaxed)) return;
  live_.Insert(ep->id(), ep, nullptr, /*allow_evict=*/false);
}

void EndpointStore::Drain(const EndpointPtr& ep) {
  MutexLock lock(&mu_);
  ep->left_store.store(true, std::memory_order_relaxed);
  const EndpointPtr* cur = live_.Peek(ep->id());
  if (cur != nullptr && *cur == ep) live_.Erase(ep->id());
  draining_[ep->id()] = ep;
}

bool EndpointStore::Remove(const Endpoint& ep) {
  MutexLock lock(&mu_);
  ep.left_store.store(true, std::memory_order_relaxed);
  bool held = false;
  const EndpointPtr* cur = live_.Peek(ep.id());
  if (cur != nullptr && cur->get() == &ep) held = live_.Erase(ep.id());
  auto it = draining_.find(ep.id());
  if (it != draining_.end() && it->second.get() == &ep) {
    draining_.erase(it);
    held = true;
  }
  return held;
}

std::vector<EndpointStore::EndpointPtr> EndpointStore::Live() const {
  std::vector<EndpointPtr> v;
  MutexLock lock(&mu_);
  v.reserve(live_.size());
  live_.ForEach(
      [&](const uint64_t&, const EndpointPtr& ep) { v.push_back(ep); });
  return v;
}

std::vector<EndpointStore::EndpointPtr> EndpointStore::Draining() const {
  std::vector<EndpointPtr> v;
  MutexLock lock(&mu_);
  v.reserve(draining_.size());
  for (const auto& [id, ep] : draining_) v.push_back(ep);
  return v;
}

std::vector<EndpointStore::EndpointPtr> EndpointStore::TakeAll() {
  std::vector<EndpointPtr> v;
  MutexLock lock(&mu_);
  live_.ForEach(
      [&](const uint64_t&, const EndpointPtr& ep) { v.push_back(ep); });
  live_.Clear();
  for (auto& [id, ep] : draining_) v.push_back(std::move(ep));
  draining_.clear();
  return v;
}

size_t EndpointStore::live() const {
  MutexLock lock(&mu_);
  return live_.size();
}

size_t EndpointStore::draining() const {
  MutexLock lock(&mu_);
  return draining_.size();
}

}  // namespace ferry::rdma
