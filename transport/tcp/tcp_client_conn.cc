#include "transport/tcp/tcp_client_conn.h"

#include <errno.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dma_annotations.h"
#include "transport/tcp/tcp_client_pool.h"

namespace ferry::tcp {
namespace {

// recv rounds per wake-up of a connection (fairness).
constexpr int kMaxRounds = 16;
constexpr int kMaxIov = 64;

using Done = ClientSession::Done;

}  // namespace

TcpClient::Conn::Conn(TcpClient* client, Pool* pool, UniqueFd fd,
                      absl::Time now)
    : client_(client),
      pool_(pool),
      fd_(std::move(fd)),
      session_(pool->address, client->auth_token_),
      connect_deadline_(now + client->connect_timeout_),
      last_busy_(now) {}

void TcpClient::Conn::FlushAndWatch(absl::Time now) {
  Flush(now);
  if (!closed_) UpdateInterest();
}

void TcpClient::Conn::OnEvents(uint32_t events, absl::Time now) {
  if (closed_) return;
  // Completing a slice may retire a closing pool and drop the last
  // reference to it, while this handler still needs the pool.
  const std::shared_ptr<Pool> keep = pool_->shared_from_this();
  if (!session_.empty()) last_busy_ = now;
  if (!connected_) {
    int err = SocketError(fd_.get());
    if (err == 0 && (events & (EPOLLERR | EPOLLHUP))) err = ECONNRESET;
    if (err != 0) {
      return Close(absl::UnavailableError(absl::StrCat(
                       "connect ", pool_->address, ": ", std::strerror(err))),
                   /*failed=*/true, now);
    }
    if ((events & EPOLLOUT) == 0) return;
    connected_ = true;
    TuneDataSocket(fd_.get());
  }
  std::vector<Done> done;
  if (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
    const bool answered_before = session_.answered_any();
    for (int round = 0; round < kMaxRounds; ++round) {
      auto [buf, len] = session_.InputBuffer();
      // Payload goes straight into application memory, as a NIC's DMA
      // would (common/dma_annotations.h).
      ssize_t n;
      {
        ScopedDmaAccess dma;
        n = ::recv(fd_.get(), buf, len, 0);
      }
      if (n > 0) {
        if (absl::Status s = session_.OnReceived(n, &done); !s.ok()) {
          client_->Complete(pool_, &done, now);
          return Close(s, !session_.answered_any(), now);
        }
        if (static_cast<size_t>(n) < len) break;  // Drained.
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      const std::string why =
          n == 0 ? "closed by the peer" : std::strerror(errno);
      client_->Complete(pool_, &done, now);
      if (session_.proof_sent() && !session_.answered_any()) {
        return Close(
            absl::PermissionDeniedError(absl::StrCat(
                "target at ", pool_->address,
                " closed the TCP connection after this engine's proof of "
                "the cluster token and before any answer: its token likely "
                "differs from this engine's (or it restarted meanwhile)")),
            /*failed=*/true, now);
      }
      // A quiet close of an idle connection (say, the target's idle
      // timeout) is no failure of the peer.
      const bool failed = !session_.answered_any() && !session_.empty();
      return Close(absl::UnavailableError(absl::StrCat(
                       "TCP connection to ", pool_->address, " lost: ", why)),
                   failed, now);
    }
    if (!answered_before && session_.answered_any()) {
      client_->OnConnAnswered(pool_);
    }
  }
  Flush(now);
  if (closed_) return client_->Complete(pool_, &done, now);
  UpdateInterest();
  if (!session_.empty()) last_busy_ = now;
  client_->Complete(pool_, &done, now);  // May retire the pool: last.
}

void TcpClient::Conn::Flush(absl::Time now) {
  while (connected_ && !closed_ && session_.has_output()) {
    iovec iov[kMaxIov];
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = session_.PrepareOutput(iov, kMaxIov);
    ssize_t n;
    {
      ScopedDmaAccess dma;  // Payload from application memory.
      n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL);
    }
    if (n > 0) {
      size_t offered = 0;
      for (size_t i = 0; i < msg.msg_iovlen; ++i) offered += iov[i].iov_len;
      session_.OnSent(n);
      if (static_cast<size_t>(n) < offered) return;  // The socket is full.
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    Close(absl::UnavailableError(absl::StrCat("TCP connection to ",
                                              pool_->address,
                                              " lost: ", std::strerror(errno))),
          !session_.answered_any(), now);
    return;
  }
}

void TcpClient::Conn::Close(const absl::Status& cause, bool failed,
                            absl::Time now) {
  if (closed_) return;
  CloseSocket();
  client_->OnConnClosed(pool_, this, cause, failed, now);
}

void TcpClient::Conn::CloseSocket() {
  if (closed_) return;
  closed_ = true;
  pool_->loop->loop->Remove(fd_.get());
  fd_.Reset();
  client_->conns_open_.fetch_sub(1, std::memory_order_relaxed);
}

void TcpClient::Conn::UpdateInterest() {
  const uint32_t want =
      connected_ ? EPOLLIN | (session_.has_output() ? EPOLLOUT : 0u) : EPOLLOUT;
  if (want == interest_) return;
  if (pool_->loop->loop->Modify(fd_.get(), want, this).ok()) interest_ = want;
}

}  // namespace ferry::tcp
