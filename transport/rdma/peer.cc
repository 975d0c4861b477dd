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
  Rail& r = rails.emplace_back();
  r.local = local;
  r.remote_nic = std::string(remote_nic);
  return r;
}

bool Peer::IsDead(uint64_t inc) const {
  return std::find(dead_.begin(), dead_.end(), inc) != dead_.end();
}

std::vector<std::shared_ptr<Endpoint>> Peer::Restarted(uint64_t inc) {
  std::vector<std::shared_ptr<Endpoint>> old;
  if (incarnation != 0 && incarnation != inc) {
    dead_.push_back(incarnation);
    if (dead_.size() > kDeadIncarnations) dead_.erase(dead_.begin());
  }
  incarnation = inc;
  rpc_address.clear();  // The new run's comes with its descriptor.
  for (Rail& r : rails) {
    if (r.ep != nullptr) old.push_back(std::move(r.ep));
    r.ep = nullptr;
    r.health = RailHealth{};
    r.epoch = 0;
  }
  connect_failures = 0;
  retry_after_ns = 0;
  last_error = absl::OkStatus();
  return old;
}

}  // namespace ferry::rdma
