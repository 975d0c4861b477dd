// StagingBuffer: the small receive buffer in which both halves of the TCP
// wire protocol (client_session.h, server_session.h) stage frame headers,
// with whatever payload bytes a recv brought along with them.
//
// Bytes arrive at the tail (Space, then Commit) and are parsed from the
// head (data, Consume). Unread bytes move to the front only once the tail
// is full, so one recv can fetch a batch of headers and the parser never
// copies a header that fits before the end.
//
// Not thread-safe: one session owns it.
#ifndef FERRY_TRANSPORT_TCP_STAGING_BUFFER_H_
#define FERRY_TRANSPORT_TCP_STAGING_BUFFER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

namespace ferry::tcp {

class StagingBuffer {
 public:
  // Bytes the buffer holds: a batch of headers per recv.
  static constexpr size_t kCapacity = 4096;

  StagingBuffer() = default;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  // The staged bytes not consumed yet.
  const uint8_t* data() const { return bytes_ + begin_; }
  size_t size() const { return end_ - begin_; }
  bool empty() const { return begin_ == end_; }

  // Where the next recv goes. An empty buffer starts again at the front; a
  // full tail moves the unread bytes to the front first. Empty only while
  // kCapacity unread bytes are staged: the caller parses every whole frame
  // (headers are much smaller) before it receives again.
  std::pair<uint8_t*, size_t> Space() {
    if (begin_ == end_) {
      begin_ = end_ = 0;
    } else if (end_ == kCapacity) {
      std::memmove(bytes_, bytes_ + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
    }
    return {bytes_ + end_, kCapacity - end_};
  }

  // `n` bytes arrived at Space(); any beyond its end are not kept.
  void Commit(size_t n) { end_ += std::min(n, kCapacity - end_); }

  // The first `n` (at most size()) staged bytes were parsed.
  void Consume(size_t n) { begin_ += n; }

  // Drops every staged byte (the connection is gone).
  void Clear() { begin_ = end_ = 0; }

 private:
  uint8_t bytes_[kCapacity];
  size_t begin_ = 0;
  size_t end_ = 0;
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_STAGING_BUFFER_H_
