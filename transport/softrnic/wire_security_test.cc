// What a stranger on the network can do to softrnic's listener: take over
// or join a connected QP, tell existing QPs from missing ones, guess QP
// numbers or keys, or, under a cluster token, open any connection at all.
// Devices: softrnic0 on 127.0.0.1 and softrnic1 on 127.0.0.2
// (softrnic_test_main); strangers connect from 127.0.0.3.
//
// Four targets run this file: wire_security_test (no token; Token*,
// Runtime* and *HandshakeTimeout* tests filtered out), wire_token_test
// (FERRY_AUTH_TOKEN set; Token* only), wire_runtime_token_test (Runtime*
// only: it sets the process's token) and wire_handshake_timeout_test
// (*HandshakeTimeout* only: a short handshake timeout and a small cap per
// address, read once per process).
#include <arpa/inet.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/softrnic/softrnic_control.h"
#include "transport/softrnic/verbs_test_util.h"

namespace softrnic_test {
namespace {

constexpr char kDevName[2][10] = {"softrnic0", "softrnic1"};
constexpr char kStranger[] = "127.0.0.3";
constexpr uint8_t kHello = 1, kHelloAck = 2, kChallenge = 3, kNak = 21;
constexpr uint32_t kNoQp = 5;
constexpr int kWaitMs = 5000;

uint32_t Be32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 |
         p[3];
}

class WireSecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    signal(SIGPIPE, SIG_IGN);
    for (int i = 0; i < 2; ++i) {
      std::string err;
      ctx_[i] = OpenDeviceByName(kDevName[i], &err);
      ASSERT_NE(ctx_[i], nullptr) << err;
    }
  }
  void TearDown() override {
    endpoints_.clear();
    for (int fd : fds_) close(fd);
    for (ibv_context* c : ctx_) {
      if (c != nullptr) ibv_close_device(c);
    }
  }

  Endpoint* NewEndpoint(int dev) {
    std::string err;
    auto e = Endpoint::Create(ctx_[dev], EndpointOptions(), &err);
    EXPECT_NE(e, nullptr) << err;
    if (e == nullptr) return nullptr;
    endpoints_.push_back(std::move(e));
    return endpoints_.back().get();
  }

  // a on softrnic1 connected to b on softrnic0, both ways.
  void Connected(Endpoint** a, Endpoint** b) {
    *a = NewEndpoint(1);
    *b = NewEndpoint(0);
    ASSERT_NE(*a, nullptr);
    ASSERT_NE(*b, nullptr);
    std::string err;
    ASSERT_EQ(ConnectQp((*a)->qp(), (*b)->qpn(), (*b)->gid(), {}, &err), 0)
        << err;
    ASSERT_EQ(ConnectQp((*b)->qp(), (*a)->qpn(), (*a)->gid(), {}, &err), 0)
        << err;
  }

  // A connection from `from` to `to`'s device listener.
  int Dial(const std::string& from, const Endpoint* to) {
    std::string err;
    const int fd =
        ConnectFrom(from, GidIpv4(to->gid()), GidPort(to->gid()), &err);
    EXPECT_GE(fd, 0) << err;
    if (fd >= 0) fds_.push_back(fd);
    return fd;
  }

  // The next 40-byte frame on `fd` within `ms`, or an empty vector.
  static std::vector<uint8_t> NextFrame(int fd, int ms = kWaitMs) {
    std::vector<uint8_t> f(40);
    size_t got = 0;
    const auto end = Clock::now() + std::chrono::milliseconds(ms);
    while (got < f.size()) {
      pollfd p{fd, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            end - Clock::now())
                            .count();
      if (left <= 0 || poll(&p, 1, static_cast<int>(left)) != 1) return {};
      const ssize_t n = recv(fd, f.data() + got, f.size() - got, 0);
      if (n <= 0) return {};
      got += static_cast<size_t>(n);
    }
    return f;
  }

  static bool SendAll(int fd, const std::vector<uint8_t>& v) {
    return send(fd, v.data(), v.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(v.size());
  }

  // Sends a HELLO for `qpn` from requester QP `aux` (and `proof`, if any)
  // and returns the answer: a HELLO_ACK, a NAK, or nothing.
  std::vector<uint8_t> Hello(int fd, uint32_t qpn, uint32_t aux,
                             const std::vector<uint8_t>& proof = {},
                             int ms = kWaitMs) {
    std::vector<uint8_t> h =
        Header(1, kHello, qpn, static_cast<uint32_t>(proof.size()), 0, 0, aux);
    h.insert(h.end(), proof.begin(), proof.end());
    EXPECT_TRUE(SendAll(fd, h));
    return NextFrame(fd, ms);
  }

  static void ExpectRefused(const std::vector<uint8_t>& answer, int fd,
                            const char* why) {
    ASSERT_EQ(answer.size(), 40u) << why << ": no answer";
    EXPECT_EQ(answer[5], kNak) << why;
    EXPECT_EQ(Be32(&answer[12]), 0u) << why << ": msn";
    EXPECT_EQ(Be32(&answer[36]), kNoQp) << why << ": NAK code";
    EXPECT_TRUE(ClosedByPeer(fd, kWaitMs)) << why << ": left open";
  }

  // WRITEs 8 bytes of `seed`'s pattern through raw connection `fd` into
  // `dst` (on the QP the HELLO named) and waits for them to land.
  static void WriteThrough(int fd, uint32_t qpn, Buffer* dst, uint32_t seed) {
    std::vector<uint8_t> w =
        Header(1, /*WRITE*/ 12, qpn, 8, dst->rkey(), dst->addr(), 0);
    std::vector<uint8_t> payload(8);
    FillPattern(payload.data(), payload.size(), seed);
    w.insert(w.end(), payload.begin(), payload.end());
    ASSERT_TRUE(SendAll(fd, w));
    const auto end = Clock::now() + std::chrono::milliseconds(kWaitMs);
    while (FirstPatternMismatch(dst->data(), 8, seed) != -1 &&
           Clock::now() < end) {
      usleep(1000);
    }
    EXPECT_EQ(FirstPatternMismatch(dst->data(), 8, seed), -1)
        << "the WRITE did not land";
  }

  ibv_context* ctx_[2] = {};
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::vector<int> fds_;
};

// rxe's check_addr: a connected QP's requests come from its peer QP at its
// peer's address, so a HELLO from anywhere else cannot take the QP over.
// The same HELLO from the peer's address is taken: the address decides.
TEST_F(WireSecurityTest, AConnectedQpTakesAHelloFromItsPeersAddressOnly) {
  Endpoint *a, *b;
  ASSERT_NO_FATAL_FAILURE(Connected(&a, &b));
  Buffer* dst = b->Reg(4096);
  ASSERT_NE(dst, nullptr);

  int fd = Dial(kStranger, b);
  ASSERT_GE(fd, 0);
  ASSERT_NO_FATAL_FAILURE(
      ExpectRefused(Hello(fd, b->qpn(), a->qpn()), fd, "stranger"));

  fd = Dial(GidIpv4(a->gid()), b);
  ASSERT_GE(fd, 0);
  ASSERT_NO_FATAL_FAILURE(ExpectRefused(Hello(fd, b->qpn(), a->qpn() ^ 1), fd,
                                        "peer's address, another QP"));

  fd = Dial(GidIpv4(a->gid()), b);
  ASSERT_GE(fd, 0);
  const std::vector<uint8_t> ack = Hello(fd, b->qpn(), a->qpn());
  ASSERT_EQ(ack.size(), 40u);
  EXPECT_EQ(ack[5], kHelloAck);
  WriteThrough(fd, b->qpn(), dst, 7);
}

// A stranger learns nothing from the answer: a missing QP, a QP connected
// to someone else and a QP in the error state all answer the same NAK.
TEST_F(WireSecurityTest, EveryRefusalLooksAlike) {
  Endpoint *a, *b;
  ASSERT_NO_FATAL_FAILURE(Connected(&a, &b));
  Endpoint* broken = NewEndpoint(0);
  ASSERT_NE(broken, nullptr);
  std::string err;
  ASSERT_EQ(ConnectQp(broken->qp(), a->qpn(), a->gid(), {}, &err), 0) << err;
  ASSERT_EQ(ModifyToState(broken->qp(), IBV_QPS_ERR), 0);

  struct Case {
    const char* what;
    uint32_t qpn;
  };
  uint32_t missing = (b->qpn() + 1) & 0xffffff;
  while (missing == a->qpn() || missing == broken->qpn() || missing < 2) {
    missing = (missing + 1) & 0xffffff;
  }
  std::vector<std::vector<uint8_t>> answers;
  for (const Case& c :
       {Case{"missing QP", missing}, Case{"connected to another", b->qpn()},
        Case{"in the error state", broken->qpn()}}) {
    const int fd = Dial(kStranger, b);
    ASSERT_GE(fd, 0);
    std::vector<uint8_t> answer = Hello(fd, c.qpn, a->qpn());
    ASSERT_NO_FATAL_FAILURE(ExpectRefused(answer, fd, c.what));
    std::fill(answer.begin() + 8, answer.begin() + 12, 0);  // The echoed qpn.
    answers.push_back(answer);
  }
  EXPECT_EQ(answers[0], answers[1]);
  EXPECT_EQ(answers[0], answers[2]);
}

// Peers move their QPs to RTR in either order: a HELLO for a QP still in
// RESET or INIT waits, unanswered, and is taken once the QP's peer is
// known to be the HELLO's -- or refused, if it is not.
TEST_F(WireSecurityTest, AHelloWaitsForItsQpToBeReady) {
  Endpoint* c = NewEndpoint(0);  // RESET.
  Endpoint* peer = NewEndpoint(1);
  ASSERT_NE(c, nullptr);
  ASSERT_NE(peer, nullptr);
  Buffer* dst = c->Reg(4096);
  ASSERT_NE(dst, nullptr);
  const int from_peer = Dial(GidIpv4(peer->gid()), c);
  const int from_stranger = Dial(kStranger, c);
  ASSERT_GE(from_peer, 0);
  ASSERT_GE(from_stranger, 0);
  EXPECT_TRUE(Hello(from_peer, c->qpn(), peer->qpn(), {}, 200).empty())
      << "answered before the QP was ready";
  EXPECT_TRUE(Hello(from_stranger, c->qpn(), peer->qpn(), {}, 200).empty())
      << "answered before the QP was ready";

  std::string err;
  ASSERT_EQ(ConnectQp(c->qp(), peer->qpn(), peer->gid(), {}, &err), 0) << err;
  const std::vector<uint8_t> ack = NextFrame(from_peer);
  ASSERT_EQ(ack.size(), 40u) << "the held HELLO was never taken";
  EXPECT_EQ(ack[5], kHelloAck);
  WriteThrough(from_peer, c->qpn(), dst, 9);
  ASSERT_NO_FATAL_FAILURE(
      ExpectRefused(NextFrame(from_stranger), from_stranger, "held stranger"));
}

// QP numbers and keys are drawn, not counted: knowing some tells nothing
// of the others. Counted ones differ by 1 (QPs) or 256 (keys); drawn ones
// come this close to each other with odds of about 1 in 2,000 (QPs) and
// 1 in 30,000 (keys) per pair.
TEST_F(WireSecurityTest, QpNumbersAndKeysAreNotCounted) {
  std::vector<uint32_t> qpns, keys;
  Endpoint* e = nullptr;
  for (int i = 0; i < 32; ++i) {
    e = NewEndpoint(i % 2);
    ASSERT_NE(e, nullptr);
    qpns.push_back(e->qpn());
  }
  for (int i = 0; i < 64; ++i) {
    Buffer* buf = e->Reg(4096);
    ASSERT_NE(buf, nullptr);
    keys.push_back(buf->rkey());
    EXPECT_EQ(buf->lkey(), buf->rkey());
  }
  auto close_pairs = [](const std::vector<uint32_t>& v, uint32_t within) {
    int n = 0;
    for (size_t i = 1; i < v.size(); ++i) {
      const uint32_t d = v[i] > v[i - 1] ? v[i] - v[i - 1] : v[i - 1] - v[i];
      if (d < within) ++n;
    }
    return n;
  };
  EXPECT_LE(close_pairs(qpns, 4096), 1);
  EXPECT_LE(close_pairs(keys, 1 << 16), 1);
  for (uint32_t q : qpns) {
    EXPECT_GE(q, 2u);
    EXPECT_LE(q, 0xffffffu);
  }
}

// ---- Under a cluster token (wire_token_test) ---------------------------

std::string Token() {
  const char* t = std::getenv("FERRY_AUTH_TOKEN");
  return t != nullptr ? t : "";
}

// The proof as docs/softrnic.md specifies it, computed here independently
// of softrnic's code: HMAC-SHA256 under the token of the label (with its
// NUL), the CHALLENGE's 40 bytes and the HELLO header's 40 bytes.
std::vector<uint8_t> Proof(const std::string& token,
                           const std::vector<uint8_t>& challenge,
                           const std::vector<uint8_t>& hello_header) {
  static constexpr char kLabel[] = "ferry softrnic hello v1";
  std::vector<uint8_t> msg(kLabel, kLabel + sizeof(kLabel));
  msg.insert(msg.end(), challenge.begin(), challenge.end());
  msg.insert(msg.end(), hello_header.begin(), hello_header.end());
  std::vector<uint8_t> out(32);
  unsigned int len = 32;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), msg.data(),
       msg.size(), out.data(), &len);
  return out;
}

TEST_F(WireSecurityTest, TokenListenerTakesOnlyAProvenHello) {
  ASSERT_GE(Token().size(), 16u) << "run as wire_token_test";
  Endpoint *a, *b;
  ASSERT_NO_FATAL_FAILURE(Connected(&a, &b));
  Buffer* dst = b->Reg(4096);
  ASSERT_NE(dst, nullptr);
  const std::string from = GidIpv4(a->gid());
  std::vector<uint8_t> header = Header(1, kHello, b->qpn(), 32, 0, 0, a->qpn());

  // No proof at all: what a peer without the token sends.
  int fd = Dial(from, b);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> challenge = NextFrame(fd);
  ASSERT_EQ(challenge.size(), 40u) << "no CHALLENGE";
  EXPECT_EQ(challenge[5], kChallenge);
  ASSERT_NO_FATAL_FAILURE(
      ExpectRefused(Hello(fd, b->qpn(), a->qpn()), fd, "no proof"));

  // A proof under another token.
  fd = Dial(from, b);
  ASSERT_GE(fd, 0);
  challenge = NextFrame(fd);
  ASSERT_EQ(challenge.size(), 40u);
  ASSERT_NO_FATAL_FAILURE(
      ExpectRefused(Hello(fd, b->qpn(), a->qpn(),
                          Proof("another-token-of-16+", challenge, header)),
                    fd, "another token"));

  // The right proof for an earlier challenge (a replay).
  const std::vector<uint8_t> old_proof = Proof(Token(), challenge, header);
  fd = Dial(from, b);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> fresh = NextFrame(fd);
  ASSERT_EQ(fresh.size(), 40u);
  EXPECT_NE(fresh, challenge) << "two challenges alike";
  ASSERT_NO_FATAL_FAILURE(
      ExpectRefused(Hello(fd, b->qpn(), a->qpn(), old_proof), fd, "replay"));

  // The right proof: taken, and a WRITE through it lands.
  fd = Dial(from, b);
  ASSERT_GE(fd, 0);
  challenge = NextFrame(fd);
  ASSERT_EQ(challenge.size(), 40u);
  const std::vector<uint8_t> ack =
      Hello(fd, b->qpn(), a->qpn(), Proof(Token(), challenge, header));
  ASSERT_EQ(ack.size(), 40u);
  EXPECT_EQ(ack[5], kHelloAck);
  WriteThrough(fd, b->qpn(), dst, 11);
}

// An engine given its token in EngineOptions (not the environment) hands
// it to softrnic at run time (softrnic_set_cluster_token): from then on
// the listeners challenge, and the token is never replaced by another.
TEST_F(WireSecurityTest, RuntimeTokenIsTakenOnceAndChallenged) {
  ASSERT_TRUE(Token().empty()) << "run as wire_runtime_token_test";
  constexpr char kRuntime[] = "runtime-token-0123456789";
  ASSERT_EQ(softrnic::SetClusterToken("short"), -1);
  EXPECT_EQ(errno, EINVAL);
  ASSERT_EQ(softrnic::SetClusterToken(kRuntime), 0) << strerror(errno);
  EXPECT_EQ(softrnic::SetClusterToken(kRuntime), 0) << "the same again";
  ASSERT_EQ(softrnic::SetClusterToken("another-token-0123456789"), -1);
  EXPECT_EQ(errno, EEXIST);
  Endpoint *a, *b;
  ASSERT_NO_FATAL_FAILURE(Connected(&a, &b));
  const std::string from = GidIpv4(a->gid());
  int fd = Dial(from, b);
  ASSERT_GE(fd, 0);
  const std::vector<uint8_t> challenge = NextFrame(fd);
  ASSERT_EQ(challenge.size(), 40u) << "no CHALLENGE after the token was set";
  EXPECT_EQ(challenge[5], kChallenge);
  const std::vector<uint8_t> header =
      Header(1, kHello, b->qpn(), 32, 0, 0, a->qpn());
  const std::vector<uint8_t> ack =
      Hello(fd, b->qpn(), a->qpn(), Proof(kRuntime, challenge, header));
  ASSERT_EQ(ack.size(), 40u);
  EXPECT_EQ(ack[5], kHelloAck);
}

// ---- Under a short handshake timeout (wire_handshake_timeout_test) ------

// The limits wire_handshake_timeout_test sets: softrnic reads them once per
// process, so the target that sets them runs only this test.
constexpr char kTimeoutVar[] = "FERRY_SOFTRNIC_HANDSHAKE_TIMEOUT_MS";
constexpr char kPerAddressVar[] = "FERRY_SOFTRNIC_MAX_CONNECTIONS_PER_ADDRESS";
constexpr int kPerAddress = 2;

// A HELLO held for a QP that never leaves INIT gets nothing until the
// handshake timeout, then the NAK every refusal gets, and is closed; its
// admission slot comes back. Two held at once expire each on its own.
TEST_F(WireSecurityTest, HeldHellosAreAnsweredAndClosedAtTheHandshakeTimeout) {
  const char* timeout_text = std::getenv(kTimeoutVar);
  const char* per_address = std::getenv(kPerAddressVar);
  ASSERT_NE(timeout_text, nullptr) << "run as wire_handshake_timeout_test";
  ASSERT_NE(per_address, nullptr) << "run as wire_handshake_timeout_test";
  ASSERT_EQ(std::atoi(per_address), kPerAddress);
  const int timeout_ms = std::atoi(timeout_text);
  // Long enough that the steps before the first deadline fit in it, short
  // enough that the test waits little.
  ASSERT_GE(timeout_ms, 200);
  ASSERT_LE(timeout_ms, 2000);
  const int quiet_ms = timeout_ms / 10;

  Endpoint* c = NewEndpoint(0);
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(ModifyToInit(c->qp(), ConnectOptions()), 0);
  const uint32_t aux = 0x123456;  // c never reaches RTR: never looked at.
  const uint32_t missing = c->qpn() ^ 1;  // c is the process's only QP.

  // The stranger's two slots, both held.
  const Clock::time_point start = Clock::now();
  const int first = Dial(kStranger, c);
  ASSERT_GE(first, 0);
  EXPECT_TRUE(Hello(first, c->qpn(), aux, {}, quiet_ms).empty())
      << "answered before the timeout";
  const int second = Dial(kStranger, c);
  ASSERT_GE(second, 0);
  EXPECT_TRUE(Hello(second, c->qpn(), aux, {}, quiet_ms).empty())
      << "answered before the timeout";
  // Over the cap while they are held: reset, so a HELLO that an admitted
  // connection would have had refused at once gets no answer.
  const int over = Dial(kStranger, c);
  ASSERT_GE(over, 0);
  (void)SendAll(over, Header(1, kHello, missing, 0, 0, 0, aux));
  EXPECT_TRUE(NextFrame(over).empty()) << "admitted over the cap";

  // The deadline counts from the accept, which follows `start`.
  const std::vector<uint8_t> nak = NextFrame(first);
  const int64_t waited_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() -
                                                            start)
          .count();
  EXPECT_GE(waited_ms, timeout_ms) << "refused before the timeout";
  ASSERT_NO_FATAL_FAILURE(ExpectRefused(nak, first, "held, first"));
  EXPECT_EQ(Be32(&nak[8]), c->qpn());
  ASSERT_NO_FATAL_FAILURE(
      ExpectRefused(NextFrame(second), second, "held, second"));

  // Both slots are back: a new connection is admitted (and its HELLO for
  // a missing QP refused at once, with the same NAK).
  const int after = Dial(kStranger, c);
  ASSERT_GE(after, 0);
  const std::vector<uint8_t> refused = Hello(after, missing, aux);
  ASSERT_NO_FATAL_FAILURE(ExpectRefused(refused, after, "slot given back"));
  std::vector<uint8_t> a = nak, b = refused;
  std::fill(a.begin() + 8, a.begin() + 12, 0);  // The echoed qpn.
  std::fill(b.begin() + 8, b.begin() + 12, 0);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace softrnic_test
