#include "transport/tcp/tcp_connection.h"

#include <sys/socket.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

// Receive timeout: how often the receiver wakes to check for shutdown.
constexpr absl::Duration kWakeInterval = absl::Milliseconds(200);
// A response stalled mid-payload for this many wake-ups breaks the
// connection (slice deadlines usually fire first).
constexpr int kMaxStalledWakeups = 50;

absl::Status WireError(const Slice& slice, WireStatus status) {
  switch (status) {
    case WireStatus::kOk:
      return absl::OkStatus();
    case WireStatus::kOutOfBounds:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("target '", slice.target->name(), "' rejected ",
                   slice.op == OpCode::kWrite ? "WRITE" : "READ", " of 0x",
                   absl::Hex(slice.remote), "+", slice.length,
                   ": not inside a buffer registered as remote-accessible"));
}

}  // namespace

TcpConnection::TcpConnection(HostPort peer, absl::Duration connect_timeout)
    : peer_(std::move(peer)), connect_timeout_(connect_timeout) {
  sender_ = std::thread([this] { SendLoop(); });
}

TcpConnection::~TcpConnection() {
  stopping_.store(true);
  Fail(absl::CancelledError(
      absl::StrCat("connection to ", peer_.ToString(), " closed")));
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
}

void TcpConnection::Finish(Slice* slice, const absl::Status& status) {
  load_bytes_.fetch_sub(slice->length, std::memory_order_relaxed);
  slice->Complete(status);
}

void TcpConnection::Enqueue(Slice* slice) {
  load_bytes_.fetch_add(slice->length, std::memory_order_relaxed);
  absl::Status failure;
  {
    MutexLock lock(&mu_);
    if (!broken_.load()) {
      queue_.push_back(slice);
      send_cv_.Signal();
      return;
    }
    failure = failure_;
  }
  Finish(slice, failure);
}

void TcpConnection::Fail(const absl::Status& status) {
  std::vector<Slice*> failed;
  absl::Status failure;
  {
    MutexLock lock(&mu_);
    if (!broken_.load()) {
      failure_ = status;
      broken_.store(true, std::memory_order_release);
    }
    failure = failure_;
    for (Slice* s : queue_) failed.push_back(s);
    queue_.clear();
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (it->second.sending || it->second.answered) {
        ++it;  // The sender or the receiver completes it.
      } else {
        failed.push_back(it->second.slice);
        inflight_.erase(it++);
      }
    }
    if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
    send_cv_.SignalAll();
  }
  for (Slice* s : failed) Finish(s, failure);
}

void TcpConnection::ExpireOverdue(absl::Time now) {
  std::vector<Slice*> expired;
  {
    MutexLock lock(&mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if ((*it)->deadline < now) {
        expired.push_back(*it);
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (!it->second.sending && !it->second.answered &&
          it->second.slice->deadline < now) {
        expired.push_back(it->second.slice);
        inflight_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (Slice* s : expired) {
    Finish(s, absl::DeadlineExceededError(
                  absl::StrCat("transfer to ", peer_.ToString(),
                               " did not complete before its deadline")));
  }
}

void TcpConnection::SendLoop() {
  auto fd = ConnectTcp(peer_, connect_timeout_);
  if (!fd.ok()) {
    Fail(absl::UnavailableError(
        absl::StrCat("cannot connect to TCP transport of peer ",
                     peer_.ToString(), ": ", fd.status().message())));
    return;
  }
  TuneDataSocket(fd->get());
  SetRecvTimeout(fd->get(), kWakeInterval);
  int sock = fd->get();
  {
    MutexLock lock(&mu_);
    fd_ = std::move(*fd);
    connected_ = true;
    if (broken_.load()) ::shutdown(sock, SHUT_RDWR);
  }
  receiver_ = std::thread([this] { RecvLoop(); });

  while (true) {
    Slice* slice = nullptr;
    uint64_t id = 0;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !broken_.load()) send_cv_.Wait(&mu_);
      if (broken_.load()) return;
      slice = queue_.front();
      queue_.pop_front();
      id = next_id_++;
      inflight_.emplace(id, Inflight{slice, /*sending=*/true});
    }
    const bool is_write = slice->op == OpCode::kWrite;
    uint8_t hdr[kRequestHeaderBytes];
    EncodeRequest({is_write ? WireOp::kWrite : WireOp::kRead, id, slice->remote,
                   slice->length},
                  hdr);
    iovec iov[2] = {{hdr, sizeof(hdr)}, {slice->local, slice->length}};
    absl::Status s = WriteFullv(sock, iov, is_write ? 2 : 1);
    // From here on the slice's memory is no longer read by this thread; it
    // may even have completed already (look it up by id, not by pointer).
    bool finish_here = false;
    absl::Status finish_status;
    {
      MutexLock lock(&mu_);
      auto it = inflight_.find(id);
      if (it != inflight_.end()) {
        if (it->second.done.has_value()) {
          // Answered while we were in sendmsg: ours to complete now.
          finish_here = true;
          finish_status = *it->second.done;
          inflight_.erase(it);
        } else if (it->second.answered) {
          it->second.sending = false;  // The receiver completes it.
        } else if (!s.ok() || broken_.load()) {
          finish_here = true;
          finish_status = absl::UnavailableError(
              absl::StrCat("TCP connection to ", peer_.ToString(),
                           " failed: ", (s.ok() ? failure_ : s).message()));
          inflight_.erase(it);
        } else {
          it->second.sending = false;
        }
      }
    }
    if (finish_here) Finish(slice, finish_status);
    if (!s.ok()) {
      Fail(absl::UnavailableError(absl::StrCat(
          "TCP connection to ", peer_.ToString(), " failed: ", s.message())));
      return;
    }
  }
}

void TcpConnection::CompleteAnswered(uint64_t id, Slice* slice,
                                     const absl::Status& status) {
  {
    MutexLock lock(&mu_);
    auto it = inflight_.find(id);
    if (it != inflight_.end() && it->second.sending) {
      it->second.done = status;
      return;
    }
    if (it != inflight_.end()) inflight_.erase(it);
  }
  Finish(slice, status);
}

void TcpConnection::RecvLoop() {
  const int sock = [this] {
    MutexLock lock(&mu_);
    return fd_.get();
  }();
  while (!stopping_.load()) {
    uint8_t hdr[kResponseHeaderBytes];
    absl::Status s = ReadFullPatient(sock, hdr, sizeof(hdr), stopping_,
                                     kMaxStalledWakeups, /*idle_ok=*/true);
    if (!s.ok()) {
      Fail(absl::UnavailableError(absl::StrCat(
          "TCP connection to ", peer_.ToString(), " lost: ", s.message())));
      return;
    }
    ResponseHeader resp;
    if (s = DecodeResponse(hdr, &resp); !s.ok()) {
      Fail(absl::DataLossError(absl::StrCat(
          "peer ", peer_.ToString(), " sent a bad frame: ", s.message())));
      return;
    }
    Slice* slice = nullptr;
    const uint64_t id = resp.request_id;
    {
      MutexLock lock(&mu_);
      auto it = inflight_.find(id);
      if (it != inflight_.end() && !it->second.answered) {
        slice = it->second.slice;
        it->second.answered = true;  // Neither reaper nor Fail may take it.
      }
    }
    if (slice == nullptr) {
      // Already expired: keep the stream in sync, drop the data.
      s = ReadFullPatient(sock, nullptr, resp.length, stopping_,
                          kMaxStalledWakeups);
      if (!s.ok()) {
        Fail(absl::UnavailableError(absl::StrCat(
            "TCP connection to ", peer_.ToString(), " lost: ", s.message())));
        return;
      }
      continue;
    }
    const WireOp expect =
        slice->op == OpCode::kWrite ? WireOp::kWriteAck : WireOp::kReadData;
    if (resp.op != expect ||
        (resp.op == WireOp::kReadData && resp.status == WireStatus::kOk &&
         resp.length != slice->length)) {
      absl::Status bad = absl::DataLossError(
          absl::StrCat("peer ", peer_.ToString(), " answered request ",
                       resp.request_id, " with a mismatched response"));
      CompleteAnswered(id, slice, bad);
      Fail(bad);
      return;
    }
    if (resp.length > 0) {
      s = ReadFullPatient(sock, slice->local, resp.length, stopping_,
                          kMaxStalledWakeups);
      if (!s.ok()) {
        absl::Status lost = absl::UnavailableError(
            absl::StrCat("TCP connection to ", peer_.ToString(),
                         " lost mid-READ: ", s.message()));
        CompleteAnswered(id, slice, lost);
        Fail(lost);
        return;
      }
    }
    CompleteAnswered(id, slice, WireError(*slice, resp.status));
  }
}

}  // namespace ferry::tcp
