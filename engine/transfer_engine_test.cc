// Two real engines in one process over loopback TCP: engine A embeds the
// metadata service, engine B uses it.
#include "ferry/transfer_engine.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_join.h"
#include "common/identity.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/simulated_clock.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/grpc_status.h"
#include "metadata/metadata_client.h"
#include "metadata/peer_service.h"
#include "metadata/store_testing.h"
#include "metadata/tls_testing.h"

namespace ferry {
namespace {

// A request of `len` bytes between `local` and `remote` in segment `target`.
TransferRequest ReqTo(OpCode op, SegmentHandle target, void* local,
                      const void* remote, size_t len) {
  TransferRequest r;
  r.opcode = op;
  r.source = local;
  r.target_id = target;
  r.target_offset = reinterpret_cast<uint64_t>(remote);
  r.length = len;
  return r;
}

// Runs `reqs` as one batch on `e` (allocated, submitted, waited for up to
// 20 s and freed) and returns how it ended.
absl::StatusOr<BatchStatus> RunBatch(TransferEngine& e,
                                     const std::vector<TransferRequest>& reqs) {
  FERRY_ASSIGN_OR_RETURN(BatchId batch, e.AllocateBatch(reqs.size()));
  FERRY_RETURN_IF_ERROR(e.SubmitTransfer(batch, reqs));
  auto st = e.WaitBatch(batch, absl::Seconds(20));
  if (absl::Status s = e.FreeBatch(batch); !s.ok() && st.ok()) return s;
  return st;
}

// Options for an engine named `name` that listens on `listen_host` (""
// lets Init choose, as EngineOptions does).
EngineOptions Named(const std::string& name,
                    const std::string& listen_host = "") {
  EngineOptions o;
  o.local_segment_name = name;
  o.listen_host = listen_host;
  return o;
}

// `base` for an engine named `name` that uses `md`'s metadata service.
EngineOptions Joining(const std::string& name, const TransferEngine& md,
                      EngineOptions base = EngineOptions()) {
  base.local_segment_name = name;
  base.metadata_endpoint = md.metadata_address();
  return base;
}

// P2PHANDSHAKE on loopback: no metadata service, and each engine named by
// its RPC address.
EngineOptions P2pOnLoopback() {
  EngineOptions o;
  o.metadata_endpoint = "P2PHANDSHAKE";
  o.listen_host = "127.0.0.1";
  return o;
}

// Starts `first`, named `a`, on `loopback` with the embedded metadata
// service, and `second`, named `b`, using it; both with `base` otherwise.
void StartLoopbackPair(const std::string& a, TransferEngine* first,
                       const std::string& b, TransferEngine* second,
                       EngineOptions base = EngineOptions(),
                       const std::string& loopback = "127.0.0.1") {
  base.local_segment_name = a;
  base.listen_host = loopback;
  ASSERT_OK(first->Init(base));
  ASSERT_OK(second->Init(Joining(b, *first, base)));
}

// Starts `target` and `initiator` under P2PHANDSHAKE on loopback.
void StartP2pPair(TransferEngine* target, TransferEngine* initiator) {
  ASSERT_OK(target->Init(P2pOnLoopback()));
  ASSERT_OK(initiator->Init(P2pOnLoopback()));
}

// Registers `local` on `member`, opens segment `target` (into *h where
// given) and READs all of `remote`, a buffer registered there, into it;
// the batch must complete.
void ReadWhole(TransferEngine& member, const std::string& target,
               std::vector<uint8_t>& local, const std::vector<uint8_t>& remote,
               SegmentHandle* h = nullptr) {
  ASSERT_OK(member.RegisterLocalMemory(local.data(), local.size()));
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, member.OpenSegment(target));
  if (h != nullptr) *h = seg;
  ASSERT_OK_AND_ASSIGN(BatchStatus st,
                       RunBatch(member, {ReqTo(OpCode::kRead, seg, local.data(),
                                               remote.data(), remote.size())}));
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
}

// Sends notification `name`, `message`, from `sender` to `h` until one
// is refused, at most 100 times; returns how many went through, and the
// refusal in *refusal.
int SendUntilRefused(TransferEngine& sender, SegmentHandle h,
                     const std::string& name, const std::string& message,
                     absl::Status* refusal) {
  int sent = 0;
  absl::Status s;
  for (int i = 0; i < 100 && s.ok(); ++i) {
    s = sender.SendNotification(h, name, message);
    if (s.ok()) ++sent;
  }
  *refusal = s;
  return sent;
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK(a_.Init(Named("a")));
    EngineOptions b = Joining("b", a_);
    b.transfer_timeout = absl::Seconds(2);
    ASSERT_OK(b_.Init(b));
    remote_.assign(1 << 20, 0);
    local_.assign(1 << 20, 0);
    ASSERT_OK(
        a_.RegisterLocalMemory(remote_.data(), remote_.size(), "cpu:0", true));
    ASSERT_OK(b_.RegisterLocalMemory(local_.data(), local_.size()));
    auto seg = b_.OpenSegment("a");
    ASSERT_OK(seg);
    seg_ = *seg;
  }

  uint64_t R(size_t off) const {
    return reinterpret_cast<uint64_t>(remote_.data()) + off;
  }

  TransferRequest Req(OpCode op, size_t local_off, size_t remote_off,
                      size_t len) {
    TransferRequest r;
    r.opcode = op;
    r.source = local_.data() + local_off;
    r.target_id = seg_;
    r.target_offset = R(remote_off);
    r.length = len;
    return r;
  }

  BatchStatus Run(std::vector<TransferRequest> reqs) {
    auto batch = b_.AllocateBatch(reqs.size());
    EXPECT_OK(batch);
    EXPECT_OK(b_.SubmitTransfer(*batch, reqs));
    auto st = b_.WaitBatch(*batch, absl::Seconds(20));
    EXPECT_OK(st);
    EXPECT_OK(b_.FreeBatch(*batch));
    return *st;
  }

  // Buffers are declared before the engines so that they outlive them: an
  // engine may still be serving a peer's access when a test ends.
  std::vector<uint8_t> remote_, local_;
  TransferEngine a_, b_;
  SegmentHandle seg_ = 0;
};

TEST_F(EngineTest, WriteAndReadManyRequests) {
  for (size_t i = 0; i < local_.size(); ++i) local_[i] = (i * 7 + 3) & 0xff;
  std::vector<TransferRequest> w;
  for (size_t i = 0; i < 16; ++i) {
    w.push_back(Req(OpCode::kWrite, i * 65536, i * 65536, 65536));
  }
  BatchStatus st = Run(w);
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(st.completed, 16u);
  EXPECT_EQ(st.transferred_bytes, local_.size());
  EXPECT_EQ(remote_, local_);
  // READ back into a zeroed local buffer, in one request of 1 MiB.
  std::vector<uint8_t> expect = local_;
  std::fill(local_.begin(), local_.end(), 0);
  st = Run({Req(OpCode::kRead, 0, 0, local_.size())});
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(local_, expect);
}

// A second engine started with a live engine's name fails, takes nothing
// over, and removes nothing when it goes: peers still reach the first.
TEST_F(EngineTest, ATakenSegmentNameFailsInitAndOrphansNobody) {
  EngineOptions o = Joining("c", a_);
  TransferEngine first;
  ASSERT_OK(first.Init(o));
  // The second waits for the name on a SimulatedClock, so no real time
  // goes by (segment_publisher_test checks when it gives up).
  SimulatedClock clock;  // Outlives the second engine.
  o.segment_name_wait = absl::Milliseconds(300);
  o.clock = &clock;
  {
    TransferEngine second;
    std::atomic<bool> returned{false};
    absl::Status s;
    std::thread init([&] {
      s = second.Init(o);
      returned = true;
    });
    // Time moves while Init starts up too: the limit bounds the test, not
    // the wait.
    EXPECT_TRUE(clock.AdvanceUntil([&] { return returned.load(); },
                                   absl::Minutes(10), absl::Milliseconds(50)));
    init.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
    EXPECT_NE(s.message().find("held by a live engine"), std::string::npos)
        << s;
  }
  o.clock = nullptr;
  metadata::MetadataClient md(a_.metadata_address(), absl::Seconds(3));
  // Still published by the first (the second's exit removed nothing).
  EXPECT_OK(md.Get("c"));
  EXPECT_OK(b_.OpenSegment("c"));
  // Once the first run is gone, the name is free at once.
  first.Shutdown();
  TransferEngine next;
  o.segment_name_wait = absl::ZeroDuration();
  EXPECT_OK(next.Init(o));
}

// The embedded metadata service's leases run on the engine's clock: a
// lease nobody renews ends when that clock passes it, in no real time.
TEST(EngineClockTest, EmbeddedServiceExpiresLeasesOnTheEngineClock) {
  SimulatedClock clock;  // Outlives the engine.
  TransferEngine a;
  EngineOptions o = Named("a");
  o.clock = &clock;
  ASSERT_OK(a.Init(o));
  descriptor::SegmentDescriptor d;
  d.set_name("orphan");
  d.set_incarnation(9);
  auto* t = d.add_transports();
  t->set_transport("tcp");
  t->set_address("127.0.0.1:9");
  metadata::MetadataClient md(a.metadata_address(), absl::Seconds(3));
  ASSERT_OK(md.Put(metadata::LeasedPutOf(d, absl::Seconds(1))));
  clock.Advance(absl::Seconds(1) - absl::Nanoseconds(1));
  EXPECT_OK(md.Get("orphan"));
  clock.Advance(absl::Nanoseconds(1));
  EXPECT_STATUS(md.Get("orphan"), absl::StatusCode::kNotFound);
  EXPECT_OK(md.Get("a"));  // Its lease (10 s) has 9 s left.
  a.Shutdown();
}

// P2PHANDSHAKE: no metadata service. Each engine is named by its RPC
// address and serves its own descriptor; a buffer registered after the
// peer opened the segment is found by the refresh on a miss.
TEST(EngineP2pTest, TransfersWithoutAMetadataService) {
  std::vector<uint8_t> remote(1 << 16, 0x3c), local(1 << 16, 0);
  std::vector<uint8_t> late(4096, 0x7e);
  TransferEngine target, initiator;
  ASSERT_NO_FATAL_FAILURE(StartP2pPair(&target, &initiator));
  auto hp = ParseHostPort(target.local_segment_name());
  ASSERT_OK(hp);
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_NE(target.local_segment_name(), initiator.local_segment_name());
  ASSERT_OK(
      target.RegisterLocalMemory(remote.data(), remote.size(), "cpu:0", true));
  ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size()));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h,
                       initiator.OpenSegment(target.local_segment_name()));
  ASSERT_OK(
      target.RegisterLocalMemory(late.data(), late.size(), "cpu:0", true));
  ASSERT_OK_AND_ASSIGN(
      BatchStatus st,
      RunBatch(initiator,
               {ReqTo(OpCode::kRead, h, local.data(), remote.data(),
                      remote.size() / 2),
                ReqTo(OpCode::kRead, h, local.data() + remote.size() / 2,
                      late.data(), late.size())}));
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(local[0], 0x3c);
  EXPECT_EQ(local[remote.size() / 2], 0x7e);
  // A name that is not host:port is refused saying what P2P names are.
  auto bad = initiator.OpenSegment("target");
  EXPECT_STATUS(bad, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("host:port"), std::string::npos)
      << bad.status();
  // An address where no engine runs: Unavailable, not a hang.
  EXPECT_FALSE(initiator.OpenSegment("127.0.0.1:1").ok());
}

// A buffer registered again at the same address has a new TCP key: a peer
// whose descriptor still has the old one (P2P: nothing is pushed) fails
// once, PermissionDenied, and its next request reads the descriptor again
// and succeeds.
TEST(EngineP2pTest, ARefusedKeyRefreshesTheDescriptor) {
  std::vector<uint8_t> remote(4096, 0x3c), local(4096, 0);
  TransferEngine target, initiator;
  ASSERT_NO_FATAL_FAILURE(StartP2pPair(&target, &initiator));
  ASSERT_OK(
      target.RegisterLocalMemory(remote.data(), remote.size(), "cpu:0", true));
  ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size()));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h,
                       initiator.OpenSegment(target.local_segment_name()));
  auto read = [&] {
    return RunBatch(initiator, {ReqTo(OpCode::kRead, h, local.data(),
                                      remote.data(), remote.size())});
  };
  ASSERT_OK_AND_ASSIGN(BatchStatus st, read());
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  ASSERT_OK(target.UnregisterLocalMemory(remote.data()));
  ASSERT_OK(
      target.RegisterLocalMemory(remote.data(), remote.size(), "cpu:0", true));
  ASSERT_OK_AND_ASSIGN(st, read());
  EXPECT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(st.first_error.code(), absl::StatusCode::kPermissionDenied)
      << st.first_error;
  ASSERT_OK_AND_ASSIGN(st, read());
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
}

// Watches: a buffer registered (and one unregistered) after the peer
// opened the segment is pushed to the peer's cached descriptor, with no
// request missing it and no fetch.
TEST_F(EngineTest, ChangesAfterOpenArePushed) {
  std::vector<uint8_t> late(8192, 0x11);
  const uint64_t fetches = b_.GetEngineStats().descriptor_refreshes;
  auto has = [&](const void* p) {
    auto bufs = b_.GetSegmentBuffers(seg_);
    if (!bufs.ok()) return false;
    for (const RemoteBuffer& r : *bufs) {
      if (r.addr == reinterpret_cast<uint64_t>(p)) return true;
    }
    return false;
  };
  auto wait_until = [&](auto pred) {
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (!pred() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
    return pred();
  };
  ASSERT_OK(a_.RegisterLocalMemory(late.data(), late.size(), "cpu:0", true));
  EXPECT_TRUE(wait_until([&] { return has(late.data()); }))
      << "the registration was not pushed";
  ASSERT_OK(a_.UnregisterLocalMemory(late.data()));
  EXPECT_TRUE(wait_until([&] { return !has(late.data()); }))
      << "the unregistration was not pushed";
  const EngineStats st = b_.GetEngineStats();
  EXPECT_GE(st.descriptor_pushes, 2u);
  EXPECT_EQ(st.descriptor_refreshes, fetches) << "pushed, not fetched";
  EXPECT_TRUE(has(remote_.data()));
}

// A cluster with an auth token: an engine without it (or with another)
// cannot join; one with it publishes, opens and moves data.
TEST(EngineAuthTest, OnlyEnginesWithTheTokenJoin) {
  const std::string token = "kv-cluster-7f3a9c2e51d0";
  EngineOptions o = Named("auth-md", "127.0.0.1");
  o.auth_token = token;
  TransferEngine md;
  ASSERT_OK(md.Init(o));
  std::vector<uint8_t> remote(4096, 0x42), local(4096, 0);
  ASSERT_OK(
      md.RegisterLocalMemory(remote.data(), remote.size(), "cpu:0", true));
  EngineOptions peer = Joining("auth-peer", md, o);
  for (const std::string& wrong : {std::string(), token + "0"}) {
    peer.auth_token = wrong;
    TransferEngine intruder;
    absl::Status s = intruder.Init(peer);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  }
  peer.auth_token = "short";
  TransferEngine bad;
  EXPECT_EQ(bad.Init(peer).code(), absl::StatusCode::kInvalidArgument);
  peer.auth_token = token;
  TransferEngine member;
  ASSERT_OK(member.Init(peer));
  ASSERT_NO_FATAL_FAILURE(ReadWhole(member, "auth-md", local, remote));
  EXPECT_EQ(local[100], 0x42);
}

// An engine with no token whose RPC port listens beyond loopback says so,
// once; one with a token, or on loopback, does not.
TEST(EngineAuthTest, AnOpenEngineOnEveryInterfaceIsWarnedAbout) {
  Mutex mu;
  std::vector<std::string> lines;
  log::SetSink([&](log::Level level, absl::string_view component,
                   absl::string_view message) {
    if (level != log::Level::kWarn || component != "auth") return;
    MutexLock lock(&mu);
    lines.emplace_back(message);
  });
  struct NoSink {
    ~NoSink() { log::SetSink(nullptr); }
  } no_sink;
  EngineOptions open = Named("warn-open", "0.0.0.0");
  open.advertise_host = "127.0.0.1";
  EngineOptions guarded = Named("warn-guarded", "0.0.0.0");
  guarded.advertise_host = "127.0.0.1";
  guarded.auth_token = "warn-test-token-0123456";
  EngineOptions local = Named("warn-local", "127.0.0.1");
  TransferEngine a, b, c;
  ASSERT_OK(a.Init(open));
  ASSERT_OK(b.Init(guarded));
  ASSERT_OK(c.Init(local));
  MutexLock lock(&mu);
  ASSERT_EQ(lines.size(), 1u) << absl::StrJoin(lines, "\n");
  EXPECT_NE(lines[0].find("this engine's RPC port listens on"),
            std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find("FERRY_AUTH_TOKEN_FILE"), std::string::npos)
      << lines[0];
}

// Code that cannot pass a token (ferry.mooncake) gets the cluster's from
// the environment; an explicit one still wins.
TEST(EngineAuthTest, TheEnvironmentGivesTheToken) {
  const std::string token = "kv-cluster-from-env-0123";
  // Gone however the test ends: later tests in this binary have no token.
  struct Unset {
    ~Unset() { ::unsetenv("FERRY_AUTH_TOKEN"); }
  } unset;
  ::setenv("FERRY_AUTH_TOKEN", token.c_str(), 1);
  EngineOptions o = Named("env-md", "127.0.0.1");
  TransferEngine md;
  ASSERT_OK(md.Init(o));
  EngineOptions peer = Joining("env-peer", md, o);
  TransferEngine member;
  ASSERT_OK(member.Init(peer));
  ASSERT_OK(member.OpenSegment("env-md").status());
  metadata::MetadataClient outsider(md.metadata_address(), absl::Seconds(5));
  EXPECT_EQ(outsider.List().status().code(),
            absl::StatusCode::kUnauthenticated);
  metadata::MetadataClient insider(md.metadata_address(), absl::Seconds(5),
                                   token);
  EXPECT_OK(insider.List().status());
  ::setenv("FERRY_AUTH_TOKEN", "short", 1);
  peer.local_segment_name = "env-bad";
  TransferEngine bad;
  absl::Status s = bad.Init(peer);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("FERRY_AUTH_TOKEN"), std::string::npos) << s;
  peer.auth_token = token;  // Explicit: the environment is not read.
  TransferEngine explicit_token;
  EXPECT_OK(explicit_token.Init(peer));
  ::unsetenv("FERRY_AUTH_TOKEN");
  peer.auth_token = "";
  peer.local_segment_name = "env-none";
  TransferEngine none;
  s = none.Init(peer);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
}

// With mutual TLS, only engines with a certificate from the cluster CA
// join: one without TLS, or with another CA's certificate, cannot publish;
// a member transfers and notifies as usual.
TEST(EngineTlsTest, OnlyEnginesWithACertificateJoin) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/pki";
  ASSERT_EQ(std::system(("mkdir -p '" + dir + "'").c_str()), 0);
  ASSERT_OK_AND_ASSIGN(metadata::testing::TestPki pki,
                       metadata::testing::MakeTestPki(dir));
  auto with = [](EngineOptions o, const metadata::TlsFiles& f) {
    o.tls_ca_file = f.ca_file;
    o.tls_cert_file = f.cert_file;
    o.tls_key_file = f.key_file;
    return o;
  };
  EngineOptions o = Named("tls-md", "127.0.0.1");
  TransferEngine md;
  ASSERT_OK(md.Init(with(o, pki.node)));
  std::vector<uint8_t> remote(4096, 0x42), local(4096, 0);
  ASSERT_OK(
      md.RegisterLocalMemory(remote.data(), remote.size(), "cpu:0", true));
  EngineOptions peer = Joining("tls-peer", md, o);
  peer.rpc_timeout = absl::Seconds(2);
  {
    TransferEngine plain;
    absl::Status s = plain.Init(peer);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    metadata::TlsFiles impostor = pki.rogue;
    impostor.ca_file = pki.node.ca_file;
    TransferEngine rogue;
    s = rogue.Init(with(peer, impostor));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  }
  TransferEngine member;
  ASSERT_OK(member.Init(with(peer, pki.node)));
  SegmentHandle h = 0;
  ASSERT_NO_FATAL_FAILURE(ReadWhole(member, "tls-md", local, remote, &h));
  EXPECT_EQ(local[100], 0x42);
  ASSERT_OK(member.SendNotification(h, "kv-ready", "over tls"));
  auto got = md.GetNotifications();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "over tls");
  EXPECT_EQ(got[0].sender_address, "ipv4:127.0.0.1");
  // Over IPv6 (gRPC's own TLS listener names such peers percent-encoded):
  // the sender is still seen, and verified.
  TransferEngine md6, member6;
  ASSERT_NO_FATAL_FAILURE(StartLoopbackPair(
      "tls-md6", &md6, "tls-peer6", &member6, with(o, pki.node), "::1"));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h6, member6.OpenSegment("tls-md6"));
  ASSERT_OK(member6.SendNotification(h6, "kv-ready", "over tls, ipv6"));
  got = md6.GetNotifications();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].sender_address, "ipv6:[::1]");
  EXPECT_TRUE(got[0].sender_verified);
  // Bad files fail Init and name the file.
  metadata::TlsFiles missing = pki.node;
  missing.key_file = dir + "/no-such.key";
  TransferEngine broken;
  absl::Status s = broken.Init(with(peer, missing));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("no-such.key"), std::string::npos) << s;
}

TEST_F(EngineTest, PerRequestStatus) {
  auto batch = b_.AllocateBatch(2);
  ASSERT_OK(batch);
  ASSERT_OK(b_.SubmitTransfer(*batch, {Req(OpCode::kWrite, 0, 0, 100)}));
  ASSERT_OK(b_.WaitBatch(*batch, absl::Seconds(10)));
  auto t = b_.GetTransferStatus(*batch, 0);
  ASSERT_OK(t);
  EXPECT_EQ(t->state, TransferState::kCompleted);
  EXPECT_EQ(t->transferred_bytes, 100u);
  EXPECT_EQ(b_.GetTransferStatus(*batch, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A second submission to the same batch, up to its capacity.
  ASSERT_OK(b_.SubmitTransfer(*batch, {Req(OpCode::kRead, 0, 0, 10)}));
  EXPECT_EQ(b_.SubmitTransfer(*batch, {Req(OpCode::kRead, 0, 0, 10)}).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK(b_.WaitBatch(*batch, absl::Seconds(10)));
  EXPECT_OK(b_.FreeBatch(*batch));
}

TEST_F(EngineTest, BadRequestsAreRejectedWithReasons) {
  auto batch = b_.AllocateBatch(4);
  ASSERT_OK(batch);
  std::vector<uint8_t> unregistered(64);
  TransferRequest r = Req(OpCode::kWrite, 0, 0, 64);
  r.source = unregistered.data();
  absl::Status s = b_.SubmitTransfer(*batch, {r});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("local source"), std::string::npos) << s;

  r = Req(OpCode::kRead, 0, 0, 0);
  EXPECT_EQ(b_.SubmitTransfer(*batch, {r}).code(),
            absl::StatusCode::kInvalidArgument);

  r = Req(OpCode::kRead, 0, 0, 8);
  r.target_id = 12345;
  EXPECT_EQ(b_.SubmitTransfer(*batch, {r}).code(), absl::StatusCode::kNotFound);

  std::vector<TransferRequest> five(5, Req(OpCode::kRead, 0, 0, 8));
  s = b_.SubmitTransfer(*batch, five);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("capacity"), std::string::npos) << s;

  // None of the rejected submissions left a request behind.
  auto st = b_.GetBatchStatus(*batch);
  ASSERT_OK(st);
  EXPECT_EQ(st->total, 0u);
  EXPECT_OK(b_.FreeBatch(*batch));
}

// A remote range outside the cached descriptor is not refused on the spot
// (the peer may have registered it since): it waits for a descriptor
// fetched in the background, then fails -- SubmitTransfer never waits on
// the metadata service.
TEST_F(EngineTest, RemoteRangeOutsideBuffersFailsAfterAFreshDescriptor) {
  ASSERT_OK_AND_ASSIGN(BatchId batch, b_.AllocateBatch(2));
  const EngineStats before = b_.GetEngineStats();
  TransferRequest outside = Req(OpCode::kWrite, 0, remote_.size() - 10, 64);
  ASSERT_OK(b_.SubmitTransfer(batch, {Req(OpCode::kRead, 0, 0, 8), outside}));
  ASSERT_OK_AND_ASSIGN(BatchStatus st, b_.WaitBatch(batch, absl::Seconds(10)));
  EXPECT_EQ(st.completed, 1u);
  EXPECT_EQ(st.failed, 1u);
  ASSERT_OK_AND_ASSIGN(TransferStatus t, b_.GetTransferStatus(batch, 1));
  EXPECT_EQ(t.state, TransferState::kFailed);
  EXPECT_STATUS(t.error, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.error.message().find("remote range"), std::string::npos)
      << t.error;
  const EngineStats after = b_.GetEngineStats();
  EXPECT_EQ(after.requests_waited_for_descriptor,
            before.requests_waited_for_descriptor + 1);
  EXPECT_GT(after.descriptor_refreshes, before.descriptor_refreshes);
  EXPECT_EQ(after.requests_waiting_for_descriptor, 0u);
  EXPECT_OK(b_.FreeBatch(batch));
}

TEST_F(EngineTest, BatchIdsAreValidated) {
  auto batch = b_.AllocateBatch(1);
  ASSERT_OK(batch);
  ASSERT_OK(b_.FreeBatch(*batch));
  EXPECT_EQ(b_.FreeBatch(*batch).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_.GetBatchStatus(*batch).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_.SubmitTransfer(*batch, {Req(OpCode::kRead, 0, 0, 8)}).code(),
            absl::StatusCode::kInvalidArgument);
  // The slot is reused with a new generation; the old id stays invalid.
  auto again = b_.AllocateBatch(1);
  ASSERT_OK(again);
  EXPECT_NE(*again, *batch);
  EXPECT_EQ(b_.FreeBatch(*batch).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_OK(b_.FreeBatch(*again));
  for (BatchId forged : {BatchId{0}, BatchId{~0ull}, BatchId{0x100000007}}) {
    EXPECT_EQ(b_.FreeBatch(forged).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE(b_.WaitBatch(forged, absl::Milliseconds(1)).ok());
  }
  EXPECT_EQ(b_.AllocateBatch(0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, RegistrationRules) {
  std::vector<uint8_t> buf(4096);
  EXPECT_EQ(b_.RegisterLocalMemory(nullptr, 10).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_.RegisterLocalMemory(buf.data(), 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_.RegisterLocalMemory(local_.data() + 100, 10).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_OK(b_.RegisterLocalMemory(buf.data(), buf.size()));
  EXPECT_EQ(b_.UnregisterLocalMemory(buf.data() + 1).code(),
            absl::StatusCode::kNotFound);
  EXPECT_OK(b_.UnregisterLocalMemory(buf.data()));
  EXPECT_EQ(b_.UnregisterLocalMemory(buf.data()).code(),
            absl::StatusCode::kNotFound);
}

// A batch registers all its buffers with one metadata update (the segment's
// version moves by one), they serve transfers, and a batch with one bad
// entry leaves none registered.
TEST_F(EngineTest, BatchRegistrationIsOneUpdateAndAllOrNothing) {
  constexpr int kBuffers = 100;
  constexpr size_t kLen = 4096;
  std::vector<uint8_t> mem(kBuffers * 2 * kLen, 0x5c);
  std::vector<BufferEntry> entries;
  for (int i = 0; i < kBuffers; ++i) {
    entries.push_back({mem.data() + i * 2 * kLen, kLen});
  }
  metadata::MetadataClient md(a_.metadata_address(), absl::Seconds(3));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor before, md.Get("a"));
  // Versions count every update of the store: the newest before the batch.
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor other, md.Get("b"));
  const uint64_t newest = std::max(before.version(), other.version());
  ASSERT_OK(a_.RegisterLocalMemoryBatch(entries, "cpu:0"));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor after, md.Get("a"));
  EXPECT_EQ(after.buffers_size(), before.buffers_size() + kBuffers);
  EXPECT_EQ(after.version(), newest + 1) << "one update for the batch";
  // The last one serves a READ.
  TransferRequest r = Req(OpCode::kRead, 0, 0, kLen);
  r.target_offset = reinterpret_cast<uint64_t>(entries.back().addr);
  BatchStatus st = Run({r});
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(local_[kLen - 1], 0x5c);

  std::vector<void*> addrs;
  for (const BufferEntry& e : entries) addrs.push_back(e.addr);
  ASSERT_OK(a_.UnregisterLocalMemoryBatch(addrs));
  ASSERT_OK_AND_ASSIGN(after, md.Get("a"));
  EXPECT_EQ(after.buffers_size(), before.buffers_size());

  // Entry 50 overlaps entry 49: the batch fails naming it, and the 49
  // before it are rolled back.
  entries[50].addr = static_cast<uint8_t*>(entries[49].addr) + 100;
  absl::Status s = a_.RegisterLocalMemoryBatch(entries);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_NE(s.message().find("buffer 50 of 100"), std::string::npos) << s;
  ASSERT_OK_AND_ASSIGN(after, md.Get("a"));
  EXPECT_EQ(after.buffers_size(), before.buffers_size());
  EXPECT_OK(a_.RegisterLocalMemory(entries[0].addr, kLen));
  EXPECT_OK(a_.UnregisterLocalMemory(entries[0].addr));
  // Unregistering what is not there names it; the others still go.
  EXPECT_EQ(a_.UnregisterLocalMemoryBatch({entries[1].addr}).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(EngineTest, NewRemoteBufferIsFoundWithoutManualRefresh) {
  std::vector<uint8_t> extra(4096, 0x11);
  ASSERT_OK(a_.RegisterLocalMemory(extra.data(), extra.size()));
  TransferRequest r = Req(OpCode::kRead, 0, 0, extra.size());
  r.target_offset = reinterpret_cast<uint64_t>(extra.data());
  BatchStatus st = Run({r});
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(local_[0], 0x11);
  // Unregister before the memory goes away (waits for peers' accesses).
  EXPECT_OK(a_.UnregisterLocalMemory(extra.data()));
}

TEST_F(EngineTest, TargetRejectsUnregisteredBufferEvenWithStaleDescriptor) {
  std::vector<uint8_t> extra(4096, 0);
  ASSERT_OK(a_.RegisterLocalMemory(extra.data(), extra.size()));
  ASSERT_OK(b_.RefreshSegment(seg_));                 // b caches the buffer...
  ASSERT_OK(a_.UnregisterLocalMemory(extra.data()));  // ...a drops it.
  std::fill(local_.begin(), local_.begin() + 4096, 0x77);
  TransferRequest r = Req(OpCode::kWrite, 0, 0, extra.size());
  r.target_offset = reinterpret_cast<uint64_t>(extra.data());
  BatchStatus st = Run({r});
  EXPECT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(st.first_error.code(), absl::StatusCode::kInvalidArgument)
      << st.first_error;
  for (uint8_t c : extra) ASSERT_EQ(c, 0);
}

TEST_F(EngineTest, Notifications) {
  auto self = a_.OpenSegment("b");
  ASSERT_OK(self);
  ASSERT_OK(b_.SendNotification(seg_, "kv-ready", "layer=3"));
  ASSERT_OK(b_.SendNotification(seg_, "kv-ready", "layer=4"));
  auto got = a_.GetNotifications();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].from_segment, "b");
  EXPECT_EQ(got[0].message, "layer=3");
  EXPECT_EQ(got[1].message, "layer=4");
  // Where it came from, as the connection shows it (not what b claims).
  EXPECT_EQ(got[0].sender_address, "ipv4:127.0.0.1");
  EXPECT_TRUE(got[0].sender_verified) << "b is published from 127.0.0.1";
  EXPECT_TRUE(a_.GetNotifications().empty());
  EXPECT_EQ(b_.SendNotification(seg_, "x", std::string(1 << 17, 'x')).code(),
            absl::StatusCode::kInvalidArgument);
}

// One sender cannot fill a receiver's queue: past its share it is refused,
// naming the limit, while the queue as a whole has room; once the
// receiver takes its notifications the sender may send again.
TEST(EngineNotifyTest, EachSenderHasAShareOfTheQueue) {
  EngineOptions o;
  o.max_queued_notification_bytes_per_sender = 256 << 10;
  TransferEngine receiver, flooder;
  ASSERT_NO_FATAL_FAILURE(
      StartLoopbackPair("receiver", &receiver, "flooder", &flooder, o));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, flooder.OpenSegment("receiver"));
  const std::string chunk(60 << 10, 'f');
  absl::Status s;
  const int sent = SendUntilRefused(flooder, h, "flood", chunk, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("per sender"), std::string::npos) << s;
  EXPECT_EQ(sent, 4) << "4 x 60 KiB fit in 256 KiB";
  EXPECT_EQ(receiver.GetNotifications().size(), 4u);
  EXPECT_OK(flooder.SendNotification(h, "flood", chunk));
}

// The count is capped per sender too: a flood of tiny notifications from
// one address (65,534 filled the whole queue in a probe) stops at its
// share.
TEST(EngineNotifyTest, EachSenderHasACountShareToo) {
  EngineOptions o;
  o.max_queued_notifications_per_sender = 5;
  TransferEngine receiver, flooder;
  ASSERT_NO_FATAL_FAILURE(
      StartLoopbackPair("receiver", &receiver, "flooder", &flooder, o));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, flooder.OpenSegment("receiver"));
  absl::Status s;
  const int sent = SendUntilRefused(flooder, h, "f", "x", &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("per sender"), std::string::npos) << s;
  EXPECT_EQ(sent, 5);
  EXPECT_EQ(receiver.GetNotifications().size(), 5u);
  EXPECT_OK(flooder.SendNotification(h, "f", "x"));
  EngineOptions so = Joining("flooder", receiver, o);
  so.listen_host = "127.0.0.1";
  so.max_queued_notifications_per_sender = 0;
  TransferEngine bad;
  EXPECT_EQ(bad.Init(so).code(), absl::StatusCode::kInvalidArgument);
}

// A notification's claimed sender must have signed it with the identity
// key its descriptor publishes: unsigned, signed with another key, from an
// unregistered name, or naming a segment that publishes no key, it is not
// verified -- wherever it comes from, this host included (the live probe's
// spoof, "kv-ready from prefill-0", came from another host; an address
// check would let a process on prefill-0's own host through). With
// refuse_unverified_notifications off such a notification is queued,
// marked unverified; with the default it is refused.
TEST(EngineNotifyTest, ClaimedSendersAreChecked) {
  EngineOptions o = Named("decode-0", "127.0.0.1");
  o.refuse_unverified_notifications = false;
  TransferEngine receiver;
  ASSERT_OK(receiver.Init(o));
  metadata::MetadataClient md(receiver.metadata_address(), absl::Seconds(3));
  // prefill-0 publishes its key; prefill-old (an older engine) none.
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const IdentityKey> key,
                       IdentityKey::Generate());
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const IdentityKey> other,
                       IdentityKey::Generate());
  descriptor::SegmentDescriptor owned =
      metadata::TestSegment("prefill-0", 9, 0);
  owned.set_rpc_address("127.0.0.1:4000");  // This host: no help to a spoof.
  owned.set_identity_key(key->public_key());
  ASSERT_OK(md.Put(metadata::LeasedPutOf(owned)));
  // prefill-old (an older engine, keyless) on another host; prefill-near,
  // keyless too, on this one: held to the host, as that release was.
  descriptor::SegmentDescriptor old =
      metadata::TestSegment("prefill-old", 9, 0);
  old.set_rpc_address("10.255.0.9:4001");
  ASSERT_OK(md.Put(metadata::LeasedPutOf(old)));
  descriptor::SegmentDescriptor near =
      metadata::TestSegment("prefill-near", 9, 0);
  near.set_rpc_address("127.0.0.1:4002");
  ASSERT_OK(md.Put(metadata::LeasedPutOf(near)));
  const std::string to = receiver.metadata_address();
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor rd, md.Get("decode-0"));
  const uint64_t inc = rd.incarnation();
  metadata::PeerClient unsigned_client(absl::Seconds(3));
  metadata::PeerClient wrong_key(
      absl::Seconds(3), metadata::PeerClient::kMaxStubs, "", nullptr, other);
  metadata::PeerClient owner(absl::Seconds(3), metadata::PeerClient::kMaxStubs,
                             "", nullptr, key);
  ASSERT_OK(unsigned_client.Notify(to, "prefill-0", "kv-ready", "layer=0",
                                   "decode-0", inc));
  ASSERT_OK(wrong_key.Notify(to, "prefill-0", "kv-ready", "layer=1", "decode-0",
                             inc));
  ASSERT_OK(owner.Notify(to, "nobody", "kv-ready", "layer=2", "decode-0", inc));
  ASSERT_OK(
      owner.Notify(to, "prefill-old", "kv-ready", "layer=3", "decode-0", inc));
  ASSERT_OK(
      owner.Notify(to, "prefill-0", "kv-ready", "layer=4", "decode-0", inc));
  ASSERT_OK(
      unsigned_client.Notify(to, "prefill-near", "kv-ready", "layer=7", "", 0));
  EngineOptions so = Joining("prefill-1", receiver, o);
  TransferEngine sender;
  ASSERT_OK(sender.Init(so));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, sender.OpenSegment("decode-0"));
  ASSERT_OK(sender.SendNotification(h, "kv-ready", "layer=5"));
  auto got = receiver.GetNotifications();
  ASSERT_EQ(got.size(), 7u);
  EXPECT_FALSE(got[0].sender_verified) << "not signed";
  EXPECT_FALSE(got[1].sender_verified) << "signed with another key";
  EXPECT_FALSE(got[2].sender_verified) << "'nobody' is not registered";
  EXPECT_FALSE(got[3].sender_verified)
      << "prefill-old publishes no key, from another host";
  EXPECT_TRUE(got[4].sender_verified) << "signed by prefill-0's key";
  EXPECT_TRUE(got[5].sender_verified) << "keyless, from its own host";
  EXPECT_TRUE(got[6].sender_verified) << "an engine signs its own";

  EngineOptions strict = Joining("decode-1", receiver, o);
  strict.refuse_unverified_notifications =
      EngineOptions{}.refuse_unverified_notifications;
  ASSERT_TRUE(strict.refuse_unverified_notifications) << "the default";
  TransferEngine guarded;
  ASSERT_OK(guarded.Init(strict));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor gd, md.Get("decode-1"));
  absl::Status s = wrong_key.Notify(gd.rpc_address(), "prefill-0", "kv-ready",
                                    "layer=0", "decode-1", gd.incarnation());
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("does not match"), std::string::npos) << s;
  // Unsigned: refused too, for good on a read made since the call, or "try
  // again" on the read the call before made (under 250 ms old: the claimed
  // segment may have restarted as a release without keys).
  s = unsigned_client.Notify(gd.rpc_address(), "prefill-0", "kv-ready",
                             "layer=0", "decode-1", gd.incarnation());
  EXPECT_TRUE(s.code() == absl::StatusCode::kPermissionDenied ||
              s.code() == absl::StatusCode::kUnavailable)
      << s;
  EXPECT_NE(s.message().find("not signed"), std::string::npos) << s;
  ASSERT_OK_AND_ASSIGN(SegmentHandle gh, sender.OpenSegment("decode-1"));
  ASSERT_OK(sender.SendNotification(gh, "kv-ready", "layer=6"));
  got = guarded.GetNotifications();
  ASSERT_EQ(got.size(), 1u) << "only the verified one";
  EXPECT_EQ(got[0].from_segment, "prefill-1");
}

// A signed notification is good once, for the receiver and the run it
// names: sent again as it was (by someone who captured it), to another
// engine, or to a later run of the receiver, it is refused -- the
// signature alone would let it through each time.
TEST(EngineNotifyTest, ReplayedNotificationsAreRefused) {
  TransferEngine receiver, other;
  ASSERT_NO_FATAL_FAILURE(
      StartLoopbackPair("decode-0", &receiver, "decode-1", &other));
  metadata::MetadataClient md(receiver.metadata_address(), absl::Seconds(3));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const IdentityKey> key,
                       IdentityKey::Generate());
  descriptor::SegmentDescriptor owned =
      metadata::TestSegment("prefill-0", 9, 0);
  owned.set_rpc_address("127.0.0.1:4000");
  owned.set_identity_key(key->public_key());
  ASSERT_OK(md.Put(metadata::LeasedPutOf(owned)));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d0, md.Get("decode-0"));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d1, md.Get("decode-1"));
  // What prefill-0 would send decode-0, signed; sent as captured.
  metadata::NotifyRequest req;
  req.set_from_segment("prefill-0");
  req.set_name("kv-ready");
  req.set_message("layer=0");
  req.set_seq(7);
  req.set_to_segment("decode-0");
  req.set_to_incarnation(d0.incarnation());
  ASSERT_OK_AND_ASSIGN(std::string sig,
                       key->Sign(metadata::NotifyContent(req)));
  req.set_signature(sig);
  auto send = [](const std::string& address, const metadata::NotifyRequest& r) {
    auto stub = metadata::PeerService::NewStub(metadata::MakeChannel(address));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    metadata::NotifyResponse resp;
    return metadata::FromGrpcStatus(stub->Notify(&ctx, r, &resp), "Notify");
  };
  ASSERT_OK(send(d0.rpc_address(), req));
  absl::Status s = send(d0.rpc_address(), req);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("a replay"), std::string::npos) << s;
  // At another engine: refused and never queued; a real sender is told to
  // read its receiver's descriptor again (the address changed hands).
  s = send(d1.rpc_address(), req);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(metadata::HintOf(s), metadata::Hint::kRefreshReceiver) << s;
  EXPECT_NE(s.message().find("addressed to segment 'decode-0'"),
            std::string::npos)
      << s;
  // Readdressed by the spoofer, the signature no longer matches.
  metadata::NotifyRequest moved = req;
  moved.set_to_segment("decode-1");
  moved.set_to_incarnation(d1.incarnation());
  s = send(d1.rpc_address(), moved);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("does not match"), std::string::npos) << s;
  // Right receiver, earlier run: told the receiver restarted (a sender
  // reads the descriptor again and signs for the new run).
  metadata::NotifyRequest earlier = req;
  earlier.set_seq(8);
  earlier.set_to_incarnation(d0.incarnation() + 1);
  ASSERT_OK_AND_ASSIGN(sig, key->Sign(metadata::NotifyContent(earlier)));
  earlier.set_signature(sig);
  s = send(d0.rpc_address(), earlier);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(metadata::HintOf(s), metadata::Hint::kRefreshReceiver) << s;
  // Signed, but for no receiver in particular.
  metadata::NotifyRequest anyone = req;
  anyone.set_seq(9);
  anyone.clear_to_segment();
  anyone.set_to_incarnation(0);
  ASSERT_OK_AND_ASSIGN(sig, key->Sign(metadata::NotifyContent(anyone)));
  anyone.set_signature(sig);
  s = send(d0.rpc_address(), anyone);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  // A new number, signed by the key: accepted once, out of order too.
  metadata::NotifyRequest next = req;
  next.set_seq(5);
  ASSERT_OK_AND_ASSIGN(sig, key->Sign(metadata::NotifyContent(next)));
  next.set_signature(sig);
  EXPECT_OK(send(d0.rpc_address(), next));
  auto got = receiver.GetNotifications();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(got[0].sender_verified);
  EXPECT_TRUE(got[1].sender_verified);
  EXPECT_TRUE(other.GetNotifications().empty());
}

// A receiver that restarted under the same name refuses what was signed
// for its earlier run, with a hint; the sender reads its descriptor again
// and delivers to the new run, with no error to the application.
TEST(EngineNotifyTest, NotificationsFollowARestartedReceiver) {
  TransferEngine md, sender;
  ASSERT_NO_FATAL_FAILURE(StartLoopbackPair("md-0", &md, "prefill-0", &sender));
  EngineOptions o = Named("decode-0", "127.0.0.1");
  o.metadata_endpoint = md.metadata_address();
  auto receiver = std::make_unique<TransferEngine>();
  ASSERT_OK(receiver->Init(o));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, sender.OpenSegment("decode-0"));
  ASSERT_OK(sender.SendNotification(h, "kv-ready", "run=1"));
  ASSERT_EQ(receiver->GetNotifications().size(), 1u);
  // The new run listens where the old one did: the sender's descriptor
  // still leads there.
  ASSERT_OK_AND_ASSIGN(HostPort rpc, ParseHostPort(receiver->rpc_address()));
  o.rpc_port = rpc.port;
  receiver->Shutdown();
  receiver = std::make_unique<TransferEngine>();
  ASSERT_OK(receiver->Init(o));  // Same name, a new incarnation.
  ASSERT_OK(sender.SendNotification(h, "kv-ready", "run=2"));
  auto got = receiver->GetNotifications();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "run=2");
  EXPECT_TRUE(got[0].sender_verified);
  // Delivery across a restart, not the refresh path: the metadata
  // service's push of the new descriptor usually reaches the sender before
  // this send (18 of 20 runs refused nothing); the P2P case below, where
  // nothing pushes, takes the refresh path every time.
}

// The refresh path itself, where nothing pushes the new descriptor (P2P):
// the first send goes to the old run's incarnation, is refused with the
// refresh hint, and the sender reads the descriptor again and resends.
// P2PHANDSHAKE has no metadata service to ask for a sender's key: a
// notification was held to the caller's host only, so any process on
// that host could claim to be an engine there. Now, once the host
// matches, the claimed address is read for its key: a forger on the same
// host (another key, or none) is refused, and the real sender verified.
TEST(EngineNotifyTest, P2pNotificationsAreVerifiedByTheSendersKey) {
  TransferEngine sender, receiver;
  ASSERT_NO_FATAL_FAILURE(StartP2pPair(&sender, &receiver));
  const std::string to = receiver.local_segment_name();
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, sender.OpenSegment(to));
  ASSERT_OK(sender.SendNotification(h, "kv-ready", "real"));
  metadata::PeerClient reader(absl::Seconds(3));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor rd,
                       reader.GetDescriptor(to, to));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const IdentityKey> other,
                       IdentityKey::Generate());
  metadata::PeerClient forger(absl::Seconds(3), metadata::PeerClient::kMaxStubs,
                              "", nullptr, other);
  absl::Status s = forger.Notify(to, sender.local_segment_name(), "kv-ready",
                                 "forged", to, rd.incarnation());
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  metadata::PeerClient unsigned_client(absl::Seconds(3));
  s = unsigned_client.Notify(to, sender.local_segment_name(), "kv-ready",
                             "unsigned", "", 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  auto got = receiver.GetNotifications();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "real");
  EXPECT_TRUE(got[0].sender_verified);
}

TEST(EngineNotifyTest, NotificationsFollowARestartedReceiverP2p) {
  EngineOptions o = P2pOnLoopback();
  TransferEngine sender;
  ASSERT_OK(sender.Init(o));
  auto receiver = std::make_unique<TransferEngine>();
  ASSERT_OK(receiver->Init(o));
  const std::string name = receiver->local_segment_name();
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, sender.OpenSegment(name));
  ASSERT_OK(sender.SendNotification(h, "kv-ready", "run=1"));
  ASSERT_EQ(receiver->GetNotifications().size(), 1u);
  ASSERT_OK_AND_ASSIGN(HostPort rpc, ParseHostPort(name));
  o.rpc_port = rpc.port;
  receiver->Shutdown();
  receiver = std::make_unique<TransferEngine>();
  ASSERT_OK(receiver->Init(o));  // Same name (its address), a new run.
  ASSERT_EQ(receiver->local_segment_name(), name);
  ASSERT_OK(sender.SendNotification(h, "kv-ready", "run=2"));
  auto got = receiver->GetNotifications();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "run=2");
  EXPECT_EQ(receiver->GetEngineStats().notifications_refused, 1u)
      << "the first send was not refused: the refresh path was not taken";
}

// A handshake or rail notice through Exchange must come from the segment
// it names, as a notification must: the live probe's spoofed
// ConnectRequest ("from B", with a made-up incarnation) cut B's rail for
// good. A tcp-only engine takes no Exchange at all, so a spoofed one is
// refused before any check or transport sees it (the signature check on
// an rdma engine: rdma_engine_test, SpoofedExchangesAreRefused).
TEST(EnginePeerTest, ExchangesForATransportNotRunAreRefused) {
  TransferEngine target, initiator;
  ASSERT_NO_FATAL_FAILURE(
      StartLoopbackPair("target", &target, "initiator", &initiator));
  metadata::MetadataClient md(target.metadata_address(), absl::Seconds(3));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor td, md.Get("target"));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor id, md.Get("initiator"));
  EXPECT_EQ(id.identity_key().size(), kIdentityKeyBytes);
  metadata::PeerClient unsigned_client(absl::Seconds(3));
  for (const char* transport : {"tcp", "rdma"}) {
    auto r =
        unsigned_client.Exchange(td.rpc_address(), transport, "initiator", "x");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented)
        << r.status();
  }
  // The real initiator's own traffic still flows.
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, initiator.OpenSegment("target"));
  ASSERT_OK(initiator.SendNotification(h, "ok", "still verified"));
  auto got = target.GetNotifications();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].sender_verified);
}

TEST_F(EngineTest, UnknownSegment) {
  EXPECT_EQ(b_.OpenSegment("nobody").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(b_.OpenSegment("").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// On a SimulatedClock, so that the 2 s transfer_timeout passes in no real
// time: WaitBatch gives up after its own timeout, the request is still in
// flight just before its deadline and TIMEOUT after it.
TEST_F(EngineTest, SilentPeerTimesOutAndBatchCannotBeFreedMeanwhile) {
  // A segment whose TCP endpoint accepts connections and never answers.
  uint16_t port = 0;
  auto listener = ListenTcp("127.0.0.1", 0, &port);
  ASSERT_OK(listener);
  descriptor::SegmentDescriptor d;
  d.set_name("silent");
  d.set_incarnation(1);
  auto* t = d.add_transports();
  t->set_transport("tcp");
  t->set_address("127.0.0.1:" + std::to_string(port));
  auto* buf = d.add_buffers();
  buf->set_addr(0x10000);
  buf->set_length(0x10000);
  metadata::MetadataClient md(a_.metadata_address(), absl::Seconds(3));
  ASSERT_OK(md.Put(metadata::LeasedPutOf(d)));
  std::vector<uint8_t> local(64);
  SimulatedClock clock;  // Outlives the engine.
  TransferEngine c;
  EngineOptions o = Joining("c", a_);
  o.transfer_timeout = absl::Seconds(2);
  o.clock = &clock;
  ASSERT_OK(c.Init(o));
  ASSERT_OK(c.RegisterLocalMemory(local.data(), local.size()));
  ASSERT_OK_AND_ASSIGN(SegmentHandle silent, c.OpenSegment("silent"));
  auto batch = c.AllocateBatch(1);
  ASSERT_OK(batch);
  ASSERT_OK(c.SubmitTransfer(
      *batch, {ReqTo(OpCode::kRead, silent, local.data(),
                     reinterpret_cast<const void*>(0x10000), 64)}));
  const absl::Time deadline = clock.Now() + o.transfer_timeout;
  absl::Status free_status = c.FreeBatch(*batch);
  EXPECT_EQ(free_status.code(), absl::StatusCode::kFailedPrecondition)
      << free_status;
  std::atomic<bool> returned{false};
  absl::StatusOr<BatchStatus> waited;
  std::thread waiter([&] {
    waited = c.WaitBatch(*batch, absl::Milliseconds(100));
    returned = true;
  });
  // The waiter may start late on a loaded machine: a long limit (its
  // steps cost real time only until it returns).
  EXPECT_TRUE(clock.AdvanceUntil([&] { return returned.load(); },
                                 absl::Seconds(10), absl::Milliseconds(10)));
  waiter.join();
  EXPECT_STATUS(waited, absl::StatusCode::kDeadlineExceeded);
  auto state = [&] {
    auto ts = c.GetTransferStatus(*batch, 0);
    return ts.ok() ? ts->state : TransferState::kFailed;
  };
  clock.AdvanceTo(deadline - absl::Milliseconds(1));
  EXPECT_EQ(state(), TransferState::kPending);
  EXPECT_TRUE(
      clock.AdvanceUntil([&] { return state() != TransferState::kPending; },
                         absl::Seconds(10), absl::Milliseconds(10)));
  ASSERT_OK_AND_ASSIGN(BatchStatus st, c.GetBatchStatus(*batch));
  EXPECT_EQ(st.state, TransferState::kTimeout) << st.first_error;
  auto ts = c.GetTransferStatus(*batch, 0);
  EXPECT_EQ(ts->state, TransferState::kTimeout);
  EXPECT_EQ(ts->error.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_OK(c.FreeBatch(*batch));
}

// A batch's capacity is a bound, not an allocation: a huge one costs
// nothing until requests come, and a batch reused with more requests than
// before grows.
TEST(BatchCapacityTest, HugeCapacityAllocatesNothingUpFront) {
  std::vector<uint8_t> remote(1 << 20, 0), local(1 << 20, 7);
  TransferEngine target, initiator;
  ASSERT_OK(target.Init(Named("cap-target")));
  EngineOptions i = Joining("cap-initiator", target);
  i.max_batch_capacity = size_t{1} << 40;
  ASSERT_OK(initiator.Init(i));
  ASSERT_OK(target.RegisterLocalMemory(remote.data(), remote.size()));
  ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size()));
  auto seg = initiator.OpenSegment("cap-target");
  ASSERT_OK(seg);
  for (size_t n : {size_t{3}, size_t{200}}) {
    auto batch = initiator.AllocateBatch(size_t{1} << 40);
    ASSERT_OK(batch);
    std::vector<TransferRequest> reqs(n);
    for (size_t k = 0; k < n; ++k) {
      reqs[k].opcode = OpCode::kWrite;
      reqs[k].source = local.data() + k * 1000;
      reqs[k].target_id = *seg;
      reqs[k].target_offset =
          reinterpret_cast<uint64_t>(remote.data()) + k * 1000;
      reqs[k].length = 1000;
    }
    ASSERT_OK(initiator.SubmitTransfer(*batch, reqs));
    auto st = initiator.WaitBatch(*batch, absl::Seconds(10));
    ASSERT_OK(st);
    EXPECT_EQ(st->state, TransferState::kCompleted) << st->first_error;
    EXPECT_EQ(st->completed, n);
    auto last = initiator.GetTransferStatus(*batch, n - 1);
    ASSERT_OK(last);
    EXPECT_EQ(last->state, TransferState::kCompleted);
    ASSERT_OK(initiator.FreeBatch(*batch));
  }
  EXPECT_EQ(std::count(remote.begin(), remote.begin() + 200 * 1000, 7),
            200 * 1000);
}

TEST(MrCacheTest, RegistersOnFirstUseAndEvictsUnderBudget) {
  // Memory first, engines second: the engines are destroyed (and stop
  // touching memory) before the memory is freed.
  std::vector<uint8_t> remote(1 << 20, 0);
  // Sources that share no page, so that no two covers merge (neighbouring
  // heap blocks would: merging is covered by rdma_endpoint_test).
  constexpr size_t kSource = 128 << 10;
  constexpr size_t kStride = kSource + (64 << 10);
  void* arena = mmap(nullptr, 6 * kStride, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(arena, MAP_FAILED);
  auto source = [&](int k) {
    return static_cast<uint8_t*>(arena) + k * kStride;
  };
  TransferEngine target, initiator;
  ASSERT_OK(target.Init(Named("cache-target")));
  EngineOptions i = Joining("cache-initiator", target);
  i.mr_cache_bytes = 300 << 10;  // Room for two of the buffers below.
  ASSERT_OK(initiator.Init(i));
  ASSERT_OK(target.RegisterLocalMemory(remote.data(), remote.size()));
  auto seg = initiator.OpenSegment("cache-target");
  ASSERT_OK(seg);
  // Six never-registered sources: each is registered on first use, and
  // older ones are evicted to stay near the budget.
  for (int k = 0; k < 6; ++k) std::memset(source(k), 0x10 + k, kSource);
  for (int round = 0; round < 2; ++round) {
    for (int k = 0; k < 6; ++k) {
      auto batch = initiator.AllocateBatch(1);
      TransferRequest r;
      r.opcode = OpCode::kWrite;
      r.source = source(k);
      r.target_id = *seg;
      // The whole source, so that each cover is about 128 KiB.
      r.target_offset = reinterpret_cast<uint64_t>(remote.data()) + k * kSource;
      r.length = kSource;
      ASSERT_OK(initiator.SubmitTransfer(*batch, {r})) << k;
      auto st = initiator.WaitBatch(*batch, absl::Seconds(10));
      ASSERT_OK(st);
      ASSERT_EQ(st->state, TransferState::kCompleted) << st->first_error;
      ASSERT_OK(initiator.FreeBatch(*batch));
      EXPECT_EQ(remote[k * kSource + kSource - 1], 0x10 + k);
      // Never far beyond the budget: at most one cover (the one just
      // made) over it.
      EXPECT_LE(initiator.GetEngineStats().mr_cache_bytes,
                (300u << 10) + (132u << 10))
          << round << " " << k;
    }
  }
  // Six sources through a cache with room for two, twice: the older
  // registrations were evicted (each round re-registers what it uses).
  const EngineStats st = initiator.GetEngineStats();
  EXPECT_GE(st.mr_cache_evictions, 8u);
  EXPECT_LE(st.mr_cache_registrations, 3u);
  // Unmapped memory is refused with a reason, not faulted on.
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  munmap(p, 4096);
  auto batch = initiator.AllocateBatch(1);
  TransferRequest r;
  r.opcode = OpCode::kWrite;
  r.source = p;
  r.target_id = *seg;
  r.target_offset = reinterpret_cast<uint64_t>(remote.data());
  r.length = 64;
  absl::Status s = initiator.SubmitTransfer(*batch, {r});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("not mapped"), std::string::npos) << s;
  EXPECT_OK(initiator.FreeBatch(*batch));
  initiator.Shutdown();
  munmap(arena, 6 * kStride);
}

TEST(EngineInitTest, UnreachableMetadataFailsFastWithClearError) {
  TransferEngine e;
  EngineOptions o = Named("lonely");
  o.metadata_endpoint = "127.0.0.1:1";
  o.rpc_timeout = absl::Seconds(2);
  absl::Time start = absl::Now();
  absl::Status s = e.Init(o);
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded)
      << s;
  EXPECT_NE(s.message().find("127.0.0.1:1"), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(EngineInitTest, BadOptions) {
  TransferEngine e;
  EngineOptions o;
  EXPECT_EQ(e.Init(o).code(), absl::StatusCode::kInvalidArgument);  // No name.
  o.local_segment_name = "x";
  o.transports = {"carrier-pigeon"};
  EXPECT_EQ(e.Init(o).code(), absl::StatusCode::kNotFound);
  o.transports = {"tcp"};
  o.metadata_endpoint = "nonsense";
  EXPECT_EQ(e.Init(o).code(), absl::StatusCode::kInvalidArgument);
  o.metadata_endpoint = "embedded";
  o.metadata_lease_ttl = absl::ZeroDuration();  // No lease needs a token.
  absl::Status no_lease = e.Init(o);
  EXPECT_EQ(no_lease.code(), absl::StatusCode::kInvalidArgument) << no_lease;
  EXPECT_NE(no_lease.message().find("auth_token"), std::string::npos)
      << no_lease;
  o.auth_token = "bad-options-test-token-01";
  TransferEngine with_token;
  EXPECT_OK(with_token.Init(o));
  o.auth_token = "";
  o.metadata_lease_ttl = EngineOptions{}.metadata_lease_ttl;
  ASSERT_OK(e.Init(o));  // Retry after failures works.
  EXPECT_EQ(e.Init(o).code(), absl::StatusCode::kAlreadyExists);
}

// Where an engine binds and what it tells peers are separate: binding
// every interface never publishes a wildcard, and each choice says why.
TEST(EngineInitTest, AdvertisedAddressIsRoutableAndExplained) {
  struct Case {
    std::string listen, advertise;
    std::string want;  // Empty: the primary address, or loopback.
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"127.0.0.1", "", "127.0.0.1", "listen_host"},
      {"localhost", "", "127.0.0.1", "listen_host"},
      {"", "localhost", "127.0.0.1", "advertise_host"},
      {"::1", "", "::1", "listen_host"},
      {"0.0.0.0", "127.0.0.2", "127.0.0.2", "advertise_host"},
      {"", "", "", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(
        absl::StrCat("listen '", c.listen, "' advertise '", c.advertise, "'"));
    TransferEngine e;
    EngineOptions o = Named("adv", c.listen);
    o.advertise_host = c.advertise;
    ASSERT_OK(e.Init(o));
    const std::string host = e.advertised_host();
    EXPECT_FALSE(IsWildcardHost(host)) << host;
    if (!c.want.empty()) {
      EXPECT_EQ(host, c.want);
      EXPECT_NE(e.advertised_host_reason().find(c.reason), std::string::npos)
          << e.advertised_host_reason();
    }
    // Published as such: the descriptor's addresses use it, with the
    // ports bound, and say which host and namespace they come from.
    metadata::MetadataClient client(e.metadata_address(), absl::Seconds(2));
    ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d, client.Get("adv"));
    ASSERT_OK_AND_ASSIGN(HostPort rpc, ParseHostPort(d.rpc_address()));
    EXPECT_EQ(rpc.host, host);
    ASSERT_EQ(d.transports_size(), 1);
    ASSERT_OK_AND_ASSIGN(HostPort tcp,
                         ParseHostPort(d.transports(0).address()));
    EXPECT_EQ(tcp.host, host);
    EXPECT_FALSE(d.network_id().empty());
    e.Shutdown();
  }
}

// IPv6 end to end: the metadata service, the peer service and the TCP
// transport on ::1, with bytes verified.
TEST(EngineInitTest, TransfersOverIpv6) {
  TransferEngine target, initiator;
  EngineOptions t = Named("v6-target", "::1");
  ASSERT_OK(target.Init(t));
  EXPECT_EQ(target.metadata_address().rfind("[::1]:", 0), 0u)
      << target.metadata_address();
  ASSERT_OK(initiator.Init(Joining("v6-initiator", target, t)));
  std::vector<uint8_t> remote(1 << 16, 0), local(1 << 16);
  std::iota(local.begin(), local.end(), 3);
  ASSERT_OK(
      target.RegisterLocalMemory(remote.data(), remote.size(), "cpu:0", true));
  ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size()));
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, initiator.OpenSegment("v6-target"));
  ASSERT_OK_AND_ASSIGN(
      BatchStatus st,
      RunBatch(initiator, {ReqTo(OpCode::kWrite, seg, local.data(),
                                 remote.data(), local.size())}));
  EXPECT_EQ(st.completed, 1u);
  EXPECT_EQ(remote, local);
}

TEST(EngineInitTest, BadAddressesAreRefusedNamingTheOption) {
  for (const auto& [listen, advertise, field] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"", "0.0.0.0", "advertise_host"},
           {"", "::", "advertise_host"},
           {"", "no-such-host.invalid", "advertise_host"},
           {"a:b:c", "", "listen_host"},
           {"no-such-host.invalid", "", "listen_host"},
           {"192.0.2.1", "", "192.0.2.1"},  // Not ours: cannot bind.
       }) {
    TransferEngine e;
    EngineOptions o = Named("bad", listen);
    o.advertise_host = advertise;
    absl::Status s = e.Init(o);
    EXPECT_FALSE(s.ok()) << listen << " / " << advertise;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  }
  // A metadata service named by host name is resolved once, at Init.
  TransferEngine md, e, bad;
  EngineOptions mo = Named("md", "127.0.0.1");
  ASSERT_OK(md.Init(mo));
  ASSERT_OK_AND_ASSIGN(HostPort hp, ParseHostPort(md.metadata_address()));
  EngineOptions o = Named("named", "127.0.0.1");
  o.metadata_endpoint = JoinHostPort("localhost", hp.port);
  ASSERT_OK(e.Init(o));
  EXPECT_OK(e.OpenSegment("md").status());
  o.local_segment_name = "unnamed";
  o.metadata_endpoint = "no-such-host.invalid:1";
  absl::Status s = bad.Init(o);
  EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("metadata_endpoint"), std::string::npos) << s;
}

// A target that advertises loopback is reachable from its own host, and
// refused with the fix from a peer that is not (here: a descriptor that
// says it was published from elsewhere).
TEST(EngineInitTest, LoopbackFromAnotherHostFailsOpenSegmentSayingSo) {
  TransferEngine md;
  EngineOptions mo = Named("md", "127.0.0.1");
  ASSERT_OK(md.Init(mo));
  metadata::MetadataClient client(md.metadata_address(), absl::Seconds(2));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d, client.Get("md"));
  d.set_name("elsewhere");
  d.set_network_id("another-boot/net:1");
  d.clear_version();
  ASSERT_OK(client.Put(metadata::LeasedPutOf(d)).status());
  ASSERT_OK(md.OpenSegment("md").status());  // Same host: fine.
  auto h = md.OpenSegment("elsewhere");
  EXPECT_STATUS(h, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(h.status().message().find("loopback address 127.0.0.1"),
            std::string::npos)
      << h.status();
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// An engine shut down and initialized again starts clean: registrations
// made before went with the transports that held them (found in review:
// they stayed, with handles of destroyed transports).
TEST(EngineInitTest, ReinitAfterShutdownStartsClean) {
  std::vector<uint8_t> remote(1 << 16, 0), local(1 << 16, 9);
  TransferEngine target, initiator;
  ASSERT_OK(target.Init(Named("reinit-target")));
  ASSERT_OK(target.RegisterLocalMemory(remote.data(), remote.size()));
  EngineOptions i = Joining("reinit-initiator", target);
  for (int round = 0; round < 2; ++round) {
    ASSERT_OK(initiator.Init(i)) << round;
    // The same range again: the earlier registration must be gone.
    ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size()))
        << round;
    ASSERT_OK_AND_ASSIGN(SegmentHandle seg,
                         initiator.OpenSegment("reinit-target"));
    ASSERT_OK_AND_ASSIGN(BatchId b, initiator.AllocateBatch(1));
    TransferRequest r{OpCode::kWrite, local.data(), seg,
                      reinterpret_cast<uint64_t>(remote.data()), 4096};
    ASSERT_OK(initiator.SubmitTransfer(b, {r}));
    ASSERT_OK_AND_ASSIGN(BatchStatus st,
                         initiator.WaitBatch(b, absl::Seconds(10)));
    EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
    EXPECT_OK(initiator.FreeBatch(b));
    initiator.Shutdown();
  }
  EXPECT_EQ(remote[4095], 9);
}

}  // namespace
}  // namespace ferry
