// SlicePath: the RDMA transport's data path -- a slice from Submit to its
// completion. It routes slices that share a target snapshot as one run
// (rail choice by rail_router.h, one lock per run), hands each rail's
// slices to its endpoint (from RailLifecycle) and posts them on the
// submitting thread; it says what a completion or an async event means
// (completing slices, retrying failed ones on other rails). Nothing here
// blocks on the network or on a handshake, and it starts no thread:
// Completions' workers and the application's polling threads call it.
//
// It implements RailHost (slices an endpoint gives back) and
// CompletionHandler (what the completion side reports); it calls
// RailLifecycle and Completions, never the other way but through those
// two interfaces. Thread-safe; it holds no lock of its own.
#ifndef FERRY_TRANSPORT_RDMA_SLICE_PATH_H_
#define FERRY_TRANSPORT_RDMA_SLICE_PATH_H_

#include <atomic>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/rdma/completions.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/rail_lifecycle.h"
#include "transport/rdma/rdma_context.h"

namespace ferry::rdma {

class SlicePath final : public RailHost, public CompletionHandler {
 public:
  // Stores the pointers only: RdmaTransport builds it before `rails` and
  // `completions` (which point back at it) and destroys it after them.
  SlicePath(RdmaContext* context, RailLifecycle* rails,
            Completions* completions)
      : ctx_(context), rails_(rails), completions_(completions) {}
  SlicePath(const SlicePath&) = delete;
  SlicePath& operator=(const SlicePath&) = delete;

  // Routes slices that share one target snapshot, registered in host
  // memory. `reroutes` bounds how often slices bounce off endpoints that
  // failed meanwhile.
  void RouteRun(absl::Span<Slice* const> run, absl::Time now, int reroutes);
  // Routes a queue of slices, in runs to one target.
  void RouteQueue(SliceQueue* q, absl::Time now, int reroutes);

  // RailHost.
  void Retry(Slice* slice, const absl::Status& why) override;
  void Reroute(SliceQueue* slices) override;

  // CompletionHandler.
  void OnCompletion(const QpRef& ref, const ibv_wc& wc) override;
  void PostParked(const std::shared_ptr<Endpoint>& ep) override {
    rails_->PostOrPark(ep);
  }
  void OnPortChange(int nic, bool up) override;
  void OnDeviceFatal(int nic) override;

 private:
  // Queues `q` on `ep` and posts what fits; slices the endpoint cannot
  // take (it failed or closed meanwhile) are routed again.
  void Enqueue(const std::shared_ptr<Endpoint>& ep, SliceQueue* q,
               uint64_t bytes, absl::Time now, int reroutes);

  RdmaContext* const ctx_;
  RailLifecycle* const rails_;
  Completions* const completions_;
  // Rotates the router's tie-breaks between runs.
  std::atomic<uint64_t> rotate_{0};
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_SLICE_PATH_H_
