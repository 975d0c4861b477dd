// ServerSession alone: bytes in, bytes out, a fake clock.
#include "transport/tcp/server_session.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);
const BufferKey kKey{0x0123456789abcdefull};
constexpr uint64_t kIncarnation = 42;

class ServerSessionTest : public ::testing::Test {
 protected:
  // 64 KiB of GPU 0's memory (softgpu), registered with the key.
  void AddGpuBuffer(const gpu::CudaDriver& d, CUdeviceptr* dev) {
    ASSERT_OK(d.UseDevice(0));
    ASSERT_OK(d.Check(d.api().cuMemAlloc(dev, 1 << 16), "cuMemAlloc"));
    MemoryRegion r;
    r.addr = *dev;
    r.length = 1 << 16;
    r.remote_accessible = true;
    r.cuda_device = 0;
    ASSERT_OK_AND_ASSIGN(gpu::PointerInfo info,
                         d.Classify(reinterpret_cast<void*>(*dev)));
    r.cuda_buffer_id = info.buffer_id;
    ASSERT_OK(registry_.Add(r, {&kKey}));
  }

  void SetUp() override {
    mem_.assign(1 << 16, 0);
    MemoryRegion r;
    r.addr = base();
    r.length = mem_.size();
    r.remote_accessible = true;
    ASSERT_OK(registry_.Add(r, {&kKey}));
    limits_.handshake_timeout = absl::Seconds(10);
    limits_.idle_timeout = absl::Seconds(60);
    limits_.frame_timeout = absl::Seconds(5);
  }

  uint64_t base() const { return reinterpret_cast<uint64_t>(mem_.data()); }

  static std::string Request(WireOp op, uint64_t id, uint64_t addr,
                             uint64_t len, uint64_t key = kKey.value,
                             uint64_t incarnation = kIncarnation) {
    uint8_t h[kRequestHeaderBytes];
    EncodeRequest({op, id, addr, len, key, incarnation}, h);
    return std::string(reinterpret_cast<char*>(h), sizeof(h));
  }

  // Feeds `bytes` in pieces of at most `chunk`.
  static absl::Status Feed(ServerSession& s, const std::string& bytes,
                           absl::Time now, size_t chunk = 1 << 20) {
    size_t off = 0;
    while (off < bytes.size()) {
      auto [buf, len] = s.InputBuffer();
      if (len == 0) return absl::ResourceExhaustedError("input paused");
      const size_t n = std::min({len, chunk, bytes.size() - off});
      std::memcpy(buf, bytes.data() + off, n);
      off += n;
      if (absl::Status st = s.OnReceived(n, now); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  // Takes all output (in pieces of at most `chunk`).
  static std::string Drain(ServerSession& s, absl::Time now,
                           size_t chunk = 1 << 20) {
    std::string out;
    while (s.has_output()) {
      iovec iov[16];
      const int n = s.PrepareOutput(iov, 16);
      size_t taken = 0;
      for (int i = 0; i < n && taken < chunk; ++i) {
        const size_t k = std::min(iov[i].iov_len, chunk - taken);
        out.append(static_cast<char*>(iov[i].iov_base), k);
        taken += k;
      }
      EXPECT_OK(s.OnSent(taken, now));
    }
    return out;
  }

  static std::vector<ResponseHeader> Responses(const std::string& out) {
    std::vector<ResponseHeader> r;
    size_t off = 0;
    while (off + kResponseHeaderBytes <= out.size()) {
      ResponseHeader h;
      EXPECT_OK(DecodeResponse(
          reinterpret_cast<const uint8_t*>(out.data()) + off, &h));
      r.push_back(h);
      off += kResponseHeaderBytes + h.length;
    }
    EXPECT_EQ(off, out.size());
    return r;
  }

  std::vector<uint8_t> mem_;
  MemoryRegistry registry_;
  ServerSession::Limits limits_;
};

TEST_F(ServerSessionTest, WriteIsAppliedThenAcknowledged) {
  for (size_t chunk : {1u, 7u, 33u, 4096u, 1u << 20}) {
    ServerSession s(&registry_, limits_, kIncarnation, kT0);
    std::string payload(5000, static_cast<char>(chunk));
    ASSERT_OK(Feed(s, Request(WireOp::kWrite, 9, base() + 100, 5000) + payload,
                   kT0, chunk));
    EXPECT_EQ(std::memcmp(mem_.data() + 100, payload.data(), 5000), 0);
    auto r = Responses(Drain(s, kT0, chunk));
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r[0].op, WireOp::kWriteAck);
    EXPECT_EQ(r[0].status, WireStatus::kOk);
    EXPECT_EQ(r[0].request_id, 9u);
  }
}

TEST_F(ServerSessionTest, ReadIsAnsweredFromMemory) {
  for (size_t i = 0; i < 300; ++i) mem_[i] = static_cast<uint8_t>(i * 7);
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  ASSERT_OK(Feed(s, Request(WireOp::kRead, 3, base() + 10, 200), kT0));
  const std::string out = Drain(s, kT0, 13);
  auto r = Responses(out);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].length, 200u);
  EXPECT_EQ(
      std::memcmp(out.data() + kResponseHeaderBytes, mem_.data() + 10, 200), 0);
}

// GPU memory (softgpu) is staged through the server's pinned buffers. With
// one buffer, held by session A's queued answer, session B's first READ
// waits: that is not a handshake timeout, but it may wait only
// frame_timeout; once A's answer is sent, B is served from the device.
TEST_F(ServerSessionTest, GpuFramesWaitForAStagingBufferWithinTheFrameTimeout) {
  const gpu::CudaDriver& d = gpu::SoftgpuDriver(1);
  CUdeviceptr dev = 0;
  ASSERT_NO_FATAL_FAILURE(AddGpuBuffer(d, &dev));
  std::string want(16, '\x5a');
  ASSERT_OK(d.CopyToDevice(dev, want.data(), want.size()));
  limits_.handshake_timeout = absl::Seconds(2);
  limits_.frame_timeout = absl::Seconds(5);
  {
    TargetStaging staging(1, 4096);
    ServerSession a(&registry_, limits_, kIncarnation, kT0, &staging);
    ServerSession b(&registry_, limits_, kIncarnation, kT0, &staging);
    ASSERT_OK(Feed(a, Request(WireOp::kRead, 1, dev, 16), kT0));
    ASSERT_OK(Feed(b, Request(WireOp::kRead, 2, dev, 16), kT0));
    EXPECT_FALSE(a.stalled());
    EXPECT_TRUE(b.stalled());
    EXPECT_FALSE(b.wants_input());
    // Past the handshake timeout: B's request arrived whole.
    EXPECT_OK(b.CheckTimeouts(kT0 + absl::Seconds(3)));
    absl::Status late = b.CheckTimeouts(kT0 + absl::Seconds(6));
    EXPECT_STATUS(late, absl::StatusCode::kDeadlineExceeded);
    EXPECT_NE(late.message().find("staging buffer"), std::string::npos) << late;
    // A's answer goes out and gives the buffer back; B is served.
    const std::string out_a = Drain(a, kT0);
    EXPECT_EQ(out_a.substr(kResponseHeaderBytes), want);
    ASSERT_OK(b.Resume(kT0 + absl::Seconds(1)));
    EXPECT_FALSE(b.stalled());
    const std::string out_b = Drain(b, kT0 + absl::Seconds(1));
    auto resp = Responses(out_b);
    ASSERT_EQ(resp.size(), 1u);
    EXPECT_EQ(resp[0].status, WireStatus::kOk);
    EXPECT_EQ(out_b.substr(kResponseHeaderBytes), want);
  }
  ASSERT_OK(registry_.Remove(dev, absl::Seconds(1)));
  d.api().cuMemFree(dev);
}

// GPU memory freed under its registration is refused (the copy would land
// wherever the address points now), a WRITE's payload drained unapplied.
TEST_F(ServerSessionTest, FramesToFreedGpuMemoryAreRefused) {
  const gpu::CudaDriver& d = gpu::SoftgpuDriver(1);
  CUdeviceptr dev = 0;
  ASSERT_NO_FATAL_FAILURE(AddGpuBuffer(d, &dev));
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
  // Another allocation at the same address (softgpu reuses it, as GPU
  // drivers do): a copy there would succeed, so only the check refuses.
  CUdeviceptr now = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&now, 1 << 16), "cuMemAlloc"));
  ASSERT_EQ(now, dev);
  const std::string theirs(64, 't');
  ASSERT_OK(d.CopyToDevice(now, theirs.data(), theirs.size()));
  {
    TargetStaging staging(2, 4096);
    ServerSession s(&registry_, limits_, kIncarnation, kT0, &staging);
    ASSERT_OK(Feed(s,
                   Request(WireOp::kWrite, 1, dev, 64) + std::string(64, 'w') +
                       Request(WireOp::kRead, 2, dev, 16),
                   kT0));
    auto resp = Responses(Drain(s, kT0));
    ASSERT_EQ(resp.size(), 2u);
    EXPECT_EQ(resp[0].status, WireStatus::kStagingFailed);
    EXPECT_EQ(resp[1].status, WireStatus::kStagingFailed);
    EXPECT_EQ(resp[1].length, 0u);
  }
  std::string after(64, '\0');
  ASSERT_OK(d.CopyFromDevice(after.data(), now, after.size()));
  EXPECT_EQ(after, theirs);  // The WRITE did not land in it.
  ASSERT_OK(registry_.Remove(dev, absl::Seconds(1)));
  ASSERT_OK(d.Check(d.api().cuMemFree(now), "cuMemFree"));
}

TEST_F(ServerSessionTest, OutOfBoundsIsRejectedAndTouchesNothing) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  const uint64_t end = base() + mem_.size();
  std::string payload(64, 'x');
  // Straddles the end; then an OK request on the same stream.
  ASSERT_OK(Feed(s,
                 Request(WireOp::kWrite, 1, end - 32, 64) + payload +
                     Request(WireOp::kRead, 2, end, 1) +
                     Request(WireOp::kRead, 3, base(), 8),
                 kT0, 5));
  auto r = Responses(Drain(s, kT0));
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].status, WireStatus::kOutOfBounds);
  EXPECT_EQ(r[1].status, WireStatus::kOutOfBounds);
  EXPECT_EQ(r[1].length, 0u);
  EXPECT_EQ(r[2].status, WireStatus::kOk);
  for (size_t i = mem_.size() - 32; i < mem_.size(); ++i) ASSERT_EQ(mem_[i], 0);
}

// Knowing an address is not enough: a frame with another key, or meant for
// another run of the engine, reads and writes nothing and is answered
// with its reason; the stream goes on.
TEST_F(ServerSessionTest, WrongKeyOrIncarnationTouchesNothing) {
  for (size_t i = 0; i < 64; ++i) mem_[i] = 0x11;
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  const std::string payload(64, 'x');
  ASSERT_OK(Feed(
      s,
      Request(WireOp::kWrite, 1, base(), 64, kKey.value ^ 1) + payload +
          Request(WireOp::kRead, 2, base(), 64, kKey.value + 1) +
          Request(WireOp::kWrite, 3, base(), 64, kKey.value, kIncarnation + 1) +
          payload + Request(WireOp::kRead, 4, base(), 64, 0, 0) +
          Request(WireOp::kRead, 5, base(), 64),
      kT0, 7));
  const std::string out = Drain(s, kT0);
  auto r = Responses(out);
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0].status, WireStatus::kBadKey);
  EXPECT_EQ(r[1].status, WireStatus::kBadKey);
  EXPECT_EQ(r[1].length, 0u);  // No data.
  EXPECT_EQ(r[2].status, WireStatus::kWrongIncarnation);
  EXPECT_EQ(r[3].status, WireStatus::kWrongIncarnation);
  EXPECT_EQ(r[4].status, WireStatus::kOk);
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(mem_[i], 0x11) << i;
  EXPECT_EQ(s.denied(), 4u);
  EXPECT_EQ(s.requests(), 5u);
}

// A buffer registered without a key (not through TcpTransport) is served
// to nobody, whatever the frame says.
TEST_F(ServerSessionTest, BufferWithoutKeyIsServedToNobody) {
  std::vector<uint8_t> other(4096, 0x22);
  MemoryRegion r;
  r.addr = reinterpret_cast<uintptr_t>(other.data());
  r.length = other.size();
  r.remote_accessible = true;
  ASSERT_OK(registry_.Add(r));
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  ASSERT_OK(Feed(s,
                 Request(WireOp::kRead, 1, r.addr, 8, 0) +
                     Request(WireOp::kRead, 2, r.addr, 8, kKey.value),
                 kT0));
  auto resp = Responses(Drain(s, kT0));
  ASSERT_EQ(resp.size(), 2u);
  EXPECT_EQ(resp[0].status, WireStatus::kBadKey);
  EXPECT_EQ(resp[1].status, WireStatus::kBadKey);
  ASSERT_OK(registry_.Remove(r.addr, absl::ZeroDuration()));
}

TEST_F(ServerSessionTest, BadHeaderEndsTheSession) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  std::string garbage(kRequestHeaderBytes, 'Z');
  EXPECT_STATUS(Feed(s, garbage, kT0), absl::StatusCode::kDataLoss);
  ServerSession s2(&registry_, limits_, kIncarnation, kT0);
  EXPECT_STATUS(Feed(s2, Request(WireOp::kRead, 1, base(), 0), kT0),
                absl::StatusCode::kDataLoss);  // Length 0.
}

TEST_F(ServerSessionTest, LeaseHeldWhilePayloadArrives) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  ASSERT_OK(Feed(s, Request(WireOp::kWrite, 1, base(), 100) + "abc", kT0));
  // Mid-payload: the buffer cannot be unregistered.
  EXPECT_STATUS(registry_.Remove(base(), absl::ZeroDuration()),
                absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(Feed(s, std::string(97, 'd'), kT0));
  Drain(s, kT0);
  EXPECT_OK(registry_.Remove(base(), absl::ZeroDuration()));
}

TEST_F(ServerSessionTest, HandshakeTimeout) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  EXPECT_OK(s.CheckTimeouts(kT0 + absl::Seconds(10)));
  EXPECT_STATUS(s.CheckTimeouts(kT0 + absl::Seconds(11)),
                absl::StatusCode::kDeadlineExceeded);
  ServerSession s2(&registry_, limits_, kIncarnation, kT0);
  ASSERT_OK(
      Feed(s2, Request(WireOp::kRead, 1, base(), 8), kT0 + absl::Seconds(9)));
  Drain(s2, kT0 + absl::Seconds(9));
  EXPECT_OK(s2.CheckTimeouts(kT0 + absl::Seconds(11)));
}

TEST_F(ServerSessionTest, IdleTimeoutCountsFromTheLastAnswer) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  const absl::Time t1 = kT0 + absl::Seconds(1);
  ASSERT_OK(Feed(s, Request(WireOp::kRead, 1, base(), 8), t1));
  const absl::Time t2 = kT0 + absl::Seconds(2);
  Drain(s, t2);
  EXPECT_OK(s.CheckTimeouts(t2 + absl::Seconds(60)));
  EXPECT_STATUS(s.CheckTimeouts(t2 + absl::Seconds(61)),
                absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ServerSessionTest, FrameTimeoutForPartialHeaderAndPayload) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  ASSERT_OK(Feed(s, Request(WireOp::kRead, 1, base(), 8), kT0));
  Drain(s, kT0);
  const absl::Time t1 = kT0 + absl::Seconds(20);
  ASSERT_OK(Feed(s, Request(WireOp::kRead, 2, base(), 8).substr(0, 10), t1));
  EXPECT_OK(s.CheckTimeouts(t1 + absl::Seconds(5)));
  EXPECT_STATUS(s.CheckTimeouts(t1 + absl::Seconds(6)),
                absl::StatusCode::kDeadlineExceeded);

  ServerSession w(&registry_, limits_, kIncarnation, kT0);
  ASSERT_OK(Feed(w, Request(WireOp::kWrite, 1, base(), 1000) + "x", kT0));
  // Dripping the payload does not reset the frame's clock.
  for (int i = 1; i <= 5; ++i) {
    ASSERT_OK(Feed(w, "x", kT0 + absl::Seconds(i)));
  }
  EXPECT_STATUS(w.CheckTimeouts(kT0 + absl::Seconds(6)),
                absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ServerSessionTest, ResponseNotTakenTimesOut) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  ASSERT_OK(Feed(s, Request(WireOp::kRead, 1, base(), 60000), kT0));
  iovec iov[4];
  ASSERT_GT(s.PrepareOutput(iov, 4), 0);
  ASSERT_OK(s.OnSent(1000, kT0 + absl::Seconds(1)));  // Takes a little.
  EXPECT_OK(s.CheckTimeouts(kT0 + absl::Seconds(5)));
  EXPECT_STATUS(s.CheckTimeouts(kT0 + absl::Seconds(6)),
                absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ServerSessionTest, EveryAnswerIsTakenWithinTheFrameTimeout) {
  // A peer that takes one answer just inside the frame timeout must not
  // keep the others (each holding a lease on the buffer) for longer.
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  std::string reqs;
  for (size_t i = 0; i < ServerSession::kMaxQueuedResponses; ++i) {
    reqs += Request(WireOp::kRead, i + 1, base(), 1000);
  }
  ASSERT_OK(Feed(s, reqs, kT0));
  const size_t one = kResponseHeaderBytes + 1000;
  ASSERT_OK(s.OnSent(one, kT0 + absl::Seconds(4)));
  EXPECT_OK(s.CheckTimeouts(kT0 + absl::Seconds(4)));
  // The second answer waited since kT0: 6 s > the 5 s frame timeout.
  ASSERT_OK(s.OnSent(one, kT0 + absl::Seconds(6)));
  EXPECT_STATUS(s.CheckTimeouts(kT0 + absl::Seconds(6)),
                absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ServerSessionTest, StopsReadingWhileResponsesWait) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  std::string reqs;
  const size_t n = ServerSession::kMaxQueuedResponses + 5;
  for (size_t i = 0; i < n; ++i) {
    reqs += Request(WireOp::kRead, i + 1, base(), 1000);
  }
  ASSERT_OK(Feed(s, reqs, kT0));  // All staged at once.
  EXPECT_FALSE(s.wants_input());
  EXPECT_EQ(s.InputBuffer().second, 0u);
  EXPECT_EQ(s.requests(), ServerSession::kMaxQueuedResponses);
  // A paused session does not count the staged frame against the peer.
  EXPECT_OK(s.CheckTimeouts(kT0 + absl::Seconds(4)));
  // Taking answers resumes the staged requests.
  auto r = Responses(Drain(s, kT0));
  ASSERT_EQ(r.size(), n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(r[i].request_id, i + 1);
}

// Under a token the session speaks first, a CHALLENGE, and serves nothing
// until a PROOF answers it: a request before it, or a proof under another
// token, ends the session with the memory untouched; the right proof, fed
// in pieces of any size, opens it.
TEST_F(ServerSessionTest, UnderATokenNothingIsServedBeforeTheProof) {
  constexpr char kToken[] = "cluster-token-0123456789";
  std::fill(mem_.begin(), mem_.begin() + 64, 0x5a);
  auto challenge_of = [](ServerSession& s) {
    const std::string out = Drain(s, kT0);
    EXPECT_EQ(out.size(), kResponseHeaderBytes);
    ResponseHeader h;
    EXPECT_OK(DecodeResponse(reinterpret_cast<const uint8_t*>(out.data()), &h));
    EXPECT_EQ(h.op, WireOp::kChallenge);
    return out;
  };
  auto proof = [](const std::string& token, const std::string& challenge) {
    uint8_t p[kRequestHeaderBytes + kProofBytes];
    EncodeProof(token, reinterpret_cast<const uint8_t*>(challenge.data()), p);
    return std::string(reinterpret_cast<char*>(p), sizeof(p));
  };
  {
    ServerSession s(&registry_, limits_, kIncarnation, kT0, nullptr, kToken);
    challenge_of(s);
    EXPECT_STATUS(
        Feed(s, Request(WireOp::kWrite, 1, base(), 64) + std::string(64, 'x'),
             kT0),
        absl::StatusCode::kPermissionDenied);
    EXPECT_FALSE(s.proven());
    EXPECT_EQ(s.requests(), 0u);
  }
  {
    ServerSession s(&registry_, limits_, kIncarnation, kT0, nullptr, kToken);
    const std::string c = challenge_of(s);
    EXPECT_STATUS(Feed(s, proof("another-token-0123456789", c), kT0),
                  absl::StatusCode::kPermissionDenied);
  }
  {
    ServerSession a(&registry_, limits_, kIncarnation, kT0, nullptr, kToken);
    ServerSession b(&registry_, limits_, kIncarnation, kT0, nullptr, kToken);
    const std::string ca = challenge_of(a), cb = challenge_of(b);
    EXPECT_NE(ca, cb);
    EXPECT_STATUS(Feed(b, proof(kToken, ca), kT0),  // A's, replayed to B.
                  absl::StatusCode::kPermissionDenied);
  }
  for (size_t chunk : {1u, 7u, 48u, 4096u}) {
    ServerSession s(&registry_, limits_, kIncarnation, kT0, nullptr, kToken);
    const std::string c = challenge_of(s);
    ASSERT_OK(Feed(s,
                   proof(kToken, c) + Request(WireOp::kWrite, 2, base(), 64) +
                       std::string(64, 'y'),
                   kT0, chunk));
    EXPECT_TRUE(s.proven());
    auto r = Responses(Drain(s, kT0));
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r[0].status, WireStatus::kOk);
    EXPECT_EQ(mem_[0], 'y');
    std::fill(mem_.begin(), mem_.begin() + 64, 0x5a);
  }
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(mem_[i], 0x5a) << i;
}

// Without a token neither a CHALLENGE is sent nor a PROOF taken.
TEST_F(ServerSessionTest, WithoutATokenAProofIsAProtocolError) {
  ServerSession s(&registry_, limits_, kIncarnation, kT0);
  EXPECT_FALSE(s.has_output());
  uint8_t challenge[kResponseHeaderBytes] = {};
  uint8_t p[kRequestHeaderBytes + kProofBytes];
  EncodeProof("cluster-token-0123456789", challenge, p);
  EXPECT_STATUS(
      Feed(s, std::string(reinterpret_cast<char*>(p), sizeof(p)), kT0),
      absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace ferry::tcp
