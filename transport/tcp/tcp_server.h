// TcpServer: the target side of the TCP transport. Accepts connections from
// initiators and applies their READ/WRITE requests to registered memory.
//
// Every access is checked against `registry` (remote-accessible buffers
// only) and holds a lease on the buffer while it runs, so unregistering
// waits for it. A request outside registered memory is answered with an
// error and touches nothing; a malformed frame closes that connection only.
// Thread-safe; one thread per connection.
#ifndef FERRY_TRANSPORT_TCP_TCP_SERVER_H_
#define FERRY_TRANSPORT_TCP_TCP_SERVER_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "transport/memory_registry.h"

namespace ferry::tcp {

class TcpServer {
 public:
  // `registry` must outlive the server.
  explicit TcpServer(MemoryRegistry* registry) : registry_(registry) {}
  ~TcpServer() { Stop(); }

  // Binds `host:port` (0 = any free port) and starts accepting.
  absl::Status Start(const std::string& host, uint16_t port);
  uint16_t port() const { return port_; }

  // Closes the listener and every connection, and joins all threads.
  void Stop();

  // Connections served so far (for tests and stats).
  uint64_t connections_accepted() const { return accepted_.load(); }

 private:
  struct Conn {
    UniqueFd fd;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void AcceptLoop();
  void Serve(Conn* conn);
  // Returns non-OK when the connection must be closed.
  absl::Status HandleWrite(int fd, uint64_t id, uint64_t addr, uint64_t len);
  absl::Status HandleRead(int fd, uint64_t id, uint64_t addr, uint64_t len);
  void ReapFinishedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  MemoryRegistry* const registry_;
  UniqueFd listener_;
  uint16_t port_ = 0;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> accepted_{0};
  Mutex mu_;
  std::list<std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_SERVER_H_
