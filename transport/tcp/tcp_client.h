// TcpClient: the initiator side of the TCP transport. Routes slices to a
// pool of connections per peer address; TcpOptions::io_threads event loops
// drive every connection (non-blocking sockets, ClientSession for the
// protocol). Submit only queues and wakes a loop: it never blocks on the
// network.
//
// Per peer address (a Pool): up to connections_per_peer connections,
// opened as load needs them; slices go to the least loaded one. A peer
// that refuses, times out a connect, or drops connections before ever
// answering is backed off (backoff_min doubling to backoff_max); while it
// is, its slices fail at once with Unavailable naming the peer, the cause
// and the time of the next attempt (TransportStats::fast_failures).
//
// Deadlines: every 10 ms while slices are in flight the loop fails those
// past their deadline. A slice whose request is not on the wire yet just
// leaves; one on the wire cannot be taken back from the stream, so its
// connection is closed. Whenever a connection closes, its slices that never
// reached the wire are retried on another connection of the pool (or a new
// one), the others fail with Unavailable (DeadlineExceeded if late): a
// WRITE that may have been applied is never sent twice.
//
// Memory safety: the loop thread is the only one doing I/O on its sockets,
// and completes slices only outside any syscall, so a completed slice's
// memory is never touched again.
//
// Bounded state: at most max_peers pools (the least recently used idle one
// is dropped for a new peer; when none is idle, slices to the new peer fail
// with ResourceExhausted); idle connections are closed after half of
// idle_timeout (before the target's idle timeout could race a request);
// pools without connections, slices or pending back-off are dropped after
// idle_timeout. ClosePeer drops a pool at once if idle, else as soon as
// its slices completed.
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_TCP_TCP_CLIENT_H_
#define FERRY_TRANSPORT_TCP_TCP_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "ferry/options.h"
#include "ferry/stats.h"
#include "transport/tcp/client_session.h"
#include "transport/tcp/event_loop.h"
#include "transport/transport.h"

namespace ferry::tcp {

class TcpClient {
 public:
  // `options` is validated by the caller (TcpTransport::Install).
  TcpClient(const TcpOptions& options, absl::Duration connect_timeout);
  ~TcpClient();
  TcpClient(const TcpClient&) = delete;
  TcpClient& operator=(const TcpClient&) = delete;

  // Starts the loops; ResourceExhausted if a thread cannot be created.
  // Deadlines, back-off and idle timeouts are timed on `clock` (outlives
  // the client). With an `auth_token`, every connection proves it to the
  // target before its first request (wire.h). `source_host`: the engine's
  // listen_host; where it is a loopback address, connections to loopback
  // targets come from it (StartConnect), so that engines of one host on
  // loopback addresses of their own look to a target like hosts of their
  // own (bench/storm_bench; a target caps connections per address).
  absl::Status Start(Clock* clock, std::string auth_token = "",
                     const std::string& source_host = "");

  void Submit(absl::Span<Slice* const> slices);

  // Drops the pool of the peer at `address`: at once if idle, else once
  // its slices completed. Never fails a slice.
  void ClosePeer(const std::string& address);

  // Stops the loops, then completes every slice still queued or in flight
  // with Cancelled. Later Submits fail with Cancelled.
  void Shutdown();

  // Adds the initiator's counters and gauges.
  void AddStats(TransportStats* stats) const;
  int threads() const;

 private:
  struct Pool;
  class Conn;
  struct Loop {
    std::unique_ptr<EventLoop> loop;
    // Pools this loop drives (loop thread only; the caller after Stop).
    std::vector<std::shared_ptr<Pool>> pools;
  };

  // Loop thread.
  void Drain(const std::shared_ptr<Pool>& pool, absl::Time now);
  // Puts `slice` on a connection of `pool`, opening one if load and the
  // back-off allow; fails it if there is none. `retry`: it comes back from
  // a closed connection (not a fast failure if it fails here).
  void Dispatch(Pool* pool, Slice* slice, absl::Time now, bool retry);
  // Sends what the pool's connections have queued.
  void FlushAll(Pool* pool, absl::Time now);
  // Starts a connection; nullptr (and `*error`) if that failed at once.
  Conn* OpenConn(Pool* pool, absl::Time now, absl::Status* error);
  // A connection closed: completes and retries its slices, learns for the
  // back-off. `failed`: the peer refused, timed out or dropped it unasked.
  void OnConnClosed(Pool* pool, Conn* conn, const absl::Status& cause,
                    bool failed, absl::Time now);
  void OnConnAnswered(Pool* pool);
  // The peer refused, timed out or dropped a connection unasked: backs it
  // off (backoff_min doubling up to backoff_max).
  void RecordFailure(Pool* pool, const absl::Status& cause, absl::Time now);
  void Complete(Pool* pool, std::vector<ClientSession::Done>* done,
                absl::Time now);
  void MaybeRetire(Pool* pool);
  absl::Duration Tick(Loop* loop, absl::Time now);
  absl::Status BackoffStatus(const Pool& pool, absl::Time now) const;
  // Any thread.
  bool EvictIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Has the loop retire `pool` if it was dropped: for slices that ended
  // outside the loop (fast failures).
  void MaybeRetireLater(const std::shared_ptr<Pool>& pool)
      ABSL_LOCKS_EXCLUDED(mu_);

  const TcpOptions options_;
  std::string auth_token_;          // Set by Start, before the loops.
  std::optional<SockAddr> source_;  // Set by Start, before the loops.
  const absl::Duration connect_timeout_;
  Clock* clock_ = RealClock();  // Set by Start, before any loop runs.
  std::vector<std::unique_ptr<Loop>> loops_;

  mutable Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Pools by the peer's endpoint text, with their last use (for LRU).
  absl::flat_hash_map<std::string, std::shared_ptr<Pool>> pools_
      ABSL_GUARDED_BY(mu_);
  // Every pool alive, including those closing (for stats and Shutdown).
  absl::flat_hash_map<Pool*, std::shared_ptr<Pool>> all_pools_
      ABSL_GUARDED_BY(mu_);
  uint64_t use_clock_ ABSL_GUARDED_BY(mu_) = 0;
  size_t next_loop_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<uint64_t> slices_{0};
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> conns_open_{0};
  std::atomic<uint64_t> connects_{0};
  std::atomic<uint64_t> connect_failures_{0};
  std::atomic<uint64_t> fast_failures_{0};
  std::atomic<uint64_t> retries_{0};
  std::atomic<uint64_t> evictions_{0};
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_CLIENT_H_
