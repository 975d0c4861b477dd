// RpcServer: one gRPC server hosting any set of Ferry services on one port
// (an engine hosts its PeerService and, when embedded, the MetadataService).
// Start and Shutdown are not thread-safe with each other; address() and
// stats() are.
//
// Staying alive under fd exhaustion. gRPC 1.51's own listener stops
// accepting for good after one EMFILE from accept4 (grpc issues 16058 and
// 20418), so RpcServer owns the listening socket and hands each accepted
// connection to gRPC through an external connection acceptor, which runs
// gRPC's usual handshakes on it: plaintext, or mutual TLS with
// options.tls. Its accept thread:
//   - caps the connections served at once, in total and per peer address;
//   - when full, makes room for a newcomer by shedding (shutdown(2)) a
//     connection that has not been worth its slot (no call within a second,
//     or a call refused for want of the token: connection_activity.h), else
//     one from the address holding the most, if that is at least two more
//     than the newcomer's address would hold (max-min fairness); only when
//     neither exists is the newcomer accepted and closed at once, so its
//     client fails fast instead of hanging in the accept queue. Many
//     addresses holding connections therefore cannot shut out another;
//   - closes a connection that sends nothing within handshake_timeout
//     before gRPC ever sees it;
//   - on EMFILE/ENFILE closes a spare fd it keeps for the purpose, accepts
//     and closes the pending connection, and backs off (10 ms doubling to
//     1 s) instead of spinning or giving up.
// gRPC then bounds each connection: max_streams_per_connection concurrent
// calls, an idle timeout, keepalive pings to find dead peers, and
// handshake_timeout for the TLS handshake. Ferry's services use gRPC's
// callback API and run their handlers on a CallPool of their own
// (call_pool.h), so that no call holds a thread while its client is slow
// to read; max_threads caps the threads of any service on the synchronous
// API (a call beyond that gets RESOURCE_EXHAUSTED).
#ifndef FERRY_METADATA_RPC_SERVER_H_
#define FERRY_METADATA_RPC_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/socket_util.h"
#include "grpcpp/grpcpp.h"
#include "metadata/connection_activity.h"
#include "metadata/tls.h"

namespace ferry::metadata {

struct RpcServerOptions {
  // Connections served at once (including ones still in their handshake).
  // 0: a quarter of the soft RLIMIT_NOFILE, clamped to [16, 4096].
  int max_connections = 0;
  // Per peer IPv4 address. 0: half of max_connections.
  int max_connections_per_peer = 0;
  // A new connection must send its first bytes within this.
  absl::Duration handshake_timeout = absl::Seconds(5);
  // A connection with no call for this long is closed (clients reconnect
  // transparently on their next call).
  absl::Duration idle_timeout = absl::Minutes(2);
  // Threads serving calls of synchronous-API services, over all
  // connections (at least 8 are used). Ferry's own services serve calls on
  // their CallPool instead.
  // Start fails with InvalidArgument for a negative cap, a count below 1,
  // or a timeout that is not > 0 and finite.
  int max_threads = 64;
  int max_streams_per_connection = 32;
  // Serve mutual TLS with these credentials (null: plaintext).
  std::shared_ptr<const Tls> tls;
  // The accept loop's time (null: the system clock; it must outlive the
  // server): handshake deadlines, the accept back-off, the prune and log
  // intervals. gRPC's own timers (idle, keepalive, the TLS handshake)
  // stay on real time.
  Clock* clock = nullptr;
};

struct RpcServerStats {
  uint64_t accepted = 0;            // Handed to gRPC.
  uint64_t refused = 0;             // Over a connection cap.
  uint64_t handshake_timeouts = 0;  // Said nothing in time.
  uint64_t fd_exhausted = 0;        // accept failed with EMFILE/ENFILE.
  uint64_t shed = 0;                // Closed to make room for a newcomer.
  int max_connections = 0;          // The cap in force.
};

// Raises the soft RLIMIT_NOFILE to the hard limit (never lowers it) and
// returns the soft limit now in force. RpcServer::Start calls it, so every
// process with a Ferry gRPC server gets the headroom its hard limit allows.
absl::StatusOr<uint64_t> RaiseFdLimitToHard();

class RpcServer {
 public:
  // Starts serving `services` (not owned; must outlive the server) on
  // `listen_address` ("host:port" or "[ipv6]:port"; a host of "::" or
  // "0.0.0.0" binds every interface; port 0 picks a free one). Requests
  // larger than kMaxRpcMessageBytes are rejected by gRPC with
  // RESOURCE_EXHAUSTED.
  static absl::StatusOr<std::unique_ptr<RpcServer>> Start(
      const std::string& listen_address,
      const std::vector<grpc::Service*>& services,
      const RpcServerOptions& options = {});

  ~RpcServer();

  // "host:port" with the port actually bound.
  const std::string& address() const { return address_; }
  uint16_t port() const { return port_; }

  RpcServerStats stats() const;

  // Stops accepting, then stops the gRPC server and waits for running calls
  // (bounded by a short deadline). Idempotent.
  void Shutdown();

 private:
  RpcServer() = default;
  void AcceptLoop();

  RpcServerOptions options_;
  Clock* clock_ = RealClock();
  // Outlives server_, whose interceptors report to it.
  ConnectionActivity activity_;
  std::unique_ptr<grpc::Server> server_;
  // Hands accepted connections to server_; used by the accept thread only.
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::string address_;
  uint16_t port_ = 0;
  UniqueFd listen_fd_;
  // Written by Shutdown to wake the accept thread.
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> handshake_timeouts_{0};
  std::atomic<uint64_t> fd_exhausted_{0};
  std::atomic<uint64_t> shed_{0};
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_RPC_SERVER_H_
