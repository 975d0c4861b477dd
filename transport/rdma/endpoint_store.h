// EndpointStore: every endpoint of the RDMA transport that holds QPs.
//
//   live:     connecting or connected, on its rail; bounded by
//             rdma.max_endpoints with SIEVE eviction (sieve_cache.h) of
//             idle ones only -- one that is connecting, unconfirmed, or
//             has slices queued or posted is never evicted (the store
//             grows past its bound instead).
//   draining: out of service (failed or closing) until its posted work
//             has completed and, for one we closed, the peer has had time
//             to drain its own use (Endpoint::drop_after_ns); then it is
//             dropped and its QPs go with its last reference.
//
// Both counts are in Stats().endpoints: what the transport holds, not
// what it uses. Thread-safe.
#ifndef FERRY_TRANSPORT_RDMA_ENDPOINT_STORE_H_
#define FERRY_TRANSPORT_RDMA_ENDPOINT_STORE_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/sieve_cache.h"

namespace ferry::rdma {

class EndpointStore {
 public:
  using EndpointPtr = std::shared_ptr<Endpoint>;

  explicit EndpointStore(size_t max_live);

  // Adds a new live endpoint; appends those evicted to make room (idle
  // ones, for the caller to close) to *evicted. Insert and Keep do nothing
  // for an endpoint that was ever drained or removed: a failure racing
  // with its insertion may have dropped it already.
  void Insert(const EndpointPtr& ep, std::vector<EndpointPtr>* evicted);
  // Evicts idle endpoints while more than max_live are live (Insert could
  // evict none when every other one was busy or unconfirmed); appends
  // them to *evicted, for the caller to close.
  void Trim(std::vector<EndpointPtr>* evicted);
  // Puts back an endpoint that was evicted but turned out busy, without
  // evicting another for it.
  void Keep(const EndpointPtr& ep);
  // Moves `ep` from live to draining (or adds it there).
  void Drain(const EndpointPtr& ep);
  // Forgets `ep` entirely; returns whether it was held.
  bool Remove(const Endpoint& ep);

  std::vector<EndpointPtr> Live() const;
  std::vector<EndpointPtr> Draining() const;
  // Removes and returns everything (shutdown).
  std::vector<EndpointPtr> TakeAll();

  size_t live() const;
  size_t draining() const;
  size_t size() const { return live() + draining(); }

 private:
  mutable Mutex mu_;
  SieveCache<uint64_t, EndpointPtr> live_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, EndpointPtr> draining_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_ENDPOINT_STORE_H_
