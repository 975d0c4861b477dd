// Test support for the RDMA transport without engines or gRPC: an
// in-process network of PeerChannels (scriptable faults, call counts),
// transports with a registered buffer and their segment views, and a sink
// that waits for slices with a deadline.
#ifndef FERRY_TRANSPORT_RDMA_RDMA_TEST_UTIL_H_
#define FERRY_TRANSPORT_RDMA_RDMA_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "transport/peer_channel.h"
#include "transport/segment_view.h"
#include "transport/transport.h"

namespace ferry::rdma::testing {

// PeerChannels between transports of one process: a Call to an address
// runs the handler registered there on the calling thread, as the peer
// service runs it on a gRPC thread. Thread-safe.
class FakePeerNetwork {
 public:
  enum class Fault {
    kNone,
    kRefuse,  // Calls fail at once with Unavailable (connection refused).
    kSilent,  // Calls block until the fault is lifted or the RPC timeout
              // passes, then fail with DeadlineExceeded (a stopped peer).
  };
  // Sees every message before delivery (`to`: address); returning a status
  // fails the call with it instead of delivering.
  using Interceptor =
      std::function<absl::Status(const std::string& from, const std::string& to,
                                 const std::string& payload)>;

  explicit FakePeerNetwork(absl::Duration rpc_timeout = absl::Seconds(3))
      : rpc_timeout_(rpc_timeout) {}
  ~FakePeerNetwork();

  // A channel through which segment `segment` sends, and whose handlers
  // serve calls to `address`. Outlives nothing: the network must outlive
  // every channel.
  std::unique_ptr<PeerChannel> Join(const std::string& segment,
                                    const std::string& address);

  void SetFault(const std::string& address, Fault fault);
  void SetInterceptor(Interceptor i);
  // Calls made to `address` so far (delivered or not).
  int calls(const std::string& address) const;
  // Calls in progress (blocked in kSilent included).
  int in_flight() const;

 private:
  class Channel;
  struct Endpoint {
    absl::flat_hash_map<std::string, std::shared_ptr<PeerChannel::Handler>>
        handlers;
    int calls = 0;
  };
  absl::StatusOr<std::string> Call(const std::string& from,
                                   const std::string& address,
                                   const std::string& transport,
                                   const std::string& payload);
  void SetHandler(const std::string& address, const std::string& transport,
                  PeerChannel::Handler h);
  void RemoveHandler(const std::string& address, const std::string& transport);

  const absl::Duration rpc_timeout_;
  mutable Mutex mu_;
  CondVar changed_;
  absl::flat_hash_map<std::string, Endpoint> endpoints_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Fault> faults_ ABSL_GUARDED_BY(mu_);
  static std::string Key(const std::string& address);

  // Handler calls in progress per (address, transport).
  absl::flat_hash_map<std::string, int> running_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  Interceptor interceptor_ ABSL_GUARDED_BY(mu_);
};

// Collects slice completions. Thread-safe.
class TestSink final : public SliceSink {
 public:
  void OnSliceDone(Slice* slice, const absl::Status& status) override;
  // Waits until `n` slices completed in all, or `timeout`; returns whether
  // they did.
  bool WaitFor(size_t n, absl::Duration timeout);
  size_t done() const;
  size_t failed() const;
  std::vector<absl::Status> statuses() const;
  // Completions of a slice seen more than once (must stay 0).
  size_t duplicates() const;

 private:
  mutable Mutex mu_;
  CondVar cv_;
  absl::flat_hash_map<const Slice*, int> seen_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  size_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  size_t duplicates_ ABSL_GUARDED_BY(mu_) = 0;
};

// One RDMA transport with one registered, remote-accessible buffer, on a
// FakePeerNetwork, and the segment view peers use to reach it.
class TestNode {
 public:
  // `address`: its peer-service address on `net` (default: the name).
  // `clock`: the transport's (TransportEnv::clock), which also times the
  // deadlines of MakeSlices; it must outlive the node.
  static absl::StatusOr<std::unique_ptr<TestNode>> Start(
      FakePeerNetwork* net, const std::string& name, TransportOptions options,
      size_t buffer_bytes = 1 << 20, std::string address = "",
      Clock* clock = RealClock());
  ~TestNode();

  Transport& transport() { return *transport_; }
  // Its descriptor as peers see it (built at Start).
  const std::shared_ptr<const SegmentView>& view() const { return view_; }
  uint8_t* mem() { return mem_.get(); }
  uint64_t addr(size_t off = 0) const {
    return reinterpret_cast<uint64_t>(mem_.get()) + off;
  }
  MemoryHandle handle() const { return handle_; }
  const std::string& name() const { return name_; }
  uint64_t incarnation() const { return incarnation_; }
  TransportStats stats() const { return transport_->Stats(); }

  // Shuts the transport down (idempotent); the memory stays.
  void Stop();

  // Slices of `len` bytes each from this node's buffer at `off` to
  // `target`'s buffer at the same offset, due `timeout` from now on the
  // node's clock. The slices live in the returned vector (do not let it
  // reallocate while they are submitted).
  std::vector<Slice> MakeSlices(const TestNode& target, OpCode op, size_t off,
                                size_t len, int n, SliceSink* sink,
                                absl::Duration timeout = absl::Seconds(10));
  // Submits every slice of `slices`.
  void Submit(std::vector<Slice>* slices);

 private:
  TestNode() = default;

  std::string name_;
  Clock* clock_ = RealClock();
  uint64_t incarnation_ = 0;
  std::unique_ptr<uint8_t[]> mem_;
  size_t bytes_ = 0;
  std::unique_ptr<PeerChannel> channel_;
  std::unique_ptr<Transport> transport_;
  MemoryHandle handle_ = nullptr;
  std::shared_ptr<const SegmentView> view_;
  bool stopped_ = false;
};

}  // namespace ferry::rdma::testing

#endif  // FERRY_TRANSPORT_RDMA_RDMA_TEST_UTIL_H_
