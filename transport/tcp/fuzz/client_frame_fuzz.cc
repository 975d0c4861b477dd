// Fuzz target: the bytes a target (or anyone answering a connect) sends
// back to the TCP transport's initiator side. Drives ClientSession the way
// a connection does: slices queued, requests sent in pieces, responses
// received in pieces, a deadline sweep, and an abort at the end.
//
// Input: byte 0: slices (1..8); then per slice 2 bytes (bit 0 of the first:
// READ or WRITE; the rest: length 1..2048); then the send size, the
// receive size, how many request bytes go out before any response (x64),
// and when the deadline sweep runs (seconds); the rest is the peer's bytes.
//
// Checked: every slice ends exactly once (done, or handed back for a retry
// only if none of its bytes were sent); READ data lands only in its slice
// (each slice's memory is its own heap block: ASan sees an overflow); the
// session is empty afterwards.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "descriptor/descriptor.pb.h"
#include "transport/segment_view.h"
#include "transport/tcp/client_session.h"
#include "transport/tcp/wire.h"
#include "transport/transport.h"

namespace {

using ferry::Slice;
using ferry::tcp::ClientSession;
namespace tcp = ferry::tcp;

const ferry::SegmentView* View() {
  static const auto* view = [] {
    ferry::descriptor::SegmentDescriptor d;
    d.set_name("target");
    d.set_incarnation(7);
    auto* t = d.add_transports();
    t->set_transport("tcp");
    t->set_address("127.0.0.1:1");
    auto* b = d.add_buffers();
    b->set_addr(0x40000000);
    b->set_length(1 << 20);
    b->set_tcp_key(0x6b6579);
    auto v = ferry::SegmentView::Create(d);
    if (!v.ok()) __builtin_trap();
    return new std::shared_ptr<const ferry::SegmentView>(*v);
  }();
  return view->get();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t n = 1 + data[0] % 8;
  if (size < 1 + 2 * n + 4) return 0;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  std::vector<std::unique_ptr<uint8_t[]>> memory(n);
  std::vector<Slice> slices(n);
  std::vector<int> ended(n, 0);
  // The top bit of the first byte: a session under a token, which waits
  // for the CHALLENGE the input may (or may not) open with.
  ClientSession s("127.0.0.1:1",
                  (data[0] & 0x80) != 0 ? "fuzz-cluster-token-0123" : "");
  for (size_t i = 0; i < n; ++i) {
    const uint8_t a = data[1 + 2 * i], b = data[2 + 2 * i];
    Slice& sl = slices[i];
    sl.op = (a & 1) ? ferry::OpCode::kWrite : ferry::OpCode::kRead;
    sl.length = 1 + (((a >> 1) << 8 | b) % 2048);
    memory[i] = std::make_unique<uint8_t[]>(sl.length);
    std::memset(memory[i].get(), static_cast<int>(i), sl.length);
    sl.local = memory[i].get();
    sl.remote = 0x40000000 + 4096 * i;
    sl.target = View();
    sl.remote_buffer = 0;
    sl.deadline = t0 + absl::Seconds(static_cast<int64_t>(i + 1));
    s.Add(&sl);
  }
  size_t p = 1 + 2 * n;
  const size_t send_size = data[p] == 0 ? 65536 : data[p];
  const size_t recv_size = data[p + 1] == 0 ? 65536 : data[p + 1];
  size_t send_budget = static_cast<size_t>(data[p + 2]) * 64;
  const absl::Time sweep = t0 + absl::Seconds(data[p + 3] % 16);
  p += 4;
  data += p;
  size -= p;

  // Send what the budget allows.
  size_t sent = 0;
  while (s.has_output() && send_budget > 0) {
    iovec iov[16];
    const int k = s.PrepareOutput(iov, 16);
    if (k <= 0) __builtin_trap();
    size_t take = 0;
    for (int i = 0; i < k; ++i) take += iov[i].iov_len;
    take = std::min({take, send_size, send_budget});
    s.OnSent(take);
    send_budget -= take;
    sent += take;
  }
  std::vector<ClientSession::Done> done;
  std::vector<Slice*> retry;
  absl::Status broken;
  size_t off = 0;
  bool swept = false;
  while (broken.ok()) {
    if (!swept && off >= size / 2) {
      swept = true;
      if (s.Expire(sweep, &done)) {
        broken = absl::DeadlineExceededError("late on the wire");
        break;
      }
    }
    if (off >= size) break;
    auto [buf, len] = s.InputBuffer();
    if (buf == nullptr || len == 0) __builtin_trap();
    const size_t k = std::min({len, recv_size, size - off});
    std::memcpy(buf, data + off, k);
    off += k;
    broken = s.OnReceived(k, &done);
  }
  s.Abort(broken.ok() ? absl::UnavailableError("closed") : broken, sweep,
          &retry, &done);
  if (!s.empty() || s.load_bytes() != 0) __builtin_trap();
  for (const auto& d : done) {
    const size_t i = static_cast<size_t>(d.slice - slices.data());
    if (i >= n) __builtin_trap();
    ++ended[i];
  }
  // Requests went out in order: slice i is on the wire if its request
  // starts within the bytes sent. Only the others may be retried.
  std::vector<bool> on_wire(n);
  size_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    on_wire[i] = start < sent;
    start += tcp::kRequestHeaderBytes +
             (slices[i].op == ferry::OpCode::kWrite ? slices[i].length : 0);
  }
  for (Slice* r : retry) {
    const size_t i = static_cast<size_t>(r - slices.data());
    if (i >= n || on_wire[i]) __builtin_trap();
    ++ended[i];
  }
  for (size_t i = 0; i < n; ++i) {
    if (ended[i] != 1) __builtin_trap();
  }
  return 0;
}
