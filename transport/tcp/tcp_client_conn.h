// TcpClient::Conn: one connection of a peer's pool. Moves bytes between
// its non-blocking socket and its ClientSession (the connect's completion,
// recv into the session's input, sendmsg of its output) and hands every
// slice that finished, or outlived its socket, back to the TcpClient.
//
// Internal to TcpClient (tcp_client.h). Not thread-safe: the loop thread
// of its pool only (the caller of TcpClient::Shutdown, after the loops
// stopped).
#ifndef FERRY_TRANSPORT_TCP_TCP_CLIENT_CONN_H_
#define FERRY_TRANSPORT_TCP_TCP_CLIENT_CONN_H_

#include <sys/epoll.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/socket_util.h"
#include "transport/tcp/client_session.h"
#include "transport/tcp/event_loop.h"
#include "transport/tcp/tcp_client.h"
#include "transport/transport.h"

namespace ferry::tcp {

// One connection: moves bytes between its socket and its session.
class TcpClient::Conn : public EventLoop::Handler {
 public:
  Conn(TcpClient* client, Pool* pool, UniqueFd fd, absl::Time now);

  ClientSession& session() { return session_; }
  bool closed() const { return closed_; }
  bool connected() const { return connected_; }
  int fd() const { return fd_.get(); }

  // Queues `slice`; FlushAll sends it (one sendmsg for a batch).
  void Add(Slice* slice, absl::Time now) {
    session_.Add(slice);
    last_busy_ = now;
  }

  // Sends what it can and updates the poll interest.
  void FlushAndWatch(absl::Time now);

  void OnEvents(uint32_t events, absl::Time now) override;

  // Sends what the session has, until the socket is full.
  void Flush(absl::Time now);

  // Closes the socket and hands the slices to the client (retry or fail).
  void Close(const absl::Status& cause, bool failed, absl::Time now);

  // Closes the socket only (the caller deals with the session).
  void CloseSocket();

  absl::Time connect_deadline() const { return connect_deadline_; }
  absl::Time last_busy() const { return last_busy_; }

 private:
  void UpdateInterest();

  TcpClient* const client_;
  Pool* const pool_;
  UniqueFd fd_;
  ClientSession session_;
  const absl::Time connect_deadline_;
  absl::Time last_busy_;
  bool connected_ = false;
  bool closed_ = false;
  uint32_t interest_ = EPOLLOUT;
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_CLIENT_CONN_H_
