// TcpServer: the target side of the TCP transport. Accepts connections from
// initiators and applies their READ/WRITE requests to registered memory
// (ServerSession: leases, bounds checks, frame validation).
//
// Threads: TcpOptions::io_threads event loops, whatever the number of
// connections; the first one also owns the listener. Limits (TcpOptions):
// connections in all and per peer address (one beyond is reset at once),
// and the handshake, idle and frame timeouts of each connection.
//
// Out of descriptors (EMFILE/ENFILE), the listener does not spin: it keeps
// one spare descriptor, frees it to accept and reset the waiting
// connection, and re-arms it; if even that fails it stops polling the
// listener for a back-off (10 ms doubling to 1 s) and tries again. Closed
// connections are reaped by their loop as soon as they close or time out,
// never by the acceptor, so descriptors come back by themselves.
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_TCP_TCP_SERVER_H_
#define FERRY_TRANSPORT_TCP_TCP_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/numeric/int128.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "ferry/options.h"
#include "transport/memory_registry.h"
#include "transport/tcp/event_loop.h"
#include "transport/tcp/server_session.h"
#include "transport/tcp/target_staging.h"

namespace ferry::tcp {

class TcpServer {
 public:
  struct Counters {
    uint64_t accepted = 0;    // Connections admitted.
    uint64_t refused = 0;     // Reset at once: over a cap or out of fds.
    uint64_t open = 0;        // Admitted and not closed yet.
    uint64_t timeouts = 0;    // Closed for a handshake/idle/frame timeout.
    uint64_t bad_frames = 0;  // Closed for a malformed request.
    uint64_t unproven = 0;    // Closed for a missing or wrong token proof.
    uint64_t shed = 0;        // Closed to make room for another address's.
    uint64_t denied = 0;  // Frames refused: wrong buffer key or incarnation.
    uint64_t fd_exhausted = 0;   // accept() failed with EMFILE/ENFILE.
    uint64_t accept_pauses = 0;  // Times the listener backed off.
  };

  // `registry` must outlive the server. `options` is validated by the
  // caller (TcpTransport::Install).
  TcpServer(MemoryRegistry* registry, const TcpOptions& options);
  ~TcpServer();
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;

  // How long a connection has to be let at memory (or to prove the token)
  // before it counts as useless when slots run short.
  static constexpr absl::Duration kShedGrace = absl::Seconds(1);

  // Binds `host:port` (0 = any free port) and starts the loops, serving
  // frames that name `incarnation` (this engine run's) only. Every timeout
  // and back-off is timed on `clock` (outlives the server). With an
  // `auth_token`, a connection is served only once it proved the token
  // (wire.h); one that proves another is closed.
  absl::Status Start(const std::string& host, uint16_t port,
                     uint64_t incarnation, Clock* clock,
                     std::string auth_token = "");
  uint16_t port() const { return port_; }
  // The bound address, "a.b.c.d:port".
  const std::string& address() const { return address_; }

  // Stops the loops, then closes the listener and every connection
  // (releasing their leases).
  void Stop();

  Counters counters() const;
  int threads() const;

 private:
  class Conn;
  class Listener;
  struct Loop;
  // What the server knows of an admitted connection, to choose one to shed
  // when slots run short. Shared by the server's table and the Slot.
  struct Admitted {
    absl::uint128 ip = 0;
    absl::Time since;       // When it was admitted.
    Loop* loop = nullptr;   // Set when admitted (guarded by mu_).
    Conn* conn = nullptr;   // Set when adopted (guarded by mu_).
    bool shedding = false;  // Guarded by mu_.
    // It was let at memory (ServerSession::admitted): kept over those
    // that were not.
    std::atomic<bool> useful{false};
  };
  // A connection's place under the caps; gives it back when destroyed.
  class Slot {
   public:
    Slot() = default;
    Slot(TcpServer* server, std::shared_ptr<Admitted> admitted)
        : server_(server), admitted_(std::move(admitted)) {}
    Slot(Slot&& other) noexcept { *this = std::move(other); }
    Slot& operator=(Slot&& other) noexcept;
    ~Slot() { Release(); }
    void Release();
    Admitted* admitted() const { return admitted_.get(); }

   private:
    TcpServer* server_ = nullptr;
    std::shared_ptr<Admitted> admitted_;
  };
  struct Loop {
    std::unique_ptr<EventLoop> loop;
    // Owned by the loop thread (by the caller after Stop).
    absl::flat_hash_map<Conn*, std::unique_ptr<Conn>> conns;
  };

  // Listener's loop.
  void AcceptSome(absl::Time now);
  bool ShedOne();
  void PauseAccept(absl::Time now);
  absl::Duration ListenerTick(absl::Time now);
  // Any loop.
  void Adopt(Loop* loop, UniqueFd fd, Slot slot, absl::Time now);
  absl::Duration ConnTick(Loop* loop, absl::Time now);
  // Reserves a place for a connection from `ip` (to be served on `loop`),
  // or returns null. At the global cap another connection is shed to make
  // room: first one that was never let at memory in the kShedGrace it had
  // (idle, unproven, or refused every request), from the address that
  // holds the most such; else one of the address that holds the most, if
  // it holds at least two more than `ip` would (max-min fairness: many
  // addresses holding slots cannot shut out another).
  std::shared_ptr<Admitted> Admit(absl::uint128 ip, Loop* loop);
  void Leave(Admitted& admitted);
  // Picks a connection to shed for a newcomer from `ip` and starts closing
  // it; false if none may be shed.
  bool ShedForLocked(absl::uint128 ip, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // On `admitted`'s loop: closes its connection, if it is still open.
  void CloseShed(const std::shared_ptr<Admitted>& admitted);

  MemoryRegistry* const registry_;
  const TcpOptions options_;
  // Declared before the loops: outlives every session.
  TargetStaging gpu_staging_;
  const ServerSession::Limits limits_;
  uint64_t incarnation_ = 0;  // Set by Start.
  // TcpOptions::max_connections, or half the soft descriptor limit if that
  // is lower (set by Start).
  uint64_t max_connections_ = 0;
  std::string auth_token_;      // Set by Start.
  Clock* clock_ = RealClock();  // Set by Start, before any loop runs.
  uint16_t port_ = 0;
  std::string address_;
  UniqueFd listener_;
  std::vector<std::unique_ptr<Loop>> loops_;
  std::unique_ptr<Listener> listener_handler_;

  // Listener's loop thread only.
  UniqueFd spare_;  // Freed to shed a connection when fds run out.
  size_t next_loop_ = 0;
  bool accept_paused_ = false;
  absl::Duration accept_backoff_;
  absl::Time accept_resume_;

  mutable Mutex mu_;
  uint64_t open_ ABSL_GUARDED_BY(mu_) = 0;
  // Admitted connections by source address; sheds started and not done.
  absl::flat_hash_map<absl::uint128, std::vector<std::shared_ptr<Admitted>>>
      per_address_ ABSL_GUARDED_BY(mu_);
  int shedding_ ABSL_GUARDED_BY(mu_) = 0;

  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> timeouts_{0};
  std::atomic<uint64_t> bad_frames_{0};
  std::atomic<uint64_t> unproven_{0};
  std::atomic<uint64_t> shed_{0};
  std::atomic<uint64_t> denied_{0};
  std::atomic<uint64_t> fd_exhausted_{0};
  std::atomic<uint64_t> accept_pauses_{0};
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_SERVER_H_
