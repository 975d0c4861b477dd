// Peer: what the RDMA transport knows of one remote segment -- its
// incarnation, its peer-service address, and per rail (local NIC, remote
// NIC name) the rail's connector (connector.h), its current endpoint and
// its health -- plus the handshake backoff. An endpoint keeps its Peer
// alive. Thread-safe: `mu` guards everything but the atomics.
//
// PeerTable: the Peers by segment name, bounded: beyond max_peers, records
// of peers with no endpoint are dropped, least recently used first (one
// with endpoints is never dropped; the table grows past its bound
// instead). A dropped record forgets the peer's dead incarnations and rail
// health; a request with an old descriptor is then refused by the peer
// itself (STALE_INCARNATION).
#ifndef FERRY_TRANSPORT_RDMA_PEER_H_
#define FERRY_TRANSPORT_RDMA_PEER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/mutex.h"
#include "transport/rdma/connector.h"

namespace ferry::rdma {

class Endpoint;

struct RailHealth {
  uint32_t errors = 0;          // Consecutive failures.
  int64_t paused_until_ns = 0;  // Avoided until then.
  uint32_t pauses = 0;          // Consecutive pauses: the next is longer.
  // A transfer succeeded on the rail once. A rail that never worked is
  // paused at its first error (likely no route between the two NICs).
  bool proven = false;
  // Why the rail's last connect failed as the rail's fault (the peer
  // refused it, or our NIC could not make or connect its QPs); OK once a
  // connection is made. While the pause it earned lasts, no new endpoint
  // is started on the rail: slices the router sends there anyway (every
  // other rail is unusable too) fail at once with this reason, as the
  // peer's backoff does for handshakes that fail as the peer's fault.
  absl::Status connect_fault;
};

class Peer : public std::enable_shared_from_this<Peer> {
 public:
  struct Rail {
    Rail(int local, std::string remote_nic, bool we_win_ties,
         int64_t timeout_ns)
        : local(local),
          remote_nic(std::move(remote_nic)),
          conn(we_win_ties, timeout_ns) {}
    int local = 0;
    std::string remote_nic;
    // The connector's current endpoint: set exactly while conn is not
    // kIdle (RailLifecycle keeps the two in step under `mu`).
    std::shared_ptr<Endpoint> ep;
    RailHealth health;
    RailConnector conn;
  };

  // `we_win_ties`: our segment name sorts before this one.
  Peer(std::string name, bool we_win_ties, int64_t connect_timeout_ns)
      : backoff(connect_timeout_ns),
        name_(std::move(name)),
        we_win_ties_(we_win_ties),
        timeout_ns_(connect_timeout_ns) {}

  const std::string& name() const { return name_; }

  // The rail, or nullptr / a new one. References stay valid (a deque that
  // only grows, bounded by the caller).
  Rail* FindRail(int local, absl::string_view remote_nic)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  Rail& GetRail(int local, absl::string_view remote_nic)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Takes note of `incarnation` (0: unknown, ignored) as the segment's
  // run, as a descriptor, a connect request or a reply names it -- the one
  // place that decides, so that none of them can bring back a dead run.
  // False for a run that has since been replaced: refuse what came with
  // it; nothing changes. For a new run the current one is dead, every
  // rail's connector restarts, and the rails' endpoints are appended to
  // *old (for the caller to fail, flushing their QPs) and forgotten.
  bool SeeIncarnation(uint64_t incarnation,
                      std::vector<std::shared_ptr<Endpoint>>* old)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Some rail has an endpoint.
  bool HasEndpoints() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  Mutex mu;
  uint64_t incarnation ABSL_GUARDED_BY(mu) = 0;  // 0: not known yet.
  std::string rpc_address ABSL_GUARDED_BY(mu);
  std::deque<Rail> rails ABSL_GUARDED_BY(mu);
  ConnectBackoff backoff ABSL_GUARDED_BY(mu);
  // Notices to the peer are skipped until then: it did not answer one (a
  // stopped or vanished peer costs the control threads an RPC timeout
  // once, not once per endpoint).
  int64_t unresponsive_until_ns ABSL_GUARDED_BY(mu) = 0;
  // A handshake with this run of the peer succeeded: its connects may run
  // in parallel (until then one at a time, so that an unreachable peer
  // holds one control thread, not one per rail).
  std::atomic<bool> reached{false};

 private:
  static constexpr size_t kDeadIncarnations = 8;
  const std::string name_;
  const bool we_win_ties_;
  const int64_t timeout_ns_;
  std::vector<uint64_t> dead_ ABSL_GUARDED_BY(mu);
};

class PeerTable {
 public:
  using PeerPtr = std::shared_ptr<Peer>;
  // Makes the record of a peer first seen.
  using Factory = std::function<PeerPtr(const std::string& name)>;

  PeerTable(size_t max_peers, Factory factory)
      : max_peers_(max_peers == 0 ? 1 : max_peers),
        factory_(std::move(factory)) {}

  // The record of `name`, made if needed; marks it recently used.
  PeerPtr Get(const std::string& name);
  // The record of `name`, or null.
  PeerPtr Find(const std::string& name);
  // Removes and returns the record of `name` (null if none).
  PeerPtr Remove(const std::string& name);
  // Drops records over the bound whose peers have no endpoint any more
  // (the bound is also enforced as records are made).
  void Trim();
  // Removes and returns every record (shutdown).
  std::vector<PeerPtr> TakeAll();
  size_t size() const;
  // Records dropped to stay within the bound.
  uint64_t evictions() const;

 private:
  struct Entry {
    PeerPtr peer;
    std::list<std::string>::iterator lru;
  };
  // Drops least recently used records without endpoints while over the
  // bound (at most one pass over the list).
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_peers_;
  const Factory factory_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, Entry> map_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // Most recent first.
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_PEER_H_
