// TcpConnection: one initiator-side connection of the TCP transport to a
// peer's TcpServer. A sender thread connects (so Submit never blocks on the
// network) and streams requests; a receiver thread matches responses to
// slices and completes them. A reaper completes slices whose deadline passed.
//
// Ownership rule that keeps local memory safe: a slice is completed by
// exactly one party, the one that removes it from `inflight_` under `mu_`,
// and never while the sender is still reading its payload.
// Thread-safe.
#ifndef FERRY_TRANSPORT_TCP_TCP_CONNECTION_H_
#define FERRY_TRANSPORT_TCP_TCP_CONNECTION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "transport/transport.h"

namespace ferry::tcp {

class TcpConnection {
 public:
  TcpConnection(HostPort peer, absl::Duration connect_timeout);
  // Fails every slice still queued or in flight with Cancelled.
  ~TcpConnection();

  // Queues a slice. If the connection is already broken the slice fails at
  // once with Unavailable.
  void Enqueue(Slice* slice);

  // Completes slices past their deadline with DeadlineExceeded.
  void ExpireOverdue(absl::Time now);

  // True once the connection failed; the transport then replaces it.
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // Whether the TCP connection was ever established.
  bool ever_connected() const {
    MutexLock lock(&mu_);
    return connected_;
  }
  // Why the connection broke (OK while it is not broken).
  absl::Status failure() const {
    MutexLock lock(&mu_);
    return failure_;
  }
  // Bytes queued or in flight, for load balancing across connections.
  uint64_t load_bytes() const { return load_bytes_.load(); }

 private:
  struct Inflight {
    Slice* slice;
    bool sending;           // The sender thread is still in sendmsg for it.
    bool answered = false;  // The receiver owns it (reading its response).
    // Set by the receiver when the response arrived while `sending`: the
    // sender completes the slice with this status once sendmsg returned, so
    // the slice's memory is never released while a syscall still has it.
    std::optional<absl::Status> done;
  };

  void SendLoop();
  void RecvLoop();
  // Marks the connection broken and fails every slice not being sent.
  void Fail(const absl::Status& status);
  void Finish(Slice* slice, const absl::Status& status);
  // The receiver's completion of request `id`: deferred to the sender if it
  // is still sending, otherwise immediate.
  void CompleteAnswered(uint64_t id, Slice* slice, const absl::Status& status);

  const HostPort peer_;
  const absl::Duration connect_timeout_;
  UniqueFd fd_;
  std::atomic<bool> broken_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> load_bytes_{0};

  mutable Mutex mu_;
  CondVar send_cv_;
  std::deque<Slice*> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Inflight> inflight_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);

  std::thread sender_;
  std::thread receiver_;
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_CONNECTION_H_
