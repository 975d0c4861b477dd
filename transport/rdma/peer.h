// Peer: what the RDMA transport knows of one remote segment -- its
// incarnation, its peer-service address, and per rail (local NIC, remote
// NIC name) the endpoint, its health and its connection epoch -- plus the
// reconnect backoff. One Peer per segment name; an endpoint keeps its Peer
// alive. Thread-safe: `mu` guards everything.
#ifndef FERRY_TRANSPORT_RDMA_PEER_H_
#define FERRY_TRANSPORT_RDMA_PEER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/mutex.h"

namespace ferry::rdma {

class Endpoint;

struct RailHealth {
  uint32_t errors = 0;          // Consecutive failures.
  int64_t paused_until_ns = 0;  // Avoided until then.
  uint32_t pauses = 0;          // Consecutive pauses: the next is longer.
  // A transfer succeeded on the rail once. A rail that never worked is
  // paused at its first error (likely no route between the two NICs).
  bool proven = false;
};

class Peer {
 public:
  struct Rail {
    int local = 0;
    std::string remote_nic;
    std::shared_ptr<Endpoint> ep;  // Null while it has none.
    RailHealth health;
    uint64_t epoch = 0;  // Of the rail's latest connection.
  };

  explicit Peer(std::string name) : name_(std::move(name)) {}

  const std::string& name() const { return name_; }

  // The rail, or nullptr / a new one. References stay valid (a deque that
  // only grows).
  Rail* FindRail(int local, absl::string_view remote_nic)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  Rail& GetRail(int local, absl::string_view remote_nic)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Whether `incarnation` belonged to a process of this segment that has
  // since been replaced.
  bool IsDead(uint64_t incarnation) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Records that the segment now runs as `incarnation`: the current one is
  // dead, and every rail's endpoint is returned (for the caller to retire)
  // and forgotten.
  std::vector<std::shared_ptr<Endpoint>> Restarted(uint64_t incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  Mutex mu;
  uint64_t incarnation ABSL_GUARDED_BY(mu) = 0;  // 0: not known yet.
  std::string rpc_address ABSL_GUARDED_BY(mu);
  std::deque<Rail> rails ABSL_GUARDED_BY(mu);
  // Reconnect backoff after failed handshakes: no new endpoint before
  // retry_after_ns.
  uint32_t connect_failures ABSL_GUARDED_BY(mu) = 0;
  int64_t retry_after_ns ABSL_GUARDED_BY(mu) = 0;
  absl::Status last_error ABSL_GUARDED_BY(mu);

 private:
  static constexpr size_t kDeadIncarnations = 8;
  const std::string name_;
  std::vector<uint64_t> dead_ ABSL_GUARDED_BY(mu);
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_PEER_H_
