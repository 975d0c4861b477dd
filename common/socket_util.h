// Thin, Status-returning wrappers over POSIX TCP sockets, shared by the TCP
// transport and the tools. All functions are thread-compatible: they keep no
// state beyond the file descriptors the caller owns.
#ifndef FERRY_COMMON_SOCKET_UTIL_H_
#define FERRY_COMMON_SOCKET_UTIL_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/numeric/int128.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace ferry {

struct HostPort {
  std::string host;  // A name, an IPv4 literal or an IPv6 literal (no [ ]).
  uint16_t port = 0;
  // "host:port", or "[v6]:port" for an IPv6 literal.
  std::string ToString() const;
};

// Parses "host:port" or "[ipv6]:port" (port 0..65535). A bare IPv6
// literal without brackets is ambiguous and rejected. Returns
// InvalidArgument with the offending text otherwise. No name lookup.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text);

// "host:port", bracketing `host` if it is an IPv6 literal.
std::string JoinHostPort(absl::string_view host, uint16_t port);

// An IPv4 or IPv6 socket address.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;

  int family() const { return storage.ss_family; }
  const sockaddr* get() const {
    return reinterpret_cast<const sockaddr*>(&storage);
  }
  sockaddr* mutable_get() { return reinterpret_cast<sockaddr*>(&storage); }
  uint16_t port() const;
  // The numeric host, without brackets ("10.0.0.1", "fe80::1").
  std::string Host() const;
  // "a.b.c.d:port" or "[v6]:port".
  std::string ToString() const;
  // 127.0.0.0/8, ::1 or an IPv4-mapped loopback.
  bool IsLoopback() const;
  // 0.0.0.0, :: or ::ffff:0.0.0.0.
  bool IsWildcard() const;
  // The IP address alone as one number (IPv4 as IPv4-mapped IPv6), for
  // per-address counts.
  absl::uint128 IpKey() const;
  // IpKey, with an IPv6 address cut to its /64: what one host may be
  // assumed to hold at most, for sharing a server fairly among hosts (a
  // host with a /64 has 2^64 addresses to give each connection its own).
  absl::uint128 AddressGroupKey() const;
};

// Parses a numeric endpoint "a.b.c.d:port" or "[v6]:port" (port 1..65535)
// without any name lookup, so it never blocks. InvalidArgument naming the
// text (shortened if long) otherwise.
absl::StatusOr<SockAddr> ParseNumericEndpoint(absl::string_view text);

// Resolves a host name or literal to one numeric address (IPv4 preferred,
// as most RDMA fabrics are configured). May block on DNS: never call it on
// a data path. InvalidArgument if it does not resolve.
absl::StatusOr<std::string> ResolveHost(absl::string_view host);

// True if `host` is a numeric loopback address (127/8, ::1).
bool IsLoopbackHost(absl::string_view host);
// True if `host` is a numeric wildcard address (0.0.0.0, ::) or empty.
bool IsWildcardHost(absl::string_view host);

// An owned file descriptor; closes on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void Reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Room for connections not yet accepted, unless a caller asks otherwise:
// a thousand engines started together connect within one wake-up of the
// accepting thread, and a SYN dropped on a full accept queue is sent again
// by the kernel only after 1 s, then 3 s, which a call's 3 s deadline does
// not survive (bench/storm_bench: 482 of 512 engines' connections to a
// metadata_server dropped with 128). The kernel clamps it to
// net.core.somaxconn (4096 by default since Linux 5.4).
inline constexpr int kListenBacklog = 4096;

// Creates a listening TCP socket bound to `host:port` (port 0 picks a free
// one), with room for `backlog` pending connections. `host` may be a name,
// an IPv4 or IPv6 literal; "" or "::" binds every interface of both
// families (dual stack; every IPv4 one where IPv6 is disabled), "0.0.0.0"
// every IPv4 interface. On success stores
// the bound port in `*bound_port`.
absl::StatusOr<UniqueFd> ListenTcp(const std::string& host, uint16_t port,
                                   uint16_t* bound_port,
                                   int backlog = kListenBacklog);

// The local address a socket is bound to (IPv4-mapped IPv6 addresses of a
// dual-stack socket are reported as IPv4).
absl::StatusOr<SockAddr> LocalAddress(int fd);

// The address of a socket's peer, as LocalAddress.
absl::StatusOr<SockAddr> PeerAddress(int fd);

// Starts connecting a non-blocking socket to `addr` and returns it at once;
// it turns writable when the attempt ended (then SocketError tells how).
// Unavailable if the attempt failed at once (no fd, refused, ...).
// `source` (its port ignored; null: the kernel's choice): the local address
// the connection comes from, where both it and `addr` are loopback
// addresses of one family and it can be bound (else the kernel's choice):
// engines of one host, each on a loopback address of its own, are told
// apart by the peers they reach.
absl::StatusOr<UniqueFd> StartConnect(const SockAddr& addr,
                                      const SockAddr* source = nullptr);

// The pending error of a socket (SO_ERROR; 0 if none), clearing it.
int SocketError(int fd);

// Makes close() send a reset instead of a FIN: for connections refused
// right after accept, which should leave no TIME_WAIT behind.
void SetResetOnClose(int fd);

// Connects to `addr`, failing with Unavailable/DeadlineExceeded after
// `timeout` instead of hanging on an unreachable peer.
absl::StatusOr<UniqueFd> ConnectTcp(const HostPort& addr,
                                    absl::Duration timeout);

// Sets TCP_NODELAY and large socket buffers, which the transport needs for
// full throughput on loopback and real links alike.
void TuneDataSocket(int fd);

// Writes every byte of `iov[0..iovcnt)`, retrying short writes and EINTR.
// Returns Unavailable if the peer has gone away. Modifies `iov` in place.
absl::Status WriteFullv(int fd, struct iovec* iov, int iovcnt);
absl::Status WriteFull(int fd, const void* data, size_t len);

// Reads exactly `len` bytes. Returns OutOfRange("connection closed") on EOF
// at offset 0, DataLoss on EOF mid-message, Unavailable on socket errors.
// A socket with SO_RCVTIMEO set returns DeadlineExceeded when it fires.
absl::Status ReadFull(int fd, void* data, size_t len);

// Like ReadFull on a socket with SO_RCVTIMEO set, but keeps waiting through
// up to `max_stalls` consecutive timeouts, and returns Cancelled as soon as
// `stop` is set. With `idle_ok`, waiting for the first byte never counts as
// a stall (an idle connection may stay open). A null `dst` discards the
// bytes, which keeps a stream in sync after a rejected request.
absl::Status ReadFullPatient(int fd, void* dst, size_t len,
                             const std::atomic<bool>& stop, int max_stalls,
                             bool idle_ok = false);

// Sets SO_RCVTIMEO so blocked reads wake up periodically.
void SetRecvTimeout(int fd, absl::Duration timeout);

}  // namespace ferry

#endif  // FERRY_COMMON_SOCKET_UTIL_H_
