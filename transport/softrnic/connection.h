// TCP connections between soft devices, and the byte sources the
// responder and requester copy payloads from (a socket, or, for QPs in the
// same process, the peer's memory directly).
#ifndef FERRY_TRANSPORT_SOFTRNIC_CONNECTION_H_
#define FERRY_TRANSPORT_SOFTRNIC_CONNECTION_H_

#include <netinet/in.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/mutex.h"
#include "transport/softrnic/softrnic.h"

namespace softrnic {

// One TCP connection: either a QP's outgoing (requester) connection, or
// one the device's listener accepted (the responder side). The socket is
// closed when the last reference goes, so whoever sees the connection die
// drops its reference at once and the descriptor is released.
class Connection {
 public:
  // `admitted_from` (network order) is the source address an accepted
  // connection was admitted for (AdmitConnection); its slot is released
  // with the connection. 0 for outgoing connections.
  Connection(Device* dev, int fd, uint32_t admitted_from = 0)
      : dev_(dev), fd_(fd), admitted_from_(admitted_from), id_(NextId()) {}
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int fd() const { return fd_; }
  // Unique in the process, never 0.
  uint64_t id() const { return id_; }
  // Bytes WriteAll has handed to the socket (counted per sendmsg).
  uint64_t bytes_written() const {
    return bytes_written_.load(std::memory_order_acquire);
  }
  // Bytes Read has taken from the socket.
  uint64_t bytes_read() const {
    return bytes_read_.load(std::memory_order_relaxed);
  }
  // Bytes handed to the socket that the peer's TCP has acknowledged, read
  // after bytes_written() (so a write racing with it lowers, never raises,
  // the answer); -1 if the socket cannot tell (SIOCOUTQ failed).
  int64_t BytesAcked() const;
  Device* device() const { return dev_; }
  // The source address an accepted connection came from (network order).
  uint32_t admitted_from() const { return admitted_from_; }
  // Writes every byte (after the device's injected delay, which Close()
  // cuts short); on failure the
  // connection is closed and false returned. Callers serialize with mu.
  // `pins` are the MRs the iovecs point into (see Holds).
  bool WriteAll(iovec* iov, int iovcnt, Mr* const* pins = nullptr,
                int npins = 0);
  // Reads exactly n bytes into `dst` (which lies in `pin`, if given); false
  // on EOF, error, or once the connection is closed. Only one thread reads.
  bool Read(void* dst, size_t n, Mr* pin = nullptr);
  // Shuts the socket down: blocked readers and writers return, and no
  // further byte is read into memory or sent from it.
  void Close();
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // Whether I/O in progress on this connection reads or writes `mr`'s
  // memory (ibv_dereg_mr closes such connections to abort that I/O).
  bool Holds(const Mr* mr) const;

  ferry::Mutex mu;  // Serializes writers.

 private:
  // Slot 0 is the reader's; the writer's (under mu) follow.
  static constexpr int kPinSlots = 1 + kMaxSge;

  static uint64_t NextId();
  // The injected delay of `us`, cut short by Close().
  void Delay(uint32_t us);

  Device* const dev_;
  const int fd_;
  const uint32_t admitted_from_;
  std::atomic<bool> closed_{false};
  const uint64_t id_;
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<const Mr*> pins_[kPinSlots] = {};
};

// Connects to a device listener (bounded by `timeout_ms`) and registers the
// connection with `dev` so link-down and fault injection can cut it. With
// `first`, the `first_bytes` the listener sends on accept (its CHALLENGE)
// are read into it, within the same bound, before the connection is
// returned; null if they do not come.
std::shared_ptr<Connection> Dial(Device* dev, in_addr ip, uint16_t port,
                                 int timeout_ms, uint8_t* first = nullptr,
                                 size_t first_bytes = 0);
// Registers a connection with `dev` (CutDeviceConnections, dereg aborts).
void Track(Device* dev, const std::shared_ptr<Connection>& conn);
// Closes every connection whose I/O in progress holds `mr`.
void AbortConnectionsHolding(const Mr* mr);
void TuneSocket(int fd);

// Admission of accepted connections against the device's caps (global and
// per source address, Limits): false if over a cap. Every admitted slot is
// released once, by ReleaseConnection (a Connection does it on
// destruction).
bool AdmitConnection(Device* dev, uint32_t addr);
void ReleaseConnection(Device* dev, uint32_t addr);

// Where payload bytes come from.
class PayloadSource {
 public:
  virtual ~PayloadSource() = default;
  // Copies the next n bytes to dst (inside MR `pin`), or skips them if dst
  // is null.
  virtual bool Read(uint8_t* dst, size_t n, Mr* pin) = 0;
};

class SocketSource final : public PayloadSource {
 public:
  explicit SocketSource(Connection* conn) : conn_(conn) {}
  bool Read(uint8_t* dst, size_t n, Mr* pin) override;

 private:
  Connection* conn_;
};

// Gathers from a list of memory segments (same-process loopback).
class GatherSource final : public PayloadSource {
 public:
  void Add(const uint8_t* p, size_t n) {
    if (n > 0) segs_.push_back({p, n});
  }
  bool Read(uint8_t* dst, size_t n, Mr* pin) override;

 private:
  struct Seg {
    const uint8_t* p;
    size_t n;
  };
  std::vector<Seg> segs_;
  size_t seg_ = 0, off_ = 0;
};

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_CONNECTION_H_
