// Runs the real gRPC metadata and peer services on loopback.
#include "metadata/metadata_service.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/mutex.h"
#include "common/simulated_clock.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "grpcpp/create_channel_posix.h"
#include "gtest/gtest.h"
#include "metadata/auth.h"
#include "metadata/forward_watch.h"
#include "metadata/metadata_client.h"
#include "metadata/peer_service.h"
#include "metadata/rpc_server.h"
#include "metadata/store_testing.h"
#include "metadata/validation.h"

namespace ferry::metadata {
namespace {

class MetadataServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = RpcServer::Start("127.0.0.1:0", {&service_, &peer_});
    ASSERT_OK(server);
    server_ = std::move(*server);
    client_ =
        std::make_unique<MetadataClient>(server_->address(), absl::Seconds(5));
  }

  MetadataServiceImpl service_;
  PeerServiceImpl peer_;
  std::unique_ptr<RpcServer> server_;
  std::unique_ptr<MetadataClient> client_;
};

// A stream the service ends (here: its first event is over the byte
// budget) reaches the watcher as "gone", so an engine reads the segment
// again instead of keeping what it last heard for good.
TEST_F(MetadataServiceTest, AWatchTheServiceEndsSaysGone) {
  descriptor::SegmentDescriptor seg;
  seg.set_name("ends");
  seg.set_incarnation(5);
  ASSERT_OK(client_->Put(LeasedPutOf(seg)));
  service_.SetWatchByteLimitsForTesting(1, 1);
  Mutex mu;
  CondVar cv;
  int gone = 0, other = 0;
  ASSERT_OK_AND_ASSIGN(
      auto watch, client_->WatchSegment("ends", 0, [&](const SegmentEvent& ev) {
        MutexLock lock(&mu);
        ++(ev.gone() ? gone : other);
        cv.SignalAll();
      }));
  {
    MutexLock lock(&mu);
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (gone == 0 && !cv.WaitWithDeadline(&mu, end)) {
    }
    EXPECT_EQ(gone, 1);
    EXPECT_EQ(other, 0);
  }
  watch.reset();  // Our own cancel says nothing more.
  MutexLock lock(&mu);
  EXPECT_EQ(gone, 1);
}

// A server serves 32 streams per connection and gRPC queues a call beyond
// them until a stream ends: watches that shared the unary calls'
// connection (or another client's, gRPC merging equal channels of one
// process) held every later call until its deadline once 32 were open --
// an engine that opened 32 segments could no longer renew its lease.
TEST_F(MetadataServiceTest, ManyWatchesLeaveUnaryCallsFree) {
  constexpr int kWatches = 2 * MetadataClient::kWatchesPerConnection + 9;
  static_assert(kWatches > 32);  // RpcServerOptions' default stream cap.
  MetadataClient other(server_->address(), absl::Seconds(2));
  std::vector<std::unique_ptr<Watch>> watches;
  for (int i = 0; i < kWatches; ++i) {
    descriptor::SegmentDescriptor seg;
    seg.set_name(absl::StrCat("w", i));
    seg.set_incarnation(1);
    ASSERT_OK(client_->Put(LeasedPutOf(seg)));
    for (MetadataClient* c : {client_.get(), &other}) {
      ASSERT_OK_AND_ASSIGN(
          auto w, c->WatchSegment(seg.name(), 0, [](const SegmentEvent&) {}));
      watches.push_back(std::move(w));
    }
  }
  // Every watch's stream is open at the service before the calls below.
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (service_.WatchesForTesting() < 2 * kWatches && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(service_.WatchesForTesting(), 2 * kWatches);
  // Held behind the streams, these would end DeadlineExceeded.
  for (MetadataClient* c : {client_.get(), &other}) {
    EXPECT_OK(c->Get("w0"));
    EXPECT_OK(c->List());
  }
  watches.clear();
}

TEST_F(MetadataServiceTest, RoundTrip) {
  descriptor::SegmentDescriptor seg;
  seg.set_name("engine-a");
  seg.set_incarnation(42);
  auto* t = seg.add_transports();
  t->set_transport("tcp");
  t->set_address("127.0.0.1:5000");
  auto v = client_->Put(LeasedPutOf(seg));
  ASSERT_OK(v);
  auto got = client_->Get("engine-a");
  ASSERT_OK(got);
  EXPECT_EQ(got->transports(0).address(), "127.0.0.1:5000");
  auto names = client_->List();
  ASSERT_OK(names);
  EXPECT_EQ(names->size(), 1u);
  EXPECT_OK(client_->Remove(RemoveOf("engine-a", 42)));
  auto gone = client_->Get("engine-a");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("engine-a"), std::string::npos);
}

// WatchSegment pushes the whole descriptor first, then each change as a
// delta, then `gone`; a watcher that is up to date gets nothing first.
TEST_F(MetadataServiceTest, WatchPushesChanges) {
  descriptor::SegmentDescriptor seg;
  seg.set_name("w");
  seg.set_incarnation(3);
  ASSERT_OK_AND_ASSIGN(uint64_t v0, client_->Put(LeasedPutOf(seg)));
  Mutex mu;
  CondVar cv;
  std::vector<SegmentEvent> events;
  auto collect = [&](const SegmentEvent& ev) {
    MutexLock lock(&mu);
    events.push_back(ev);
    cv.SignalAll();
  };
  auto wait_for = [&](size_t n) {
    MutexLock lock(&mu);
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (events.size() < n && !cv.WaitWithDeadline(&mu, end)) {
    }
    return events.size();
  };
  ASSERT_OK_AND_ASSIGN(auto watch, client_->WatchSegment("w", 0, collect));
  ASSERT_OK_AND_ASSIGN(auto current,
                       client_->WatchSegment("w", v0, [](auto&) {}));
  ASSERT_EQ(wait_for(1), 1u);
  UpdateBuffersRequest add;
  add.set_name("w");
  add.set_owner_key(TestOwnerKey(3));
  descriptor::Buffer* b = add.add_add();
  b->set_addr(0x5000);
  b->set_length(0x100);
  b->set_location("cpu:0");
  ASSERT_OK_AND_ASSIGN(uint64_t v1, client_->UpdateBuffers(add));
  ASSERT_EQ(wait_for(2), 2u);
  UpdateBuffersRequest rm;
  rm.set_name("w");
  rm.set_owner_key(TestOwnerKey(3));
  rm.add_remove_addrs(0x5000);
  ASSERT_OK(client_->UpdateBuffers(rm));
  ASSERT_EQ(wait_for(3), 3u);
  ASSERT_OK(client_->Remove(RemoveOf("w", 3)));
  ASSERT_EQ(wait_for(4), 4u);
  MutexLock lock(&mu);
  EXPECT_TRUE(events[0].has_full());
  EXPECT_EQ(events[0].version(), v0);
  EXPECT_FALSE(events[1].has_full());
  EXPECT_EQ(events[1].version(), v1);
  ASSERT_EQ(events[1].add_size(), 1);
  EXPECT_EQ(events[1].add(0).addr(), 0x5000u);
  EXPECT_EQ(events[2].remove_addrs_size(), 1);
  EXPECT_TRUE(events[3].gone());
}

// The service's own table keeps leases on the clock it was given (an
// engine's embedded service: the engine's clock), to the moment.
TEST(MetadataServiceClockTest, LeasesRunOnTheServiceClock) {
  SimulatedClock clock;
  MetadataServiceImpl service(&clock);
  ASSERT_OK_AND_ASSIGN(auto server,
                       RpcServer::Start("127.0.0.1:0", {&service}));
  MetadataClient client(server->address(), absl::Seconds(5));
  descriptor::SegmentDescriptor seg;
  seg.set_name("leased");
  seg.set_incarnation(1);
  const absl::Duration lease = absl::Seconds(10);
  ASSERT_OK(client.Put(LeasedPutOf(seg, lease)));
  clock.Advance(lease - absl::Milliseconds(1));
  EXPECT_OK(client.Get("leased"));
  ASSERT_OK_AND_ASSIGN(absl::Duration ttl,
                       client.KeepAlive(KeepAliveOf("leased", 1)));
  EXPECT_EQ(ttl, lease);
  clock.Advance(lease - absl::Milliseconds(1));
  EXPECT_OK(client.Get("leased")) << "the renewal counts from when it came";
  clock.Advance(absl::Milliseconds(1));
  EXPECT_STATUS(client.Get("leased"), absl::StatusCode::kNotFound);
  EXPECT_STATUS(client.KeepAlive(KeepAliveOf("leased", 1)),
                absl::StatusCode::kNotFound);
  server->Shutdown();
}

// With a token, the metadata and peer services answer nothing else: a
// call without it, or with another, is UNAUTHENTICATED and changes nothing.
TEST(MetadataServiceAuthTest, CallsWithoutTheTokenAreRefused) {
  const std::string token = "cluster-secret-0123456789";
  MetadataServiceImpl service;
  PeerServiceImpl peer;
  service.SetAuthToken(token);
  peer.SetAuthToken(token);
  std::atomic<int> notified{0};  // Written on a gRPC thread.
  peer.SetNotifyHandler([&](const NotifyRequest&, const std::string&) {
    ++notified;
    return absl::OkStatus();
  });
  ASSERT_OK_AND_ASSIGN(auto server,
                       RpcServer::Start("127.0.0.1:0", {&service, &peer}));
  descriptor::SegmentDescriptor seg;
  seg.set_name("guarded");
  seg.set_incarnation(1);
  KeepAliveRequest keep;
  keep.set_name("guarded");
  keep.set_incarnation(1);
  keep.set_owner_key(TestOwnerKey(1));
  UpdateBuffersRequest update;
  update.set_name("guarded");
  update.set_incarnation(1);
  update.set_owner_key(TestOwnerKey(1));
  update.add_remove_addrs(0x1000);
  // Watches of callers without the token: written on gRPC's threads.
  std::atomic<int> stranger_events{0};
  std::vector<std::unique_ptr<Watch>> stranger_watches;
  for (const std::string& wrong :
       {std::string(), std::string("guess-guess-guess-1"), token + "x"}) {
    MetadataClient c(server->address(), absl::Seconds(3), wrong);
    EXPECT_STATUS(c.Put(LeasedPutOf(seg)), absl::StatusCode::kUnauthenticated);
    EXPECT_STATUS(c.Get("guarded"), absl::StatusCode::kUnauthenticated);
    EXPECT_STATUS(c.List(), absl::StatusCode::kUnauthenticated);
    EXPECT_STATUS(c.Remove(RemoveOf("guarded", 1)),
                  absl::StatusCode::kUnauthenticated);
    EXPECT_STATUS(c.KeepAlive(keep), absl::StatusCode::kUnauthenticated);
    EXPECT_STATUS(c.UpdateBuffers(update), absl::StatusCode::kUnauthenticated);
    // A watch's refusal ends its stream: it must never see the segment
    // (the end itself reaches the watcher as "gone").
    auto watch = c.WatchSegment("guarded", 0, [&](const SegmentEvent& ev) {
      if (!ev.gone()) ++stranger_events;
    });
    if (watch.ok()) stranger_watches.push_back(std::move(*watch));
    PeerClient p(absl::Seconds(3), PeerClient::kMaxStubs, wrong);
    EXPECT_STATUS(p.Notify(server->address(), "x", "kv-ready", "m", "", 0),
                  absl::StatusCode::kUnauthenticated);
    EXPECT_STATUS(p.Exchange(server->address(), "rdma", "x", "hello"),
                  absl::StatusCode::kUnauthenticated);
    // Before the peer service looks for a descriptor source (it has none
    // here, which would answer UNIMPLEMENTED).
    EXPECT_STATUS(p.GetDescriptor(server->address(), "guarded"),
                  absl::StatusCode::kUnauthenticated);
  }
  EXPECT_EQ(notified, 0);
  MetadataClient ok(server->address(), absl::Seconds(3), token);
  ASSERT_OK_AND_ASSIGN(auto names, ok.List());
  EXPECT_TRUE(names.empty()) << "a refused Put stored nothing";
  // The token holder's watch sees the segment appear; the strangers'
  // watches, opened before it, see nothing.
  Mutex mu;
  CondVar cv;
  int events = 0;
  ASSERT_OK_AND_ASSIGN(auto watch,
                       ok.WatchSegment("guarded", 0, [&](const SegmentEvent&) {
                         MutexLock lock(&mu);
                         ++events;
                         cv.SignalAll();
                       }));
  ASSERT_OK(ok.Put(LeasedPutOf(seg)));
  {
    MutexLock lock(&mu);
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (events == 0 && !cv.WaitWithDeadline(&mu, end)) {
    }
    ASSERT_GE(events, 1) << "the token holder's watch saw no event";
  }
  // A round trip more, for any event to a stranger to have come too.
  EXPECT_OK(ok.Get("guarded"));
  EXPECT_OK(ok.KeepAlive(keep));
  EXPECT_EQ(stranger_events, 0);
  PeerClient p(absl::Seconds(3), PeerClient::kMaxStubs, token);
  EXPECT_OK(p.Notify(server->address(), "x", "kv-ready", "m", "", 0));
  EXPECT_EQ(notified, 1);
  watch.reset();
  stranger_watches.clear();
  server->Shutdown();
}

// A segment with no lease stays until removed, so an open service
// refuses one: a probe's lease_ttl_ms=0 Put of a name made the real
// engine's Init fail ALREADY_EXISTS for ever. With a token it is allowed.
TEST(MetadataServiceAuthTest, NoLeaseNeedsAToken) {
  MetadataServiceImpl open;
  ASSERT_OK_AND_ASSIGN(auto open_server,
                       RpcServer::Start("127.0.0.1:0", {&open}));
  MetadataClient anyone(open_server->address(), absl::Seconds(3));
  auto squat = anyone.Put(
      LeasedPutOf(TestSegment("prefill-0", 1, 1), absl::ZeroDuration()));
  EXPECT_STATUS(squat, absl::StatusCode::kPermissionDenied);
  EXPECT_NE(squat.status().message().find("lease_ttl_ms=0"), std::string::npos)
      << squat.status();
  EXPECT_STATUS(anyone.Get("prefill-0"), absl::StatusCode::kNotFound);
  EXPECT_OK(anyone.Put(LeasedPutOf(TestSegment("prefill-0", 2, 1))));

  const std::string token = "no-lease-test-token-0123";
  MetadataServiceImpl guarded;
  guarded.SetAuthToken(token);
  ASSERT_OK_AND_ASSIGN(auto guarded_server,
                       RpcServer::Start("127.0.0.1:0", {&guarded}));
  MetadataClient member(guarded_server->address(), absl::Seconds(3), token);
  EXPECT_OK(member.Put(
      LeasedPutOf(TestSegment("static", 3, 1), absl::ZeroDuration())));
}

// Quotas are per client address as the connection shows it: new
// connections do not give a client a fresh quota.
TEST(MetadataServiceQuotaTest, ClientQuotaHoldsAcrossConnections) {
  SegmentStore store;
  SegmentStore::Limits limits;
  limits.max_client_segments = 3;
  store.SetLimits(limits);
  MetadataServiceImpl service(&store);
  ASSERT_OK_AND_ASSIGN(auto server,
                       RpcServer::Start("127.0.0.1:0", {&service}));
  for (int i = 0; i < 4; ++i) {
    MetadataClient fresh(server->address(), absl::Seconds(3));  // New channel.
    auto v =
        fresh.Put(LeasedPutOf(TestSegment(absl::StrCat("q", i), i + 1, 1)));
    if (i < 3) {
      EXPECT_OK(v) << i;
    } else {
      EXPECT_STATUS(v, absl::StatusCode::kResourceExhausted);
      EXPECT_NE(v.status().message().find("ipv4:127.0.0.1"), std::string::npos)
          << v.status();
    }
  }
  server->Shutdown();
}

TEST_F(MetadataServiceTest, MalformedRequestsGetErrorsAndServerSurvives) {
  descriptor::SegmentDescriptor bad;
  bad.set_name("bad name");
  EXPECT_EQ(client_->Put(LeasedPutOf(bad)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Get("").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Oversized: 40 MiB of location strings exceeds the 32 MiB message cap.
  descriptor::SegmentDescriptor huge;
  huge.set_name("huge");
  for (int i = 0; i < 700; ++i) {
    descriptor::Buffer* b = huge.add_buffers();
    b->set_addr(static_cast<uint64_t>(i) << 20);
    b->set_length(1);
    b->set_location(std::string(60 << 10, 'x'));
  }
  auto s = client_->Put(LeasedPutOf(huge)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Still serving.
  descriptor::SegmentDescriptor ok;
  ok.set_name("ok");
  EXPECT_OK(client_->Put(LeasedPutOf(ok)));
}

// A second server on a port in use fails, instead of sharing the port
// (SO_REUSEPORT) and receiving part of the first one's connections.
TEST_F(MetadataServiceTest, ASecondServerCannotTakeTheSamePort) {
  MetadataServiceImpl other;
  auto second = RpcServer::Start(server_->address(), {&other});
  EXPECT_STATUS(second, absl::StatusCode::kUnavailable);
  // The first still answers everything itself.
  for (int i = 0; i < 20; ++i) {
    metadata::MetadataClient fresh(server_->address(), absl::Seconds(3));
    EXPECT_OK(fresh.List());
  }
}

TEST_F(MetadataServiceTest, PeerExchangeAndNotify) {
  peer_.SetExchangeHandler(
      "echo",
      [](const std::string& from,
         const std::string& payload) -> absl::StatusOr<std::string> {
        if (payload == "fail") return absl::InternalError("asked to fail");
        return from + ":" + payload;
      });
  // Written on a gRPC thread: the RPC's reply orders it before the reads
  // below, but through gRPC's own synchronization, which ThreadSanitizer
  // cannot see; the lock makes the order explicit.
  Mutex mu;
  std::string got_name, got_msg;
  peer_.SetNotifyHandler([&](const NotifyRequest& r, const std::string&) {
    MutexLock lock(&mu);
    got_name = r.name();
    got_msg = r.message();
    return absl::OkStatus();
  });
  PeerClient peer(absl::Seconds(5));
  auto r = peer.Exchange(server_->address(), "echo", "me", "hi");
  ASSERT_OK(r);
  EXPECT_EQ(*r, "me:hi");
  EXPECT_EQ(
      peer.Exchange(server_->address(), "echo", "me", "fail").status().code(),
      absl::StatusCode::kInternal);
  EXPECT_EQ(
      peer.Exchange(server_->address(), "rdma", "me", "x").status().code(),
      absl::StatusCode::kUnimplemented);
  ASSERT_OK(peer.Notify(server_->address(), "me", "done", "42", "", 0));
  {
    MutexLock lock(&mu);
    EXPECT_EQ(got_name, "done");
    EXPECT_EQ(got_msg, "42");
  }
  EXPECT_EQ(peer.Notify(server_->address(), "me", "n",
                        std::string(kMaxNotifyMessageBytes + 1, 'x'), "", 0)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// An Exchange for a transport the engine does not run is refused before
// the sender is checked (which may read the metadata service: a stranger
// must not get that for free); for one it runs, the check comes before the
// transport sees anything.
TEST_F(MetadataServiceTest, ExchangeLooksUpTheTransportBeforeTheSender) {
  std::atomic<int> handled{0}, checks{0};
  peer_.SetExchangeHandler(
      "echo",
      [&](const std::string&,
          const std::string& payload) -> absl::StatusOr<std::string> {
        ++handled;
        return payload;
      });
  peer_.SetSenderVerifier([&](const std::string&, const std::string&,
                              const std::string&, const std::string&,
                              uint64_t) {
    ++checks;
    return absl::PermissionDeniedError("not you");
  });
  PeerClient peer(absl::Seconds(5));
  absl::Status s =
      peer.Exchange(server_->address(), "rdma", "me", "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_EQ(checks.load(), 0) << "checked the sender of a useless Exchange";
  s = peer.Exchange(server_->address(), "echo", "me", "x").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(checks.load(), 1);
  EXPECT_EQ(handled.load(), 0) << "the transport saw an unchecked Exchange";
}

// A receiver that cannot check the sender now answers "retry later": the
// client sends the Exchange again, past its RPC timeout while the receiver
// keeps answering so (a handshake must not fail on a busy receiver: a
// storm of them, bench/storm_bench); any other refusal is final.
TEST_F(MetadataServiceTest, CallsAreSentAgainWhenTheReceiverSaysRetryLater) {
  peer_.SetExchangeHandler(
      "echo",
      [](const std::string& from, const std::string& payload)
          -> absl::StatusOr<std::string> { return payload; });
  std::atomic<int> checks{0};
  std::atomic<int> busy_for{3};
  peer_.SetSenderVerifier([&](const std::string& claimed, const std::string&,
                              const std::string&, const std::string&,
                              uint64_t) {
    ++checks;
    if (claimed == "spoofer") return absl::PermissionDeniedError("not you");
    if (busy_for.fetch_sub(1) > 0) {
      return absl::UnavailableError("sender lookups busy");
    }
    return absl::OkStatus();
  });
  PeerClient peer(absl::Seconds(5));
  auto r = peer.Exchange(server_->address(), "echo", "me", "hi");
  ASSERT_OK(r);
  EXPECT_EQ(*r, "hi");
  EXPECT_EQ(checks.load(), 4);
  checks = 0;
  EXPECT_EQ(
      peer.Exchange(server_->address(), "echo", "spoofer", "x").status().code(),
      absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(checks.load(), 1);
  // Busy for longer than one RPC timeout (1 s), answering "retry later".
  std::atomic<int64_t> busy_until_ns{
      absl::ToUnixNanos(absl::Now() + absl::Milliseconds(1500))};
  peer_.SetSenderVerifier([&](const std::string&, const std::string&,
                              const std::string&, const std::string&,
                              uint64_t) {
    return absl::ToUnixNanos(absl::Now()) < busy_until_ns.load()
               ? absl::UnavailableError("sender lookups busy")
               : absl::OkStatus();
  });
  PeerClient patient(absl::Seconds(1));
  EXPECT_OK(patient.Exchange(server_->address(), "echo", "me", "hi"));
  // An engine shutting down (EndPatience) gives a busy receiver one RPC
  // timeout: its farewells must not hold the shutdown.
  // (Patient, it would be answered once the 3 s are over.)
  busy_until_ns = absl::ToUnixNanos(absl::Now() + absl::Seconds(3));
  PeerClient leaving(absl::Milliseconds(500));
  leaving.EndPatience();
  EXPECT_EQ(
      leaving.Exchange(server_->address(), "echo", "me", "hi").status().code(),
      absl::StatusCode::kUnavailable);
  busy_until_ns = 0;
  // Notify too, numbered anew on each try (a receiver that found a number
  // too old asks for a new one).
  Mutex mu;
  std::vector<uint64_t> seqs;
  peer_.SetNotifyHandler([&](const NotifyRequest& r, const std::string&) {
    MutexLock lock(&mu);
    seqs.push_back(r.seq());
    return seqs.size() < 3
               ? MarkRetryLater(absl::UnavailableError("sender lookups busy"))
               : absl::OkStatus();
  });
  ASSERT_OK(peer.Notify(server_->address(), "me", "n", "m", "", 0));
  MutexLock lock(&mu);
  ASSERT_EQ(seqs.size(), 3u);
  EXPECT_LT(seqs[0], seqs[1]);
  EXPECT_LT(seqs[1], seqs[2]);
}

// A store with no in-memory table, so that the service forwards its
// watches (ForwardWatchReactor), as a metadata_server on etcd does. Each
// watch is pushed `pushes` whole descriptors of `bytes` of location text
// at once, before WatchSegment returns (the reactor takes pushes from its
// construction on, as it must from etcd's thread).
class PushingStore final : public Store {
 public:
  PushingStore(int pushes, size_t bytes) : pushes_(pushes), bytes_(bytes) {}

  absl::StatusOr<uint64_t> Put(const PutSegmentRequest&) override {
    return Unimplemented();
  }
  absl::StatusOr<absl::Duration> KeepAlive(const KeepAliveRequest&) override {
    return Unimplemented();
  }
  absl::StatusOr<uint64_t> UpdateBuffers(const UpdateBuffersRequest&) override {
    return Unimplemented();
  }
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string&) override {
    return Unimplemented();
  }
  absl::Status Remove(const RemoveSegmentRequest&) override {
    return Unimplemented();
  }
  absl::StatusOr<std::vector<std::string>> List() override {
    return Unimplemented();
  }
  std::string Describe() const override { return "pushing"; }
  absl::StatusOr<std::unique_ptr<Watch>> WatchSegment(const std::string& name,
                                                      uint64_t,
                                                      EventFn fn) override {
    SegmentEvent ev;
    ev.set_version(1);
    ev.mutable_full()->set_name(name);
    if (bytes_ > 0) {
      ev.mutable_full()->add_buffers()->set_location(std::string(bytes_, 'x'));
    }
    for (int i = 0; i < pushes_; ++i) fn(ev);
    return std::make_unique<Watch>();
  }

 private:
  static absl::Status Unimplemented() {
    return absl::UnimplementedError("PushingStore only watches");
  }
  const int pushes_;
  const size_t bytes_;
};

// A gRPC channel over a connection made from `source_ip` (any 127/8
// address is this host), so that a test calls from an address of its
// choice (as rpc_server_test does); null if it cannot connect. It lets in
// no more of a stream than the initial HTTP/2 window (64 KiB) until the
// stream is read: without BDP probing, which widens the window as data
// comes, a stream left unread keeps a large event in the service, as a
// client that stopped reading does.
std::unique_ptr<MetadataService::Stub> StubFrom(const std::string& source_ip,
                                                uint16_t port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in src{};
  src.sin_family = AF_INET;
  ::inet_pton(AF_INET, source_ip.c_str(), &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(port);
  dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (!fd.valid() ||
      ::bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
      ::connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) !=
          0) {
    return nullptr;
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  return MetadataService::NewStub(grpc::CreateCustomInsecureChannelFromFd(
      "ferry-test", fd.Release(), args));
}

// The watch streams one address holds, as the engines of one host would:
// a new connection every kStreamsPerConnection streams, within the
// server's limit of concurrent streams per connection
// (RpcServerOptions::max_streams_per_connection), so that none waits for
// a stream of its connection to end.
class Watcher {
 public:
  static constexpr int kStreamsPerConnection = 32;

  // Its calls carry `token` (none if empty).
  Watcher(std::string source_ip, uint16_t port, std::string token)
      : source_ip_(std::move(source_ip)),
        port_(port),
        token_(std::move(token)) {}
  ~Watcher() {
    while (!streams_.empty()) EndOne();
  }

  // Opens a watch: OK once its first event came (the service took it),
  // else the status the service ended it with.
  grpc::Status Open() {
    std::unique_ptr<Stream> stream = Start();
    if (stream == nullptr) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "cannot connect from " + source_ip_);
    }
    SegmentEvent first;
    if (!stream->reader->Read(&first)) return stream->reader->Finish();
    streams_.push_back(std::move(stream));
    return grpc::Status::OK;
  }

  // Opens a watch and never reads it, as a client that stopped reading
  // does. False if it cannot connect.
  bool OpenUnread() {
    std::unique_ptr<Stream> stream = Start();
    if (stream == nullptr) return false;
    streams_.push_back(std::move(stream));
    return true;
  }

  // Ends the oldest watch it holds, as a client that goes away does.
  void EndOne() {
    streams_.front()->ctx.TryCancel();
    streams_.front()->reader->Finish();
    streams_.pop_front();
  }

 private:
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<SegmentEvent>> reader;
  };

  // Starts a watch of "watched"; null if it cannot connect.
  std::unique_ptr<Stream> Start() {
    if (stubs_.empty() || opened_on_last_ == kStreamsPerConnection) {
      stubs_.push_back(StubFrom(source_ip_, port_));
      opened_on_last_ = 0;
    }
    if (stubs_.back() == nullptr) return nullptr;
    ++opened_on_last_;
    auto stream = std::make_unique<Stream>();
    AddAuthToken(&stream->ctx, token_);
    // Bounds the test if the service never answers.
    stream->ctx.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::seconds(30));
    WatchSegmentRequest request;
    request.set_name("watched");
    stream->reader = stubs_.back()->WatchSegment(&stream->ctx, request);
    return stream;
  }

  const std::string source_ip_;
  const uint16_t port_;
  const std::string token_;
  // Streams before stubs: a stream ends before its channel goes.
  std::vector<std::unique_ptr<MetadataService::Stub>> stubs_;
  std::deque<std::unique_ptr<Stream>> streams_;
  int opened_on_last_ = 0;
};

// Watches served from the store's table (memory, durable) and forwarded
// from a store that pushes (etcd) are counted in the same place.
enum class WatchPath { kTable, kForwarded };

class WatchShareTest : public ::testing::TestWithParam<WatchPath> {
 protected:
  static constexpr int kShare = MetadataServiceImpl::kMaxWatchesPerCaller;
  static constexpr char kToken[] = "watch-share-test-token-0123456789";

  // A forwarded watch's first event carries `pushed_bytes` of location
  // text.
  explicit WatchShareTest(size_t pushed_bytes = 0)
      : pushing_(1, pushed_bytes) {}

  void SetUp() override {
    service_ = GetParam() == WatchPath::kTable
                   ? std::make_unique<MetadataServiceImpl>()
                   : std::make_unique<MetadataServiceImpl>(&pushing_);
    service_->SetAuthToken(kToken);
    ASSERT_OK_AND_ASSIGN(server_,
                         RpcServer::Start("127.0.0.1:0", {service_.get()}));
  }

  // Opens a caller's whole share of watches.
  void TakeTheShare(Watcher* host) {
    for (int i = 0; i < kShare; ++i) {
      grpc::Status s = host->Open();
      ASSERT_TRUE(s.ok()) << "watch " << i << ": " << s.error_message();
    }
  }

  PushingStore pushing_;
  std::unique_ptr<MetadataServiceImpl> service_;
  std::unique_ptr<RpcServer> server_;  // Shut down first.
};

// One address held every watch stream of the service (4,096), each with a
// copy of its descriptor, and no new engine could watch. Now it holds its
// share, refused past it with what it holds, while another address is
// still served.
TEST_P(WatchShareTest, OneAddressHoldsAtMostItsShare) {
  Watcher host("127.0.0.1", server_->port(), kToken);
  ASSERT_NO_FATAL_FAILURE(TakeTheShare(&host));
  grpc::Status refused = host.Open();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.error_message();
  EXPECT_NE(refused.error_message().find("ipv4:127.0.0.1"), std::string::npos)
      << refused.error_message();
  EXPECT_NE(refused.error_message().find(absl::StrCat("holds ", kShare)),
            std::string::npos)
      << refused.error_message();
  Watcher other("127.0.0.2", server_->port(), kToken);
  grpc::Status admitted = other.Open();
  EXPECT_TRUE(admitted.ok()) << admitted.error_message();
}

// A watch that ends gives its slot back (once gRPC is done with it), and
// only its own: the share is full again after as many new ones.
TEST_P(WatchShareTest, EndedWatchesGiveTheirSlotsBack) {
  Watcher host("127.0.0.1", server_->port(), kToken);
  ASSERT_NO_FATAL_FAILURE(TakeTheShare(&host));
  ASSERT_EQ(host.Open().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  constexpr int kEnded = 2;
  for (int i = 0; i < kEnded; ++i) host.EndOne();
  // The service releases a slot in the stream's OnDone, a moment after the
  // client's Finish: a refused try takes nothing, so try again.
  int reopened = 0;
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (reopened < kEnded && absl::Now() < end) {
    if (host.Open().ok()) {
      ++reopened;
    } else {
      absl::SleepFor(absl::Milliseconds(1));  // Retry pace, not ordering.
    }
  }
  EXPECT_EQ(reopened, kEnded);
  EXPECT_EQ(host.Open().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "more slots came back than watches ended";
}

// The token check comes first: watches refused UNAUTHENTICATED take no
// share of their address, so a stranger on an engine's host cannot use up
// the engine's watches.
TEST_P(WatchShareTest, CallsWithoutTheTokenTakeNoShare) {
  Watcher stranger("127.0.0.1", server_->port(), /*token=*/"");
  for (int i = 0; i <= kShare; ++i) {
    grpc::Status s = stranger.Open();
    ASSERT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << "watch " << i << ": " << s.error_message();
  }
  Watcher host("127.0.0.1", server_->port(), kToken);
  ASSERT_NO_FATAL_FAILURE(TakeTheShare(&host));
  EXPECT_EQ(host.Open().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

std::string PathName(const ::testing::TestParamInfo<WatchPath>& info) {
  return info.param == WatchPath::kTable ? "Table" : "Forwarded";
}

INSTANTIATE_TEST_SUITE_P(Paths, WatchShareTest,
                         ::testing::Values(WatchPath::kTable,
                                           WatchPath::kForwarded),
                         PathName);

// A descriptor named `name` that encodes to `bytes` or a little more, in
// buffers a Put accepts (a location is at most 64 bytes).
descriptor::SegmentDescriptor SegmentOfBytes(const std::string& name,
                                             size_t bytes) {
  descriptor::SegmentDescriptor seg;
  seg.set_name(name);
  seg.set_incarnation(1);
  size_t size = 0;
  for (uint64_t i = 1; size < bytes; ++i) {
    descriptor::Buffer* b = seg.add_buffers();
    b->set_addr(i << 20);
    b->set_length(0x1000);
    b->set_location(std::string(descriptor::kMaxLocationBytes, 'l'));
    // Its encoding in the descriptor: a tag, a one-byte length, and it.
    size += 2 + b->ByteSizeLong();
  }
  return seg;
}

// The watches of one caller that does not read, on a segment whose
// descriptor (each watch's first event) encodes to a few MiB, under byte
// limits that two and a half such events reach. Without a byte budget
// each unread stream pinned its copy: 256 streams of a 32 MiB descriptor,
// 8 GiB for one address.
class WatchBytesTest : public WatchShareTest {
 protected:
  static constexpr size_t kEventBytes = size_t{2} << 20;
  static constexpr size_t kCallerBytes = kEventBytes * 5 / 2;
  static constexpr char kHost[] = "ipv4:127.0.0.1";

  WatchBytesTest() : WatchShareTest(kEventBytes) {}

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(WatchShareTest::SetUp());
    service_->SetWatchByteLimitsForTesting(MetadataServiceImpl::kMaxWatchBytes,
                                           kCallerBytes);
    if (GetParam() == WatchPath::kTable) {
      MetadataClient publisher(server_->address(), absl::Seconds(10), kToken);
      ASSERT_OK(
          publisher.Put(LeasedPutOf(SegmentOfBytes("watched", kEventBytes))));
    }
  }

  // Waits (10 s at most) until `done` holds of the bytes the watch streams
  // of `caller` hold in the service, and returns them.
  size_t WaitForHeld(const std::string& caller,
                     const std::function<bool(size_t)>& done,
                     absl::Duration limit = absl::Seconds(10)) {
    const absl::Time end = absl::Now() + limit;
    size_t held = service_->WatchBytesForTesting(caller);
    while (!done(held) && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(1));  // Poll pace, not ordering.
      held = service_->WatchBytesForTesting(caller);
    }
    return held;
  }

  // Opens two watches of `host`'s that it does not read, and returns once
  // the service holds both their events.
  void PinTwoEvents(Watcher* host) {
    ASSERT_TRUE(host->OpenUnread());
    ASSERT_TRUE(host->OpenUnread());
    // Each charged as its stream makes its event: wait for both, so that a
    // watch opened next is the third.
    const size_t held =
        WaitForHeld(kHost, [](size_t held) { return held >= 2 * kEventBytes; });
    ASSERT_GE(held, 2 * kEventBytes);
    ASSERT_LE(held, kCallerBytes);
  }
};

// Two unread watches hold their events; the third watch's event would pass
// the caller's bytes, and its stream ends RESOURCE_EXHAUSTED, naming the
// caller, what it holds and the limit, without taking anything; another
// address is still served. (Without the budget the third is served like
// the others, and 256 of them pin 256 events.)
TEST_P(WatchBytesTest, ACallerThatDoesNotReadPinsAtMostItsBytes) {
  Watcher host("127.0.0.1", server_->port(), kToken);
  ASSERT_NO_FATAL_FAILURE(PinTwoEvents(&host));
  const size_t held = service_->WatchBytesForTesting(kHost);
  grpc::Status refused = host.Open();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.error_message();
  for (const std::string& part :
       {std::string(kHost), absl::StrCat("hold ", held, " bytes"),
        absl::StrCat("limit per caller (", kCallerBytes, ")"),
        std::string("refreshes the segment on a miss")}) {
    EXPECT_NE(refused.error_message().find(part), std::string::npos)
        << part << " not in: " << refused.error_message();
  }
  EXPECT_EQ(service_->WatchBytesForTesting(kHost), held)
      << "a refused event took bytes";
  Watcher other("127.0.0.2", server_->port(), kToken);
  grpc::Status admitted = other.Open();
  EXPECT_TRUE(admitted.ok()) << admitted.error_message();
}

// Watches that end give their events' bytes back, though gRPC never wrote
// those events (the reactor finishes with the write in flight): the
// caller holds nothing once they are over, and pins two events again.
TEST_P(WatchBytesTest, EndedWatchesGiveTheirBytesBack) {
  {
    Watcher host("127.0.0.1", server_->port(), kToken);
    ASSERT_NO_FATAL_FAILURE(PinTwoEvents(&host));
    ASSERT_EQ(host.Open().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }  // Cancels both streams, then closes their connection.
  // Given back in the streams' OnWriteDone, once the service sees them
  // end: at once here, but under TSan it took from 50 ms to over 20 s
  // (12 runs) to fail a write stuck behind flow control, and the bytes
  // always came back. So this waits up to 60 s.
  EXPECT_EQ(
      WaitForHeld(
          kHost, [](size_t held) { return held == 0; }, absl::Seconds(60)),
      0u);
  Watcher again("127.0.0.1", server_->port(), kToken);
  ASSERT_NO_FATAL_FAILURE(PinTwoEvents(&again));
}

INSTANTIATE_TEST_SUITE_P(Paths, WatchBytesTest,
                         ::testing::Values(WatchPath::kTable,
                                           WatchPath::kForwarded),
                         PathName);

// Watches "big" on `address` and reads every event until the stream ends
// (10 s at most: a stream that is not ended stays open that long).
struct WatchedToTheEnd {
  int events = 0;
  grpc::Status status;
};
WatchedToTheEnd WatchToTheEnd(const std::string& address) {
  auto stub = MetadataService::NewStub(MakeChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  WatchSegmentRequest request;
  request.set_name("big");
  auto reader = stub->WatchSegment(&ctx, request);
  WatchedToTheEnd watched;
  SegmentEvent ev;
  while (reader->Read(&ev)) ++watched.events;
  watched.status = reader->Finish();
  return watched;
}

// A forwarded watch whose client does not take its events queued up to
// 256 of them, whatever their size: a watcher of a large segment that
// stopped reading pinned 256 copies of it. Now the queue is capped by
// bytes too, and overflows as it does by count: the stream ends
// RESOURCE_EXHAUSTED after the one event being written. (The store pushes
// every event before the stream can write any: the queue holds them all.)
TEST(ForwardedWatchTest, QueuedEventsAreCappedByBytes) {
  constexpr size_t kEventBytes = size_t{2} << 20;
  constexpr size_t kPushes =
      ForwardWatchReactor::kMaxQueuedBytes / kEventBytes + 8;
  static_assert(kPushes < ForwardWatchReactor::kMaxQueued,
                "the count cap alone would end the stream");
  PushingStore store(static_cast<int>(kPushes), kEventBytes);
  MetadataServiceImpl service(&store);
  ASSERT_OK_AND_ASSIGN(auto server,
                       RpcServer::Start("127.0.0.1:0", {&service}));
  // Without the byte cap every event comes and the stream stays open.
  WatchedToTheEnd watched = WatchToTheEnd(server->address());
  EXPECT_EQ(watched.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << watched.status.error_message();
  EXPECT_EQ(watched.events, 1)
      << "only the event being written outlives the overflow";
  server->Shutdown();
}

// Every event a forwarded stream queues is charged to its caller, not only
// the one being written: a store that pushes faster than the client takes
// ends the stream at the caller's bytes, far below the stream's own cap
// (kMaxQueuedBytes), and the events dropped then give their bytes back,
// as the one being written does once written. (Without the budget all
// four events come and the stream stays open until its deadline.)
TEST(ForwardedWatchTest, QueuedEventsAreChargedToTheirCaller) {
  constexpr size_t kEventBytes = size_t{1} << 20;
  constexpr int kPushes = 4;
  static_assert(kPushes * kEventBytes < ForwardWatchReactor::kMaxQueuedBytes,
                "the stream's own cap would end it");
  PushingStore store(kPushes, kEventBytes);
  MetadataServiceImpl service(&store);
  // Two events and a half: the third push does not fit.
  service.SetWatchByteLimitsForTesting(MetadataServiceImpl::kMaxWatchBytes,
                                       kEventBytes * 5 / 2);
  ASSERT_OK_AND_ASSIGN(auto server,
                       RpcServer::Start("127.0.0.1:0", {&service}));
  WatchedToTheEnd watched = WatchToTheEnd(server->address());
  EXPECT_EQ(watched.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << watched.status.error_message();
  EXPECT_NE(watched.status.error_message().find("ipv4:127.0.0.1"),
            std::string::npos)
      << watched.status.error_message();
  EXPECT_EQ(watched.events, 1)
      << "only the event being written outlives the refusal";
  // Given back when the written event's write is done, which may come a
  // moment after the client has the stream's end.
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (service.WatchBytesForTesting("ipv4:127.0.0.1") != 0 &&
         absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));  // Poll pace, not ordering.
  }
  EXPECT_EQ(service.WatchBytesForTesting("ipv4:127.0.0.1"), 0u);
  server->Shutdown();
}

TEST(MetadataClientTest, UnreachableServerFailsFast) {
  // Nothing listens on port 1 of loopback.
  MetadataClient client("127.0.0.1:1", absl::Seconds(2));
  absl::Time start = absl::Now();
  auto s = client.Get("x").status();
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded)
      << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace ferry::metadata
