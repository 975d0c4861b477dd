// SendAll: writes every byte of an iovec array to a socket, resuming after
// short writes and EINTR. Header-only and free of other dependencies, so
// that softrnic (which depends on nothing but libc) shares it with Ferry's
// socket helpers.
#ifndef FERRY_COMMON_SEND_ALL_H_
#define FERRY_COMMON_SEND_ALL_H_

#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>

namespace ferry {

// Returns 0 once everything is sent, else the errno of the failed
// sendmsg. Advances `iov` in place (the caller's array is consumed).
// MSG_NOSIGNAL: a peer that went away is an error, not a SIGPIPE.
// `on_sent(n)` is called after each sendmsg that took n > 0 bytes (what
// the socket holds so far, also when a later sendmsg fails).
template <typename OnSent>
int SendAll(int fd, iovec* iov, int iovcnt, OnSent on_sent) {
  while (iovcnt > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(iovcnt);
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    size_t left = static_cast<size_t>(n);
    if (n > 0) on_sent(left);
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

inline int SendAll(int fd, iovec* iov, int iovcnt) {
  return SendAll(fd, iov, iovcnt, [](size_t) {});
}

}  // namespace ferry

#endif  // FERRY_COMMON_SEND_ALL_H_
