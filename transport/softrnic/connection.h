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

class Connection {
 public:
  Connection(Device* dev, int fd) : dev_(dev), fd_(fd) {}
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int fd() const { return fd_; }
  Device* device() const { return dev_; }
  // Writes every byte (after the device's injected delay); on failure the
  // connection is closed and false returned. Callers serialize with mu.
  bool WriteAll(iovec* iov, int iovcnt);
  // Shuts the socket down: blocked readers and writers return.
  void Close();
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  ferry::Mutex mu;  // Serializes writers.

 private:
  Device* const dev_;
  const int fd_;
  std::atomic<bool> closed_{false};
};

// Connects to a device listener (bounded by `timeout_ms`) and registers the
// connection with `dev` so link-down and fault injection can cut it.
std::shared_ptr<Connection> Dial(Device* dev, in_addr ip, uint16_t port,
                                 int timeout_ms);
// Registers an accepted connection with `dev`.
void Track(Device* dev, const std::shared_ptr<Connection>& conn);
void TuneSocket(int fd);
// Reads exactly n bytes; false on EOF or error.
bool ReadFully(int fd, void* buf, size_t n);

// Where payload bytes come from.
class PayloadSource {
 public:
  virtual ~PayloadSource() = default;
  // Copies the next n bytes to dst, or skips them if dst is null.
  virtual bool Read(uint8_t* dst, size_t n) = 0;
};

class SocketSource final : public PayloadSource {
 public:
  explicit SocketSource(int fd) : fd_(fd) {}
  bool Read(uint8_t* dst, size_t n) override;

 private:
  int fd_;
};

// Gathers from a list of memory segments (same-process loopback).
class GatherSource final : public PayloadSource {
 public:
  void Add(const uint8_t* p, size_t n) {
    if (n > 0) segs_.push_back({p, n});
  }
  bool Read(uint8_t* dst, size_t n) override;

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
