// TcpTransport: Ferry's fallback transport over kernel TCP. Needs no special
// hardware; also the reference the RDMA transport is compared with.
//
// Target side: a TcpServer applies peers' requests to this engine's
// registered memory. Initiator side: a small pool of TcpConnections per peer
// address; slices go to the least loaded live connection. Thread-safe.
#ifndef FERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define FERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/notification.h"
#include "common/mutex.h"
#include "transport/memory_registry.h"
#include "transport/tcp/tcp_connection.h"
#include "transport/tcp/tcp_server.h"
#include "transport/transport.h"

namespace ferry::tcp {

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TransportOptions& options);
  ~TcpTransport() override;

  absl::string_view name() const override { return "tcp"; }
  absl::Status Install(const TransportEnv& env,
                       metadata::TransportEndpoint* endpoint) override;
  absl::StatusOr<MemoryHandle> RegisterMemory(
      const MemoryRegion& region, metadata::Buffer* published) override;
  absl::Status UnregisterMemory(uintptr_t addr) override;
  size_t max_slice_bytes() const override {
    return options_.tcp.max_slice_bytes;
  }
  void Submit(absl::Span<Slice* const> slices) override;
  void ClosePeer(const SegmentView& segment) override;
  TransportStats Stats() const override;
  void Shutdown() override;

 private:
  // The connections to one peer address, and its reconnect backoff.
  struct Pool {
    HostPort addr;
    std::vector<std::unique_ptr<TcpConnection>> conns;
    int consecutive_failures = 0;
    absl::Time retry_after = absl::InfinitePast();
    absl::Status last_failure;
  };

  // Picks (and if needed replaces) a connection; nullptr while backing off.
  TcpConnection* PickLocked(Pool* pool, absl::Status* why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReaperLoop();

  const TransportOptions options_;
  MemoryRegistry registry_;
  TcpServer server_{&registry_};

  mutable Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<Pool>> pools_
      ABSL_GUARDED_BY(mu_);
  uint64_t connects_started_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t connect_failures_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> slices_{0};
  std::atomic<uint64_t> bytes_{0};
  // Broken connections, destroyed by the reaper thread (never by their own
  // threads, which a destructor must join).
  std::vector<std::unique_ptr<TcpConnection>> graveyard_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;

  absl::Notification stop_reaper_;
  std::thread reaper_;
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_TRANSPORT_H_
