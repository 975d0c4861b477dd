// TcpTransport between two instances in one process, over real loopback
// sockets, plus hostile peers speaking raw bytes.
#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "common/mutex.h"
#include "common/simulated_clock.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "testing/process_usage.h"
#include "transport/tcp/tcp_test_util.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

using ::ferry::tcp::testing::ConnectFrom;
using ::ferry::tcp::testing::RecordingSink;
using ::ferry::tcp::testing::Served;

// A transport with `opts`, installed in `env`; *ep is what it publishes.
absl::StatusOr<std::unique_ptr<TcpTransport>> Installed(
    const TransportOptions& opts, const TransportEnv& env,
    descriptor::TransportEndpoint* ep) {
  auto t = std::make_unique<TcpTransport>(opts);
  FERRY_RETURN_IF_ERROR(t->Install(env, ep));
  return t;
}

// A transport with `opts`, installed as segment `name` on 127.0.0.1.
absl::StatusOr<std::unique_ptr<TcpTransport>> Installed(
    const TransportOptions& opts, const std::string& name,
    Clock* clock = RealClock()) {
  TransportEnv env;
  env.local_segment = name;
  env.listen_host = "127.0.0.1";
  env.clock = clock;
  descriptor::TransportEndpoint ep;
  return Installed(opts, env, &ep);
}

// Registers `length` bytes at `addr` on `t`, open to peers; returns what
// `t` publishes of them.
absl::StatusOr<descriptor::Buffer> RegisterShared(TcpTransport& t,
                                                  uint64_t addr,
                                                  size_t length) {
  MemoryRegion r;
  r.addr = addr;
  r.length = length;
  r.remote_accessible = true;
  descriptor::Buffer published;
  FERRY_RETURN_IF_ERROR(t.RegisterMemory(r, &published).status());
  return published;
}

// A loopback port nothing listens on any more: connects to it are refused.
uint16_t RefusingPort() {
  uint16_t port = 0;
  { auto l = ListenTcp("127.0.0.1", 0, &port); }
  return port;
}

// Options the transport cannot honour fail Install with InvalidArgument:
// an infinite frame timeout made UnregisterMemory wait for ever.
TEST(TcpTransportOptionsTest, RejectsWhatItCannotHonour) {
  auto install = [](auto change) {
    TransportOptions o;
    change(o);
    return Installed(o, "x").status();
  };
  EXPECT_OK(install([](TransportOptions&) {}));
  EXPECT_STATUS(install([](TransportOptions& o) {
                  o.tcp.frame_timeout = absl::InfiniteDuration();
                }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(install([](TransportOptions& o) {
                  o.tcp.idle_timeout = absl::ZeroDuration();
                }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(install([](TransportOptions& o) {
                  o.tcp.handshake_timeout = absl::Hours(2);
                }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(install([](TransportOptions& o) { o.tcp.io_threads = 0; }),
                absl::StatusCode::kInvalidArgument);
}

class TcpTransportTest : public ::testing::Test {
 protected:
  void SetUp() override { InstallPair("", ""); }

  // The target and the initiator, with these cluster tokens ("": none).
  void InstallPair(const std::string& target_token,
                   const std::string& initiator_token,
                   TransportOptions opts = TransportOptions()) {
    target_ = std::make_unique<TcpTransport>(opts);
    initiator_ = std::make_unique<TcpTransport>(opts);
    TransportEnv env;
    env.local_segment = "t";
    env.listen_host = "127.0.0.1";
    env.incarnation = kIncarnation;
    env.clock = clock_;
    env.auth_token = target_token;
    descriptor::TransportEndpoint ep;
    ASSERT_OK(target_->Install(env, &ep));
    env.auth_token = initiator_token;
    descriptor::TransportEndpoint ep2;
    ASSERT_OK(initiator_->Install(env, &ep2));
    target_buf_.assign(1 << 20, 0);
    ASSERT_OK_AND_ASSIGN(
        descriptor::Buffer published,
        RegisterShared(*target_, Remote(0), target_buf_.size()));
    key_ = published.tcp_key();
    ASSERT_NE(key_, 0u);
    descriptor::SegmentDescriptor d;
    d.set_name("target");
    d.set_incarnation(kIncarnation);
    auto* t = d.add_transports();
    t->set_transport("tcp");
    t->set_address(ep.address());
    target_addr_ = ep.address();
    auto* b = d.add_buffers();
    b->set_addr(Remote(0));
    b->set_length(target_buf_.size());
    b->set_tcp_key(key_);
    view_ = *SegmentView::Create(d);
  }

  Slice MakeSlice(OpCode op, void* local, uint64_t remote, size_t len) {
    Slice s;
    s.op = op;
    s.local = local;
    s.remote = remote;
    s.length = len;
    s.target = view_.get();
    // As the engine places it: the descriptor's buffer that holds the
    // range (-1 for a range outside every buffer, sent with no key).
    s.remote_buffer = view_->FindBufferIndex(remote, len);
    s.deadline = clock_->Now() + absl::Seconds(10);
    s.sink = &sink_;
    return s;
  }

  // MakeSlice's slice, sent to `target` instead of view_: a variant of
  // view_ (another address, key or incarnation) that holds its buffers.
  Slice MakeSliceTo(const SegmentView* target, OpCode op, void* local,
                    uint64_t remote, size_t len) {
    Slice s = MakeSlice(op, local, remote, len);
    s.target = target;
    return s;
  }

  // An 8-byte READ of the target's first bytes into `buf`, sent to
  // `target` and due `due_in` from now on the transports' clock.
  Slice ReadSliceTo(const SegmentView* target, char* buf,
                    absl::Duration due_in) {
    Slice s = MakeSliceTo(target, OpCode::kRead, buf, Remote(0), 8);
    s.deadline = clock_->Now() + due_in;
    return s;
  }

  // A view of the target whose TCP endpoint is `port` on loopback.
  std::shared_ptr<const SegmentView> ViewWithPort(uint16_t port) {
    descriptor::SegmentDescriptor d = view_->descriptor();
    d.mutable_transports(0)->set_address("127.0.0.1:" + std::to_string(port));
    return *SegmentView::Create(d);
  }

  // A view of the target whose buffer has `key`, as published by the run
  // `incarnation`.
  std::shared_ptr<const SegmentView> ViewWithKey(
      uint64_t key, uint64_t incarnation = kIncarnation) {
    descriptor::SegmentDescriptor d = view_->descriptor();
    d.mutable_buffers(0)->set_tcp_key(key);
    d.set_incarnation(incarnation);
    return *SegmentView::Create(d);
  }

  // A second target of the same run, as segment `name`, listening on every
  // address (so reachable as any 127.x.y.z: a peer per address) and
  // sharing `length` bytes at `addr`.
  struct WildcardTarget {
    std::unique_ptr<TcpTransport> transport;
    uint64_t key = 0;  // Of the shared bytes.
    uint16_t port = 0;
  };
  absl::StatusOr<WildcardTarget> StartWildcardTarget(const std::string& name,
                                                     uint64_t addr,
                                                     size_t length) {
    TransportEnv env;
    env.local_segment = name;
    env.listen_host = "0.0.0.0";
    env.incarnation = kIncarnation;
    descriptor::TransportEndpoint ep;
    WildcardTarget t;
    FERRY_ASSIGN_OR_RETURN(t.transport,
                           Installed(TransportOptions(), env, &ep));
    FERRY_ASSIGN_OR_RETURN(descriptor::Buffer published,
                           RegisterShared(*t.transport, addr, length));
    t.key = published.tcp_key();
    FERRY_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(ep.address()));
    t.port = hp.port;
    return t;
  }

  // A loopback listener that never answers (the kernel accepts its
  // connections), and a view of the target whose TCP endpoint it is.
  struct SilentPeer {
    UniqueFd listener;
    std::shared_ptr<const SegmentView> view;
  };
  absl::StatusOr<SilentPeer> StartSilentPeer() {
    uint16_t port = 0;
    FERRY_ASSIGN_OR_RETURN(UniqueFd listener, ListenTcp("127.0.0.1", 0, &port));
    return SilentPeer{std::move(listener), ViewWithPort(port)};
  }

  // Submits one 8-byte READ to `view` and returns its completion status.
  absl::Status ReadOnce(const SegmentView* view, absl::Duration deadline,
                        bool shutdown_after_submit = false) {
    char buf[8];
    Slice s = ReadSliceTo(view, buf, deadline);
    initiator_->Submit({&s});
    if (shutdown_after_submit) initiator_->Shutdown();
    auto st = sink_.Wait(1);
    return st.size() == 1 ? st[0] : absl::InternalError("no completion");
  }

  uint64_t Remote(size_t off) {
    return reinterpret_cast<uint64_t>(target_buf_.data()) + off;
  }

  // Declared first, destroyed last: what the transports' threads may still
  // touch while they shut down (a server thread may still be in sendmsg on
  // the memory when a READ has already completed at the initiator; a
  // shutdown completes slices through the sink).
  static constexpr uint64_t kIncarnation = 0x7a9e7;
  // The transports' clock: RealClock, or sim_ in TcpTransportSimTest.
  SimulatedClock sim_;
  Clock* clock_ = RealClock();
  std::vector<uint8_t> target_buf_;
  uint64_t key_ = 0;  // Of target_buf_, as the target published it.
  std::shared_ptr<const SegmentView> view_;
  std::string target_addr_;
  RecordingSink sink_;
  std::unique_ptr<TcpTransport> target_, initiator_;
};

// True once `t` has started `n` connects, within 10 s of real time: a
// connect starts when its event loop runs, which a test cannot see, and
// its timeout counts from then on the clock.
template <typename T>
bool ConnectsStarted(T& t, uint64_t n) {
  return ::ferry::testing::WaitUntil(
      [&] { return t.Stats().connects_started == n; }, absl::Seconds(10));
}

// How often the initiator's loop checks deadlines (tcp_client.h).
constexpr absl::Duration kDeadlineTick = absl::Milliseconds(10);

// The same two transports on a SimulatedClock, for the tests of what is
// timed (deadlines, back-off): they move time themselves.
class TcpTransportSimTest : public TcpTransportTest {
 protected:
  TcpTransportSimTest() { clock_ = &sim_; }

  // Whether sink_ has no completion yet after the loops had time to act
  // on what is due (a negative check: a slow loop only makes it weaker).
  bool NothingCompleted() {
    return sink_.Wait(1, absl::Milliseconds(50)).empty();
  }

  // Moves the clock to `at`, where the one slice in flight must not have
  // ended yet (`too_soon` says what that would mean), then past the next
  // deadline check; returns sink_'s completions by then.
  std::vector<absl::Status> CompletionsAfter(absl::Time at,
                                             const char* too_soon) {
    sim_.AdvanceTo(at);
    EXPECT_TRUE(NothingCompleted()) << too_soon;
    sim_.Advance(kDeadlineTick);
    return sink_.Wait(1, absl::Seconds(10));
  }
};

TEST_F(TcpTransportTest, WriteThenRead) {
  std::vector<uint8_t> src(300000);
  std::iota(src.begin(), src.end(), 0);
  Slice w = MakeSlice(OpCode::kWrite, src.data(), Remote(1000), src.size());
  initiator_->Submit({&w});
  auto st = sink_.Wait(1);
  ASSERT_EQ(st.size(), 1u);
  ASSERT_OK(st[0]) << st[0];
  // Applied at the target when the WRITE completed.
  EXPECT_EQ(std::memcmp(target_buf_.data() + 1000, src.data(), src.size()), 0);
  std::vector<uint8_t> dst(src.size());
  Slice r = MakeSlice(OpCode::kRead, dst.data(), Remote(1000), dst.size());
  initiator_->Submit({&r});
  st = sink_.Wait(2);
  ASSERT_OK(st[1]) << st[1];
  EXPECT_EQ(dst, src);
}

TEST_F(TcpTransportTest, OutOfBoundsWriteFailsAndWritesNothing) {
  std::vector<uint8_t> src(4096, 0xab);
  // Last 100 bytes of the buffer plus 3996 beyond it.
  Slice w = MakeSlice(OpCode::kWrite, src.data(),
                      Remote(target_buf_.size() - 100), src.size());
  Slice ok = MakeSlice(OpCode::kWrite, src.data(), Remote(0), 16);
  initiator_->Submit({&w, &ok});
  auto st = sink_.Wait(2);
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kInvalidArgument) << st[0];
  EXPECT_OK(st[1]) << st[1];  // Same connection still works.
  for (size_t i = target_buf_.size() - 100; i < target_buf_.size(); ++i) {
    ASSERT_EQ(target_buf_[i], 0) << i;
  }
}

// Knowing an address is not enough: a raw peer that names the buffer's
// address and the target's incarnation, but not the buffer's key, reads
// and writes nothing; neither does a slice whose descriptor holds another
// key. Each refusal is counted; the connection goes on.
TEST_F(TcpTransportTest, AnAddressAloneReadsAndWritesNothing) {
  std::fill(target_buf_.begin(), target_buf_.begin() + 64, 0x5a);
  auto raw = ConnectFrom("127.0.0.1", target_addr_);
  ASSERT_OK(raw);
  EXPECT_FALSE(Served(raw->get(), Remote(0), /*key=*/0, kIncarnation));
  EXPECT_FALSE(Served(raw->get(), Remote(0), key_ ^ 1, kIncarnation));
  uint8_t hdr[kRequestHeaderBytes];
  EncodeRequest({WireOp::kWrite, 2, Remote(0), 64, key_ + 1, kIncarnation},
                hdr);
  ASSERT_OK(WriteFull(raw->get(), hdr, sizeof(hdr)));
  const std::vector<uint8_t> payload(64, 0xee);
  ASSERT_OK(WriteFull(raw->get(), payload.data(), payload.size()));
  uint8_t resp[kResponseHeaderBytes];
  ASSERT_OK(ReadFull(raw->get(), resp, sizeof(resp)));
  ResponseHeader h;
  ASSERT_OK(DecodeResponse(resp, &h));
  EXPECT_EQ(h.status, WireStatus::kBadKey);
  EXPECT_TRUE(Served(raw->get(), Remote(0), key_, kIncarnation));

  auto forged = ViewWithKey(key_ + 7);
  std::vector<uint8_t> src(64, 0xee);
  Slice w = MakeSliceTo(forged.get(), OpCode::kWrite, src.data(), Remote(0),
                        src.size());
  initiator_->Submit({&w});
  auto st = sink_.Wait(1);
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kPermissionDenied) << st[0];
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(target_buf_[i], 0x5a) << i;
  EXPECT_EQ(target_->Stats().denied_frames, 4u);
  EXPECT_EQ(target_->Stats().bad_frames, 0u);
}

// Under a cluster token, the keys a descriptor publishes grant nothing
// without the token: a raw peer with the right key but no proof, or a
// proof under another token, is closed before anything is looked up,
// while an initiator holding the token transfers as before, and a raw
// peer that answers the challenge properly is served.
class TcpTransportTokenTest : public TcpTransportTest {
 protected:
  void SetUp() override {}
  static constexpr char kToken[] = "cluster-token-0123456789";

  // A raw connection that has read the target's CHALLENGE into `challenge`.
  absl::StatusOr<UniqueFd> Challenged(uint8_t challenge[kResponseHeaderBytes]) {
    FERRY_ASSIGN_OR_RETURN(UniqueFd raw,
                           ConnectFrom("127.0.0.1", target_addr_));
    SetRecvTimeout(raw.get(), absl::Seconds(5));
    FERRY_RETURN_IF_ERROR(ReadFull(raw.get(), challenge, kResponseHeaderBytes));
    ResponseHeader h;
    FERRY_RETURN_IF_ERROR(DecodeResponse(challenge, &h));
    if (h.op != WireOp::kChallenge) {
      return absl::InternalError("the first frame is not a challenge");
    }
    return raw;
  }
};

TEST_F(TcpTransportTokenTest, KeysAloneGrantNothingWithoutTheToken) {
  ASSERT_NO_FATAL_FAILURE(InstallPair(kToken, kToken));
  std::fill(target_buf_.begin(), target_buf_.begin() + 64, 0x5a);

  uint8_t challenge[kResponseHeaderBytes];
  auto raw = Challenged(challenge);
  ASSERT_OK(raw);
  EXPECT_FALSE(Served(raw->get(), Remote(0), key_, kIncarnation))
      << "served a request with the right key and no proof";
  EXPECT_OK(::ferry::tcp::testing::WaitForClose(raw->get(), absl::Seconds(5)));

  uint8_t proof[kRequestHeaderBytes + kProofBytes];
  raw = Challenged(challenge);
  ASSERT_OK(raw);
  EncodeProof("another-token-0123456789", challenge, proof);
  ASSERT_OK(WriteFull(raw->get(), proof, sizeof(proof)));
  EXPECT_FALSE(Served(raw->get(), Remote(0), key_, kIncarnation))
      << "served after a proof under another token";

  uint8_t old_challenge[kResponseHeaderBytes];
  std::memcpy(old_challenge, challenge, sizeof(challenge));
  raw = Challenged(challenge);
  ASSERT_OK(raw);
  EXPECT_NE(std::memcmp(old_challenge, challenge, sizeof(challenge)), 0);
  EncodeProof(kToken, old_challenge, proof);  // A replay.
  ASSERT_OK(WriteFull(raw->get(), proof, sizeof(proof)));
  EXPECT_FALSE(Served(raw->get(), Remote(0), key_, kIncarnation))
      << "served after a proof for another connection's challenge";

  raw = Challenged(challenge);
  ASSERT_OK(raw);
  EncodeProof(kToken, challenge, proof);
  ASSERT_OK(WriteFull(raw->get(), proof, sizeof(proof)));
  EXPECT_TRUE(Served(raw->get(), Remote(0), key_, kIncarnation));

  std::vector<uint8_t> src(100000, 0xc3), dst(src.size());
  Slice w = MakeSlice(OpCode::kWrite, src.data(), Remote(4096), src.size());
  initiator_->Submit({&w});
  Slice r = MakeSlice(OpCode::kRead, dst.data(), Remote(4096), dst.size());
  auto st = sink_.Wait(1);
  ASSERT_EQ(st.size(), 1u);
  ASSERT_OK(st[0]);
  initiator_->Submit({&r});
  st = sink_.Wait(2);
  ASSERT_EQ(st.size(), 2u);
  ASSERT_OK(st[1]);
  EXPECT_EQ(dst, src);
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(target_buf_[i], 0x5a) << i;
}

// A cluster whose engines disagree on the token fails each transfer with
// a status that says which way, not with a timeout or "connection lost".
TEST_F(TcpTransportTokenTest, AnotherTokenIsRefusedWithAReason) {
  ASSERT_NO_FATAL_FAILURE(InstallPair(kToken, "another-token-0123456789"));
  absl::Status s = ReadOnce(view_.get(), absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "token likely differs")) << s;
}

TEST_F(TcpTransportTokenTest, NoTokenIsRefusedWithAReason) {
  ASSERT_NO_FATAL_FAILURE(InstallPair(kToken, ""));
  absl::Status s = ReadOnce(view_.get(), absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "requires the cluster's auth"))
      << s;
}

TEST_F(TcpTransportTokenTest, ATargetWithoutTheTokenIsNotTrusted) {
  TransportOptions opts;
  opts.connect_timeout = absl::Milliseconds(300);
  ASSERT_NO_FATAL_FAILURE(InstallPair("", kToken, opts));
  absl::Status s = ReadOnce(view_.get(), absl::Seconds(5));
  // Directly, or through the peer's back-off, which quotes the cause.
  EXPECT_TRUE(s.code() == absl::StatusCode::kFailedPrecondition ||
              s.code() == absl::StatusCode::kUnavailable)
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "no challenge within")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "runs without one")) << s;
}

// Each registration has a key of its own: the key of a buffer that was
// unregistered does not reach what is registered at its address next.
TEST_F(TcpTransportTest, ReRegisteredBufferHasANewKey) {
  ASSERT_OK(target_->UnregisterMemory(Remote(0)));
  ASSERT_OK_AND_ASSIGN(descriptor::Buffer published,
                       RegisterShared(*target_, Remote(0), target_buf_.size()));
  EXPECT_NE(published.tcp_key(), 0u);
  EXPECT_NE(published.tcp_key(), key_);
  char buf[8];
  Slice old = MakeSlice(OpCode::kRead, buf, Remote(0), sizeof(buf));
  initiator_->Submit({&old});
  auto st = sink_.Wait(1);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kPermissionDenied) << st[0];
  EXPECT_NE(st[0].message().find("key"), std::string::npos) << st[0];

  auto fresh = ViewWithKey(published.tcp_key());
  Slice now =
      MakeSliceTo(fresh.get(), OpCode::kRead, buf, Remote(0), sizeof(buf));
  initiator_->Submit({&now});
  st = sink_.Wait(2);
  EXPECT_OK(st[1]) << st[1];
}

// Another process on the target's port -- here a new run of the target
// with the same buffer at the same address and port -- is never written by
// a sender whose descriptor names the old run: FailedPrecondition, and not
// a byte changes.
TEST_F(TcpTransportTest, StaleIncarnationNeverTouchesTheNewProcess) {
  auto hp = ParseHostPort(target_addr_);
  ASSERT_OK(hp);
  target_->Shutdown();
  target_.reset();
  TransportOptions opts;
  opts.tcp.port = hp->port;
  TransportEnv env;
  env.local_segment = "t";
  env.listen_host = "127.0.0.1";
  env.incarnation = kIncarnation + 1;
  descriptor::TransportEndpoint ep;
  ASSERT_OK_AND_ASSIGN(auto next, Installed(opts, env, &ep));
  ASSERT_EQ(ep.address(), target_addr_);
  ASSERT_OK_AND_ASSIGN(descriptor::Buffer published,
                       RegisterShared(*next, Remote(0), target_buf_.size()));
  // Even with the new key: the old run's descriptor names another run.
  auto stale = ViewWithKey(published.tcp_key());
  std::vector<uint8_t> src(4096, 0xcd);
  Slice w = MakeSliceTo(stale.get(), OpCode::kWrite, src.data(), Remote(0),
                        src.size());
  initiator_->Submit({&w});
  auto st = sink_.Wait(1);
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kFailedPrecondition) << st[0];
  EXPECT_NE(st[0].message().find("restarted"), std::string::npos) << st[0];
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(target_buf_[i], 0) << i;
  EXPECT_EQ(next->Stats().denied_frames, 1u);
  // The new run's descriptor reaches it.
  auto current = ViewWithKey(published.tcp_key(), kIncarnation + 1);
  Slice w2 = MakeSliceTo(current.get(), OpCode::kWrite, src.data(), Remote(0),
                         src.size());
  initiator_->Submit({&w2});
  st = sink_.Wait(2);
  EXPECT_OK(st[1]) << st[1];
  EXPECT_EQ(target_buf_[0], 0xcd);
  next->Shutdown();
}

TEST_F(TcpTransportTest, GarbageFrameClosesOnlyThatConnection) {
  auto hp = ParseHostPort(target_addr_);
  auto bad = ConnectTcp(*hp, absl::Seconds(2));
  ASSERT_OK(bad);
  char garbage[64];
  std::memset(garbage, 0x5a, sizeof(garbage));
  ASSERT_OK(WriteFull(bad->get(), garbage, sizeof(garbage)));
  SetRecvTimeout(bad->get(), absl::Seconds(5));
  char c;
  EXPECT_EQ(ReadFull(bad->get(), &c, 1).code(), absl::StatusCode::kOutOfRange);
  // A truncated header then close: also harmless.
  auto trunc = ConnectTcp(*hp, absl::Seconds(2));
  ASSERT_OK(trunc);
  uint8_t hdr[kRequestHeaderBytes];
  EncodeRequest({WireOp::kWrite, 1, Remote(0), 1000}, hdr);
  ASSERT_OK(WriteFull(trunc->get(), hdr, 10));
  trunc->Reset();
  // A WRITE header followed by a short payload and close writes nothing
  // beyond what arrived and is not acknowledged.
  std::vector<uint8_t> src(64, 7);
  Slice w = MakeSlice(OpCode::kWrite, src.data(), Remote(64), src.size());
  initiator_->Submit({&w});
  auto st = sink_.Wait(1);
  ASSERT_OK(st[0]) << st[0];
  EXPECT_EQ(target_buf_[64], 7);
  EXPECT_EQ(target_->Stats().bad_frames, 1u);  // The garbage, counted.
}

TEST_F(TcpTransportTest, UnreachablePeerFailsFast) {
  auto dead = ViewWithPort(RefusingPort());
  absl::Status s = ReadOnce(dead.get(), absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(TcpTransportSimTest, SilentPeerHitsDeadline) {
  ASSERT_OK_AND_ASSIGN(SilentPeer silent, StartSilentPeer());
  char buf[8];
  Slice s = ReadSliceTo(silent.view.get(), buf, absl::Seconds(2));
  initiator_->Submit({&s});
  sim_.Advance(absl::Seconds(2) + kDeadlineTick);
  auto st = sink_.Wait(1, absl::Seconds(10));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_STATUS(st[0], absl::StatusCode::kDeadlineExceeded);
}

// Shutdown must cancel a slice that would otherwise wait for its (far)
// deadline: it completes with Cancelled, once, right after Shutdown.
TEST_F(TcpTransportTest, ShutdownCancelsInFlight) {
  ASSERT_OK_AND_ASSIGN(SilentPeer silent, StartSilentPeer());
  char buf[8];
  Slice s = MakeSliceTo(silent.view.get(), OpCode::kRead, buf, Remote(0), 8);
  s.deadline = absl::Now() + absl::Seconds(60);
  initiator_->Submit({&s});
  const absl::Time shutdown_at = absl::Now();
  initiator_->Shutdown();
  auto st = sink_.Wait(1, absl::Seconds(5));
  ASSERT_EQ(st.size(), 1u) << "Shutdown left the slice in flight";
  EXPECT_STATUS(st[0], absl::StatusCode::kCancelled);
  EXPECT_LT(sink_.times()[0] - shutdown_at, absl::Seconds(2));
  EXPECT_EQ(sink_.count(&s), 1);
}

// A descriptor whose TCP endpoint is not host:port fails its slices with
// InvalidArgument naming the address, and leaves nothing behind that the
// stats, the deadline sweep or Shutdown could trip over.
TEST_F(TcpTransportTest, UnparsableEndpointFailsCleanly) {
  for (const char* bad : {"nohost", "nohost:", ":80", "1.2.3.4:99999"}) {
    descriptor::SegmentDescriptor d = view_->descriptor();
    d.mutable_transports(0)->set_address(bad);
    auto view = SegmentView::Create(d);
    if (!view.ok()) continue;  // SegmentView may already refuse it.
    RecordingSink sink;
    char buf[8];
    Slice s = MakeSliceTo(view->get(), OpCode::kRead, buf, Remote(0), 8);
    s.sink = &sink;
    initiator_->Submit({&s});
    auto st = sink.Wait(1, absl::Seconds(5));
    ASSERT_EQ(st.size(), 1u) << bad;
    EXPECT_STATUS(st[0], absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st[0].message(), bad)) << st[0];
    TransportStats stats = initiator_->Stats();
    EXPECT_EQ(stats.peers, 0u) << bad;
  }
  // The transport still works, and its periodic work runs over the pools.
  std::vector<uint8_t> src(64, 9);
  Slice w = MakeSlice(OpCode::kWrite, src.data(), Remote(0), src.size());
  initiator_->Submit({&w});
  auto st = sink_.Wait(1);
  ASSERT_EQ(st.size(), 1u);
  EXPECT_OK(st[0]);
  EXPECT_EQ(initiator_->Stats().peers, 1u);
  initiator_->Shutdown();
}

// A peer that answers a READ header, sends one byte of the data and then
// nothing (a drip feed whose next byte is far off) must not keep the slice
// past its deadline: the deadline is checked on the clock, not when bytes
// arrive.
TEST_F(TcpTransportSimTest, DripFeedingReadPeerHitsDeadline) {
  ASSERT_OK_AND_ASSIGN(SilentPeer dripping, StartSilentPeer());
  const int listener = dripping.listener.get();
  Mutex mu;
  CondVar cv;
  bool dripped = false;
  bool stop = false;
  std::thread dripper([&] {
    pollfd pfd{listener, POLLIN, 0};
    if (::poll(&pfd, 1, 10000) != 1) return;
    UniqueFd conn(::accept(listener, nullptr, nullptr));
    if (!conn.valid()) return;
    SetRecvTimeout(conn.get(), absl::Seconds(10));
    uint8_t hdr[kRequestHeaderBytes];
    if (!ReadFull(conn.get(), hdr, sizeof(hdr)).ok()) return;
    RequestHeader req;
    if (!DecodeRequest(hdr, &req).ok()) return;
    uint8_t resp[kResponseHeaderBytes];
    EncodeResponse(
        {WireOp::kReadData, WireStatus::kOk, req.request_id, req.length}, resp);
    if (!WriteFull(conn.get(), resp, sizeof(resp)).ok()) return;
    char b = 'x';
    if (!WriteFull(conn.get(), &b, 1).ok()) return;
    MutexLock lock(&mu);
    dripped = true;
    cv.SignalAll();
    // Holds the connection open (bounded in real time) until the test ends.
    const absl::Time end = absl::Now() + absl::Seconds(30);
    while (!stop && !cv.WaitWithDeadline(&mu, end)) {
    }
  });
  std::vector<char> buf(64);
  Slice s = MakeSliceTo(dripping.view.get(), OpCode::kRead, buf.data(),
                        Remote(0), buf.size());
  s.deadline = sim_.Now() + absl::Milliseconds(1500);
  initiator_->Submit({&s});
  {
    MutexLock lock(&mu);
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (!dripped && !cv.WaitWithDeadline(&mu, end)) {
    }
    ASSERT_TRUE(dripped) << "the peer never got the request";
  }
  auto st = CompletionsAfter(s.deadline, "ended before its deadline");
  {
    MutexLock lock(&mu);
    stop = true;
    cv.SignalAll();
  }
  ASSERT_EQ(st.size(), 1u) << "the slice outlived its deadline";
  EXPECT_STATUS(st[0], absl::StatusCode::kDeadlineExceeded);
  initiator_->Shutdown();  // Closes the connection.
  dripper.join();
}

// Counts completions by code only (a storm of failures stores nothing).
class CountingSink : public SliceSink {
 public:
  void OnSliceDone(Slice*, const absl::Status& status) override {
    MutexLock lock(&mu_);
    ++done_;
    if (status.code() == absl::StatusCode::kUnavailable) ++unavailable_;
    last_ = status;
  }
  int done() {
    MutexLock lock(&mu_);
    return done_;
  }
  int unavailable() {
    MutexLock lock(&mu_);
    return unavailable_;
  }
  absl::Status last() {
    MutexLock lock(&mu_);
    return last_;
  }

 private:
  Mutex mu_;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  int unavailable_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_ ABSL_GUARDED_BY(mu_);
};

// Submitting to a peer that refuses connections, 20 slices every 10 ms for
// a second of the clock: every slice fails once with Unavailable naming
// the peer, the cause and the next try; connects are tried at 0, 100, 300
// and 700 ms (backoff_min 100 ms, doubling) and at no other time, and the
// failures without an attempt are counted as fast failures.
TEST_F(TcpTransportSimTest, RefusingPeerIsBackedOff) {
  const uint16_t port = RefusingPort();
  auto dead = ViewWithPort(port);
  CountingSink sink;
  char buf[8];
  const absl::Time end = sim_.Now() + absl::Seconds(1);
  int submitted = 0;
  while (sim_.Now() < end) {
    for (int k = 0; k < 20; ++k) {
      Slice s = MakeSliceTo(dead.get(), OpCode::kRead, buf, Remote(0), 8);
      s.sink = &sink;
      initiator_->Submit({&s});
      ++submitted;
      // Each slice must be done before it goes out of scope, and before
      // time moves (its failure is timed now): wait (bounded).
      const absl::Time wait_end = absl::Now() + absl::Seconds(10);
      while (sink.done() < submitted && absl::Now() < wait_end) {
        std::this_thread::yield();
      }
      ASSERT_EQ(sink.done(), submitted);
    }
    sim_.Advance(absl::Milliseconds(10));
  }
  EXPECT_EQ(sink.unavailable(), submitted);
  const std::string msg(sink.last().message());
  EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("127.0.0.1:", port))) << msg;
  EXPECT_TRUE(absl::StrContains(msg, "refused")) << msg;
  EXPECT_TRUE(absl::StrContains(msg, "next")) << msg;
  TransportStats stats = initiator_->Stats();
  EXPECT_EQ(stats.connects_started, 4u);
  EXPECT_EQ(stats.fast_failures, static_cast<uint64_t>(submitted) - 4);
}

// 1,000 peers (distinct addresses of one target), each used and closed in
// turn: the pools, connections, threads and fds do not grow.
TEST_F(TcpTransportTest, ThousandPeersOpenedAndClosedLeaveNothing) {
  const uint64_t addr = Remote(4096);
  ASSERT_OK_AND_ASSIGN(WildcardTarget target,
                       StartWildcardTarget("t2", addr, 4096));
  const int threads_before = ::ferry::testing::ThreadCount();
  const int fds_before = ::ferry::testing::OpenFds();
  uint64_t max_peers = 0;
  for (int i = 0; i < 1000; ++i) {
    descriptor::SegmentDescriptor d = view_->descriptor();
    d.mutable_transports(0)->set_address(absl::StrCat(
        "127.0.", 1 + i / 250, ".", 1 + i % 250, ":", target.port));
    d.mutable_buffers(0)->set_tcp_key(target.key);
    auto view = SegmentView::Create(d);
    ASSERT_OK(view);
    RecordingSink sink;
    uint64_t src = 0x1234567800000000ull + i, dst = 0;
    Slice w =
        MakeSliceTo(view->get(), OpCode::kWrite, &src, addr + 8 * (i % 64), 8);
    w.sink = &sink;
    initiator_->Submit({&w});
    ASSERT_EQ(sink.Wait(1, absl::Seconds(10)).size(), 1u);
    Slice rd =
        MakeSliceTo(view->get(), OpCode::kRead, &dst, addr + 8 * (i % 64), 8);
    rd.sink = &sink;
    initiator_->Submit({&rd});
    auto st = sink.Wait(2, absl::Seconds(10));
    ASSERT_EQ(st.size(), 2u);
    ASSERT_OK(st[0]);
    ASSERT_OK(st[1]);
    ASSERT_EQ(dst, src);
    max_peers = std::max(max_peers, initiator_->Stats().peers);
    initiator_->ClosePeer(**view);
  }
  EXPECT_GE(max_peers, 1u);  // The gauge counts open peers...
  // ...and everything is released (closing is asynchronous: bounded wait).
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (absl::Now() < end &&
         (initiator_->Stats().peers > 0 || initiator_->Stats().endpoints > 0 ||
          target.transport->Stats().endpoints > 0 ||
          ::ferry::testing::OpenFds() > fds_before + 2)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(initiator_->Stats().peers, 0u);
  EXPECT_EQ(initiator_->Stats().endpoints, 0u);
  EXPECT_EQ(target.transport->Stats().endpoints, 0u);
  EXPECT_LE(::ferry::testing::OpenFds(), fds_before + 2);
  EXPECT_LE(::ferry::testing::ThreadCount(), threads_before + 2);
  target.transport->Shutdown();
}

// The 65th connection from one address is refused (default cap 64); the
// 64 before it, and connections from other addresses, are served.
TEST_F(TcpTransportTest, ConnectionsPerAddressAreCapped) {
  std::vector<UniqueFd> conns;
  for (int i = 0; i < 65; ++i) {
    auto fd = ConnectFrom("127.0.0.2", target_addr_);
    ASSERT_OK(fd);
    conns.push_back(std::move(*fd));
  }
  auto other = ConnectFrom("127.0.0.3", target_addr_);
  ASSERT_OK(other);
  int served = 0;
  for (auto& c : conns)
    served += Served(c.get(), Remote(0), key_, kIncarnation);
  EXPECT_EQ(served, 64);
  EXPECT_TRUE(Served(other->get(), Remote(0), key_, kIncarnation));
  EXPECT_EQ(target_->Stats().refused_connections, 1u);
}

// At most max_peers pools: idle ones are dropped least recently used
// first; while all are busy a new peer fails with ResourceExhausted.
TEST_F(TcpTransportTest, PeerPoolsAreBoundedLru) {
  TransportOptions opts;
  opts.tcp.max_peers = 4;
  ASSERT_OK_AND_ASSIGN(auto initiator, Installed(opts, "i2"));
  const uint64_t addr = Remote(0);
  ASSERT_OK_AND_ASSIGN(WildcardTarget target,
                       StartWildcardTarget("i2", addr, 4096));
  auto view_at = [&](const std::string& address) {
    descriptor::SegmentDescriptor d = view_->descriptor();
    d.mutable_transports(0)->set_address(address);
    d.mutable_buffers(0)->set_tcp_key(target.key);
    return *SegmentView::Create(d);
  };
  // Each peer's slice, sink and view live to the end of the test, so that
  // a late or second completion of an earlier one is seen (counted), not
  // written into a later iteration's objects at the same stack address.
  constexpr int kPeers = 20;
  std::vector<std::shared_ptr<const SegmentView>> peer_views;
  std::vector<std::unique_ptr<RecordingSink>> peer_sinks;
  std::vector<Slice> peer_slices(kPeers);
  std::vector<uint64_t> peer_bufs(kPeers);
  for (int i = 0; i < kPeers; ++i) {
    peer_views.push_back(
        view_at(absl::StrCat("127.0.2.", i + 1, ":", target.port)));
    peer_sinks.push_back(std::make_unique<RecordingSink>());
    Slice& s = peer_slices[i];
    s = MakeSliceTo(peer_views.back().get(), OpCode::kRead, &peer_bufs[i], addr,
                    8);
    s.sink = peer_sinks.back().get();
    initiator->Submit({&s});
    auto st = peer_sinks.back()->Wait(1, absl::Seconds(10));
    ASSERT_EQ(st.size(), 1u);
    ASSERT_OK(st[0]);
    EXPECT_LE(initiator->Stats().peers, 4u);
  }
  EXPECT_GE(initiator->Stats().evictions, 16u);
  // Four peers busy (silent listeners: the READs wait for their deadline)...
  std::vector<UniqueFd> silent;
  std::vector<std::shared_ptr<const SegmentView>> views;
  std::vector<Slice> busy(4);
  std::vector<uint64_t> bufs(4);
  RecordingSink busy_sink;
  for (int i = 0; i < 4; ++i) {
    uint16_t port = 0;
    auto l = ListenTcp("127.0.0.1", 0, &port);
    ASSERT_OK(l);
    silent.push_back(std::move(*l));
    views.push_back(view_at(absl::StrCat("127.0.0.1:", port)));
    busy[i] = MakeSliceTo(views.back().get(), OpCode::kRead, &bufs[i], addr, 8);
    busy[i].sink = &busy_sink;
    initiator->Submit({&busy[i]});
  }
  // ...so a fifth is refused at once, naming the limit.
  auto fifth = view_at(absl::StrCat("127.0.3.1:", target.port));
  RecordingSink sink;
  uint64_t v = 0;
  Slice s = MakeSliceTo(fifth.get(), OpCode::kRead, &v, addr, 8);
  s.sink = &sink;
  initiator->Submit({&s});
  auto st = sink.Wait(1, absl::Seconds(5));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_STATUS(st[0], absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(st[0].message(), "max_peers")) << st[0];
  initiator->Shutdown();  // Cancels the four.
  EXPECT_EQ(busy_sink.Wait(4, absl::Seconds(5)).size(), 4u);
  target.transport->Shutdown();
  for (int i = 0; i < kPeers; ++i) {
    EXPECT_EQ(peer_sinks[i]->count(&peer_slices[i]), 1) << "peer " << i;
    EXPECT_EQ(peer_sinks[i]->Wait(0).size(), 1u) << "peer " << i;
  }
}

// A peer whose connects are never answered (its accept queue is full, so
// the kernel drops the SYNs, as a black-holed link would): the slices wait
// no longer than the connect timeout, then the peer is backed off.
TEST_F(TcpTransportSimTest, UnansweredConnectTimesOutAndBacksOff) {
  ASSERT_OK_AND_ASSIGN(testing::BlackHole hole_peer, testing::StartBlackHole());
  TransportOptions opts;
  opts.connect_timeout = absl::Seconds(3);
  opts.tcp.backoff_min = absl::Seconds(5);
  ASSERT_OK_AND_ASSIGN(auto initiator, Installed(opts, "i3", &sim_));
  auto hole = ViewWithPort(hole_peer.port);
  char buf[8];
  Slice s = ReadSliceTo(hole.get(), buf, absl::Seconds(30));
  initiator->Submit({&s});
  // The connect started at the current simulated time.
  ASSERT_TRUE(ConnectsStarted(*initiator, 1));
  auto st = CompletionsAfter(sim_.Now() + opts.connect_timeout,
                             "gave up before connect_timeout");
  ASSERT_EQ(st.size(), 1u);
  EXPECT_STATUS(st[0], absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(st[0].message(), "no answer within")) << st[0];
  // Backed off for backoff_min: until then a slice fails at once, without
  // a connect.
  sim_.Advance(opts.tcp.backoff_min - absl::Milliseconds(1));
  Slice s2 = MakeSliceTo(hole.get(), OpCode::kRead, buf, Remote(0), 8);
  initiator->Submit({&s2});
  st = sink_.Wait(2, absl::Seconds(10));
  ASSERT_EQ(st.size(), 2u);
  EXPECT_STATUS(st[1], absl::StatusCode::kUnavailable);
  TransportStats stats = initiator->Stats();
  EXPECT_EQ(stats.connects_started, 1u);
  EXPECT_EQ(stats.fast_failures, 1u);
  // Then the next slice tries again.
  sim_.Advance(absl::Milliseconds(1));
  Slice s3 = MakeSliceTo(hole.get(), OpCode::kRead, buf, Remote(0), 8);
  initiator->Submit({&s3});
  EXPECT_TRUE(ConnectsStarted(*initiator, 2));
  initiator->Shutdown();  // Cancels s3.
  EXPECT_EQ(sink_.Wait(3, absl::Seconds(10)).size(), 3u);
}

// Frees each slice as it completes, as an engine may once a slice is done
// (a transport must never touch a slice after completing it).
class FreeingSink : public SliceSink {
 public:
  void OnSliceDone(Slice* slice, const absl::Status& status) override {
    delete slice;
    MutexLock lock(&mu_);
    statuses_.push_back(status);
  }
  std::vector<absl::Status> Wait(size_t n, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      {
        MutexLock lock(&mu_);
        if (statuses_.size() >= n) break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    MutexLock lock(&mu_);
    return statuses_;
  }

 private:
  Mutex mu_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

// A slice on its last try (attempts is transport-owned; set here as if it
// had bounced off three closing connections) whose connection times out
// before it reached the wire: it fails with the connection's cause, and
// its memory is not read after the sink freed it (ASan).
TEST_F(TcpTransportSimTest, SliceOutOfAttemptsIsNotTouchedAfterCompletion) {
  ASSERT_OK_AND_ASSIGN(testing::BlackHole hole_peer, testing::StartBlackHole());
  TransportOptions opts;
  ASSERT_OK_AND_ASSIGN(auto initiator, Installed(opts, "i4", &sim_));
  auto hole = ViewWithPort(hole_peer.port);
  FreeingSink sink;
  static char buf[8];
  auto* s =
      new Slice(MakeSliceTo(hole.get(), OpCode::kRead, buf, Remote(0), 8));
  s->sink = &sink;
  s->attempts = 3;
  initiator->Submit({s});
  ASSERT_TRUE(ConnectsStarted(*initiator, 1));
  sim_.Advance(opts.connect_timeout + kDeadlineTick);
  auto st = sink.Wait(1, absl::Seconds(10));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_STATUS(st[0], absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(st[0].message(), "no answer within")) << st[0];
  initiator->Shutdown();
}

// ClosePeer on a busy peer fails nothing: the slice ends on its own (here
// at its deadline), then the pool goes.
TEST_F(TcpTransportSimTest, ClosePeerWaitsForSlicesInFlight) {
  ASSERT_OK_AND_ASSIGN(SilentPeer silent, StartSilentPeer());
  char buf[8];
  Slice s = ReadSliceTo(silent.view.get(), buf, absl::Seconds(2));
  initiator_->Submit({&s});
  initiator_->ClosePeer(*silent.view);
  EXPECT_EQ(initiator_->Stats().peers, 1u);  // Still busy.
  EXPECT_TRUE(NothingCompleted());
  sim_.Advance(absl::Seconds(2) + kDeadlineTick);
  auto st = sink_.Wait(1, absl::Seconds(10));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_STATUS(st[0], absl::StatusCode::kDeadlineExceeded);
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (initiator_->Stats().peers > 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(initiator_->Stats().peers, 0u);
  EXPECT_EQ(initiator_->Stats().endpoints, 0u);
}

// Accepts one connection on `listener` within `timeout` (invalid if none).
UniqueFd AcceptWithin(int listener, absl::Duration timeout) {
  pollfd pfd{listener, POLLIN, 0};
  if (::poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) !=
      1) {
    return UniqueFd();
  }
  return UniqueFd(::accept(listener, nullptr, nullptr));
}

// ClosePeer while a READ is on the wire, then the peer drops the
// connection: the close starts inside the connection's own event handler,
// with no other reference to the closing pool up the stack, and completing
// the last slice retires the pool there. Nothing may touch the pool after
// that (ASan saw a use-after-free here).
TEST_F(TcpTransportSimTest, ClosedPeerDroppingConnectionWithSliceOnWire) {
  ASSERT_OK_AND_ASSIGN(SilentPeer peer, StartSilentPeer());
  const SegmentView* silent = peer.view.get();
  const int listener = peer.listener.get();
  char buf[8];
  Slice s = MakeSliceTo(silent, OpCode::kRead, buf, Remote(0), 8);
  initiator_->Submit({&s});
  UniqueFd conn = AcceptWithin(listener, absl::Seconds(5));
  ASSERT_TRUE(conn.valid());
  uint8_t hdr[kRequestHeaderBytes];
  SetRecvTimeout(conn.get(), absl::Seconds(5));
  ASSERT_OK(ReadFull(conn.get(), hdr, sizeof(hdr)));  // On the wire.
  initiator_->ClosePeer(*silent);
  // A slice to the same address goes to a new pool on the same (only)
  // loop, posted after ClosePeer's task: once its connection arrives, the
  // old pool is closing for sure.
  char buf2[8];
  Slice s2 = ReadSliceTo(silent, buf2, absl::Seconds(1));
  initiator_->Submit({&s2});
  UniqueFd conn2 = AcceptWithin(listener, absl::Seconds(5));
  ASSERT_TRUE(conn2.valid());
  conn.Reset();  // The peer drops the first connection.
  ASSERT_EQ(sink_.Wait(1, absl::Seconds(10)).size(), 1u);
  sim_.Advance(absl::Seconds(1) + kDeadlineTick);  // s2's deadline.
  auto st = sink_.Wait(2, absl::Seconds(10));
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(sink_.count(&s), 1);
  EXPECT_EQ(sink_.count(&s2), 1);
  for (const absl::Status& status : st) EXPECT_FALSE(status.ok()) << status;
  initiator_->Shutdown();
}

// A slice's deadline holds while its connection is still connecting: with
// the default connect timeout (3 s) to a peer whose SYNs go unanswered (a
// full accept queue), a slice with 500 ms to go ends at the first deadline
// check after its deadline, not when the connect times out.
TEST_F(TcpTransportSimTest, DeadlineHoldsWhileConnecting) {
  ASSERT_OK_AND_ASSIGN(testing::BlackHole hole_peer, testing::StartBlackHole());
  auto hole = ViewWithPort(hole_peer.port);
  char buf[8];
  Slice s = ReadSliceTo(hole.get(), buf, absl::Milliseconds(500));
  initiator_->Submit({&s});
  ASSERT_TRUE(ConnectsStarted(*initiator_, 1));
  auto st = CompletionsAfter(s.deadline, "ended before its deadline");
  ASSERT_EQ(st.size(), 1u);
  EXPECT_STATUS(st[0], absl::StatusCode::kDeadlineExceeded);
}

// ClosePeer while Submit fails a slice of that backed-off peer at once:
// the pool still goes once the slice is done. Timing-dependent: ClosePeer
// must land after Submit counted the slice for the pool and before it
// failed it, which a long batch to another backed-off peer ahead of it
// makes likely; a round that misses only checks less.
TEST_F(TcpTransportTest, ClosePeerDuringFastFailureReleasesThePool) {
  TransportOptions opts;
  opts.tcp.backoff_min = absl::Seconds(30);  // Backed off all test long.
  opts.tcp.backoff_max = absl::Seconds(30);
  ASSERT_OK_AND_ASSIGN(auto initiator, Installed(opts, "i5"));
  auto p = ViewWithPort(RefusingPort());
  auto q = ViewWithPort(RefusingPort());
  CountingSink sink;
  char buf[8];
  int expected = 0;
  auto wait_done = [&] {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (sink.done() < expected && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    return sink.done() == expected;
  };
  constexpr int kBatch = 200000;
  std::vector<Slice> batch(kBatch + 1);
  std::vector<Slice*> ptrs;
  for (int i = 0; i <= kBatch; ++i) {
    batch[i] = MakeSliceTo(i < kBatch ? q.get() : p.get(), OpCode::kRead, buf,
                           Remote(0), 8);
    batch[i].sink = &sink;
    ptrs.push_back(&batch[i]);
  }
  for (int round = 0; round < 5; ++round) {
    // Both peers refuse once, so both are backed off (p's pool is new
    // every round).
    Slice warm[2] = {MakeSliceTo(p.get(), OpCode::kRead, buf, Remote(0), 8),
                     MakeSliceTo(q.get(), OpCode::kRead, buf, Remote(0), 8)};
    for (Slice& w : warm) {
      w.sink = &sink;
      initiator->Submit({&w});
      ++expected;
      ASSERT_TRUE(wait_done());
    }
    std::atomic<bool> go{false};
    std::thread closer([&] {
      while (!go.load()) std::this_thread::yield();
      // Into the batch: Submit holds its lock while it counts the slices.
      absl::SleepFor(absl::Milliseconds(1));
      initiator->ClosePeer(*p);
    });
    go.store(true);
    initiator->Submit(ptrs);
    closer.join();
    expected += kBatch + 1;
    ASSERT_TRUE(wait_done());
    // Had ClosePeer come before the batch, the batch made p a new pool.
    initiator->ClosePeer(*p);
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (initiator->Stats().peers > 1 && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(initiator->Stats().peers, 1u) << "round " << round;  // q.
  }
  EXPECT_EQ(sink.unavailable(), expected);
  initiator->Shutdown();
}

}  // namespace
}  // namespace ferry::tcp
