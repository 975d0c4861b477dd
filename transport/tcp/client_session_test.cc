// ClientSession alone: slices in, request bytes out, response bytes in.
#include "transport/tcp/client_session.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

class ClientSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    descriptor::SegmentDescriptor d;
    d.set_name("target");
    auto* t = d.add_transports();
    t->set_transport("tcp");
    t->set_address("127.0.0.1:1");
    auto* b = d.add_buffers();
    b->set_addr(1 << 20);
    b->set_length(1 << 20);
    view_ = *SegmentView::Create(d);
  }

  Slice MakeSlice(OpCode op, void* local, size_t len,
                  absl::Time deadline = kT0 + absl::Seconds(10)) {
    Slice s;
    s.op = op;
    s.local = local;
    s.remote = (1 << 20) + 64;
    s.length = len;
    s.target = view_.get();
    s.deadline = deadline;
    return s;
  }

  // Sends everything the session has; returns the request headers (and
  // payloads) as bytes.
  static std::string SendAll(ClientSession& s, size_t chunk = 1 << 20) {
    std::string out;
    while (s.has_output()) {
      iovec iov[8];
      const int n = s.PrepareOutput(iov, 8);
      size_t taken = 0;
      for (int i = 0; i < n && taken < chunk; ++i) {
        const size_t k = std::min(iov[i].iov_len, chunk - taken);
        out.append(static_cast<char*>(iov[i].iov_base), k);
        taken += k;
      }
      s.OnSent(taken);
    }
    return out;
  }

  static std::vector<RequestHeader> Requests(const std::string& bytes) {
    std::vector<RequestHeader> r;
    size_t off = 0;
    while (off < bytes.size()) {
      RequestHeader h;
      EXPECT_OK(DecodeRequest(
          reinterpret_cast<const uint8_t*>(bytes.data()) + off, &h));
      r.push_back(h);
      off += kRequestHeaderBytes + (h.op == WireOp::kWrite ? h.length : 0);
    }
    return r;
  }

  static std::string Response(WireOp op, WireStatus st, uint64_t id,
                              uint64_t len) {
    uint8_t h[kResponseHeaderBytes];
    EncodeResponse({op, st, id, len}, h);
    return std::string(reinterpret_cast<char*>(h), sizeof(h));
  }

  static absl::Status Receive(ClientSession& s, const std::string& bytes,
                              std::vector<ClientSession::Done>* done,
                              size_t chunk = 1 << 20) {
    size_t off = 0;
    while (off < bytes.size()) {
      auto [buf, len] = s.InputBuffer();
      const size_t n = std::min({len, chunk, bytes.size() - off});
      std::memcpy(buf, bytes.data() + off, n);
      off += n;
      if (absl::Status st = s.OnReceived(n, done); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

  std::shared_ptr<const SegmentView> view_;
};

TEST_F(ClientSessionTest, RequestsGoOutAndAnswersComeBackInOrder) {
  for (size_t chunk : {1u, 5u, 24u, 100u, 1u << 20}) {
    ClientSession s("127.0.0.1:1");
    std::string src(3000, 'w');
    std::vector<char> dst(2000);
    Slice w = MakeSlice(OpCode::kWrite, src.data(), src.size());
    Slice r = MakeSlice(OpCode::kRead, dst.data(), dst.size());
    s.Add(&w);
    s.Add(&r);
    EXPECT_EQ(s.load_bytes(), 5000u);
    const std::string out = SendAll(s, chunk);
    auto reqs = Requests(out);
    ASSERT_EQ(reqs.size(), 2u);
    EXPECT_EQ(reqs[0].op, WireOp::kWrite);
    EXPECT_EQ(out.substr(kRequestHeaderBytes, 3000), src);
    EXPECT_EQ(reqs[1].op, WireOp::kRead);
    std::vector<ClientSession::Done> done;
    const std::string data(2000, 'r');
    ASSERT_OK(Receive(
        s,
        Response(WireOp::kWriteAck, WireStatus::kOk, reqs[0].request_id, 0) +
            Response(WireOp::kReadData, WireStatus::kOk, reqs[1].request_id,
                     2000) +
            data,
        &done, chunk));
    ASSERT_EQ(done.size(), 2u);
    EXPECT_EQ(done[0].slice, &w);
    EXPECT_OK(done[0].status);
    EXPECT_EQ(done[1].slice, &r);
    EXPECT_OK(done[1].status);
    EXPECT_EQ(std::string(dst.begin(), dst.end()), data);
    EXPECT_TRUE(s.empty());
    EXPECT_EQ(s.load_bytes(), 0u);
  }
}

TEST_F(ClientSessionTest, RejectedRangeIsInvalidArgument) {
  ClientSession s("127.0.0.1:1");
  char buf[8];
  Slice r = MakeSlice(OpCode::kRead, buf, 8);
  s.Add(&r);
  auto reqs = Requests(SendAll(s));
  std::vector<ClientSession::Done> done;
  ASSERT_OK(Receive(s,
                    Response(WireOp::kReadData, WireStatus::kOutOfBounds,
                             reqs[0].request_id, 0),
                    &done));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_STATUS(done[0].status, absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientSessionTest, ProtocolViolationsAreDataLoss) {
  char buf[8];
  struct Case {
    const char* name;
    WireOp op;
    uint64_t id_delta;
    uint64_t len;
  };
  for (const Case& c : {Case{"wrong id", WireOp::kReadData, 1, 8},
                        Case{"wrong op", WireOp::kWriteAck, 0, 0},
                        Case{"wrong length", WireOp::kReadData, 0, 7}}) {
    ClientSession s("127.0.0.1:1");
    Slice r = MakeSlice(OpCode::kRead, buf, 8);
    s.Add(&r);
    auto reqs = Requests(SendAll(s));
    std::vector<ClientSession::Done> done;
    EXPECT_STATUS(Receive(s,
                          Response(c.op, WireStatus::kOk,
                                   reqs[0].request_id + c.id_delta, c.len),
                          &done),
                  absl::StatusCode::kDataLoss)
        << c.name;
    EXPECT_TRUE(done.empty()) << c.name;
    s.Abort(absl::UnavailableError("x"), kT0, nullptr, &done);
  }
  // An answer nobody asked for.
  ClientSession s("127.0.0.1:1");
  std::vector<ClientSession::Done> done;
  EXPECT_STATUS(
      Receive(s, Response(WireOp::kWriteAck, WireStatus::kOk, 1, 0), &done),
      absl::StatusCode::kDataLoss);
  // A request being sent is not answerable yet.
  std::string src(100, 'x');
  Slice w = MakeSlice(OpCode::kWrite, src.data(), src.size());
  ClientSession s2("127.0.0.1:1");
  s2.Add(&w);
  s2.OnSent(40);
  EXPECT_STATUS(
      Receive(s2, Response(WireOp::kWriteAck, WireStatus::kOk, 1, 0), &done),
      absl::StatusCode::kDataLoss);
  s2.Abort(absl::UnavailableError("x"), kT0, nullptr, &done);
}

TEST_F(ClientSessionTest, ExpireDropsUnsentAndFlagsLateOnTheWire) {
  char buf[8];
  ClientSession s("127.0.0.1:1");
  Slice early = MakeSlice(OpCode::kRead, buf, 8, kT0 + absl::Seconds(1));
  Slice late = MakeSlice(OpCode::kRead, buf, 8, kT0 + absl::Seconds(5));
  s.Add(&early);
  s.Add(&late);
  std::vector<ClientSession::Done> done;
  // Nothing sent: the late one just leaves.
  EXPECT_FALSE(s.Expire(kT0 + absl::Seconds(2), &done));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].slice, &early);
  EXPECT_STATUS(done[0].status, absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.size(), 1u);
  // On the wire (awaiting its answer): the connection must go.
  SendAll(s);
  done.clear();
  EXPECT_FALSE(s.Expire(kT0 + absl::Seconds(4), &done));
  EXPECT_TRUE(s.Expire(kT0 + absl::Seconds(6), &done));
  EXPECT_TRUE(done.empty());
  s.Abort(absl::UnavailableError("closed"), kT0 + absl::Seconds(6), nullptr,
          &done);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_STATUS(done[0].status, absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ClientSessionTest, AbortRetriesOnlyWhatNeverReachedTheWire) {
  std::string src(100, 'x');
  ClientSession s("127.0.0.1:1");
  Slice sent = MakeSlice(OpCode::kWrite, src.data(), src.size());
  Slice partial = MakeSlice(OpCode::kWrite, src.data(), src.size());
  Slice unsent = MakeSlice(OpCode::kWrite, src.data(), src.size());
  s.Add(&sent);
  s.Add(&partial);
  s.Add(&unsent);
  s.OnSent(kRequestHeaderBytes + 100 + 10);  // `partial` is 10 bytes out.
  std::vector<Slice*> retry;
  std::vector<ClientSession::Done> done;
  s.Abort(absl::UnavailableError("lost"), kT0, &retry, &done);
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(retry[0], &unsent);
  ASSERT_EQ(done.size(), 2u);
  for (const auto& d : done) {
    EXPECT_STATUS(d.status, absl::StatusCode::kUnavailable);
  }
  EXPECT_TRUE(s.empty());
}

// Under a token the session sends nothing until the target's CHALLENGE,
// then the PROOF of the token before the first request; a target that
// opens with anything else, or a CHALLENGE to a session with no token,
// ends the session with a status that says which.
TEST_F(ClientSessionTest, UnderATokenTheProofGoesFirst) {
  constexpr char kToken[] = "cluster-token-0123456789";
  uint8_t challenge[kResponseHeaderBytes];
  EncodeChallenge(challenge);
  const std::string challenge_bytes(reinterpret_cast<char*>(challenge),
                                    sizeof(challenge));
  for (size_t chunk : {1u, 5u, 24u, 1u << 20}) {
    ClientSession s("127.0.0.1:1", kToken);
    std::string src(100, 'w');
    Slice w = MakeSlice(OpCode::kWrite, src.data(), src.size());
    s.Add(&w);
    EXPECT_TRUE(s.awaiting_challenge());
    EXPECT_FALSE(s.has_output()) << "sent before the challenge";
    std::vector<ClientSession::Done> done;
    ASSERT_OK(Receive(s, challenge_bytes, &done, chunk));
    EXPECT_FALSE(s.awaiting_challenge());
    const std::string out = SendAll(s, chunk);
    EXPECT_TRUE(s.proof_sent());
    ASSERT_GE(out.size(), kRequestHeaderBytes + kProofBytes);
    EXPECT_TRUE(ProofMatches(kToken, challenge,
                             reinterpret_cast<const uint8_t*>(out.data())));
    EXPECT_FALSE(ProofMatches("another-token-0123456789", challenge,
                              reinterpret_cast<const uint8_t*>(out.data())));
    auto reqs = Requests(out.substr(kRequestHeaderBytes + kProofBytes));
    ASSERT_EQ(reqs.size(), 1u);
    EXPECT_EQ(reqs[0].op, WireOp::kWrite);
    ASSERT_OK(Receive(
        s, Response(WireOp::kWriteAck, WireStatus::kOk, reqs[0].request_id, 0),
        &done));
    ASSERT_EQ(done.size(), 1u);
    EXPECT_OK(done[0].status);
  }
  {
    ClientSession s("127.0.0.1:1", kToken);
    std::vector<ClientSession::Done> done;
    EXPECT_STATUS(
        Receive(s, Response(WireOp::kWriteAck, WireStatus::kOk, 1, 0), &done),
        absl::StatusCode::kFailedPrecondition);
  }
  {
    ClientSession s("127.0.0.1:1");
    std::vector<ClientSession::Done> done;
    EXPECT_STATUS(Receive(s, challenge_bytes, &done),
                  absl::StatusCode::kPermissionDenied);
  }
}

}  // namespace
}  // namespace ferry::tcp
