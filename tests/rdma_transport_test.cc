// The RDMA transport on its own, on softrnic, with handshakes carried by
// an in-process FakePeerNetwork (no engine, no gRPC), so that faults of
// the control path can be scripted: a refused or silent peer, a notice
// delivered at a chosen moment, peers opened and closed by the thousand.
//
//   - an unreachable peer gets a bounded number of handshakes, and its
//     requests fail fast with one status naming it and the cause;
//   - a handshake with a peer that never answers ends by the deadline;
//   - a DISCONNECT notice is answered at once (the drain runs on the
//     transport's threads, not the caller's);
//   - 1,000 peers opened, used and closed leave peers, endpoints and
//     threads flat;
//   - an idle endpoint whose peer vanished is found by the keepalive;
//   - DEVICE_FATAL and GID_CHANGE async events (softrnic injects them).
//
// The tests of what the transport times (back-off, deadlines, keepalive)
// run it on a SimulatedClock and move time themselves; softrnic (the
// "hardware") and the fake network's RPC timeout stay on real time.
#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/pattern.h"
#include "common/sanitizers.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "testing/process_usage.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/rdma_test_util.h"
#include "transport/softrnic/softrnic_control.h"

namespace ferry::rdma {
namespace {

using ::ferry::testing::WaitUntil;
using testing::FakePeerNetwork;
using testing::TestNode;
using testing::TestSink;

TransportOptions OneNic() {
  TransportOptions o;
  o.rdma.devices = {"softrnic0"};
  o.connect_timeout = absl::Seconds(3);
  return o;
}

// Writes `n` slices of `len` bytes from `from` to `to` and waits for them;
// returns the failures' statuses (empty: all succeeded).
std::vector<absl::Status> WriteAndWait(
    TestNode* from, const TestNode& to, size_t off, size_t len, int n,
    absl::Duration timeout = absl::Seconds(10)) {
  TestSink sink;
  auto slices = from->MakeSlices(to, OpCode::kWrite, off, len, n, &sink);
  from->Submit(&slices);
  std::vector<absl::Status> bad;
  if (!sink.WaitFor(n, timeout + absl::Seconds(5))) {
    bad.push_back(absl::DeadlineExceededError("slices never completed"));
    // The slices live on this stack: the transport must let go of them.
    from->Stop();
    return bad;
  }
  for (const absl::Status& s : sink.statuses()) {
    if (!s.ok()) bad.push_back(s);
  }
  return bad;
}

// Advances `clock` by `d`, then waits (real time, bounded) until the
// `threads` threads timed on it -- the housekeepers of the nodes running
// on it -- have done what fell due and wait for a later time again.
bool Step(SimulatedClock* clock, absl::Duration d, int threads) {
  clock->Advance(d);
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (absl::Now() < end) {
    // In this order: a thread that is due and not yet awake keeps the
    // earliest deadline at now; one that is busy is not counted.
    const std::optional<absl::Time> next = clock->NextDeadline();
    if (next.has_value() && *next > clock->Now() &&
        clock->waiters() >= threads) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

// The housekeeping interval (kHousekeepingInterval, control_plane.h).
constexpr absl::Duration kHousekeeping = absl::Milliseconds(50);

// A handshake names the run of the target it is for, and the Exchange
// signature covers it: one captured, or made up with 0 ("any run", which
// releases before identity keys took), is refused as stale everywhere but
// at that run.
TEST(RdmaTransportTest, HandshakeMustNameTheTargetsRun) {
  FakePeerNetwork net;
  ASSERT_OK_AND_ASSIGN(auto target, TestNode::Start(&net, "t", {}));
  std::unique_ptr<PeerChannel> x = net.Join("x", "x");
  const std::string nic =
      target->view()->descriptor().transports(0).devices(0).name();
  auto connect = [&](uint64_t target_incarnation) {
    RdmaMessage msg;
    ConnectRequest* req = msg.mutable_connect();
    req->set_initiator_segment("x");
    req->set_initiator_incarnation(7);
    req->set_target_incarnation(target_incarnation);
    req->set_initiator_nic(nic);
    req->set_target_nic(nic);
    req->set_rail_epoch(1);
    QpInfo* q = req->add_initiator_qps();
    q->set_nic(nic);
    q->set_qpn(0x100);
    q->set_gid(std::string(16, '\0'));
    q->set_psn(1);
    ConnectReply reply;
    auto bytes = x->Call("t", "rdma", msg.SerializeAsString());
    EXPECT_OK(bytes);
    EXPECT_TRUE(bytes.ok() && reply.ParseFromString(*bytes));
    return reply.result();
  };
  EXPECT_EQ(connect(0), ConnectReply::STALE_INCARNATION);
  EXPECT_EQ(connect(target->incarnation() + 1),
            ConnectReply::STALE_INCARNATION);
  EXPECT_NE(connect(target->incarnation()), ConnectReply::STALE_INCARNATION);
}

TEST(RdmaTransportTest, UnreachablePeerFailsFastWithBoundedHandshakes) {
  // Two NICs each: four rails; the peer is backed off as a whole. Two
  // seconds of the clock, a batch every 10 ms.
  SimulatedClock clock;
  FakePeerNetwork net;
  TransportOptions o;
  ASSERT_OK_AND_ASSIGN(auto target,
                       TestNode::Start(&net, "t", o, 1 << 20, "", &clock));
  ASSERT_OK_AND_ASSIGN(auto init,
                       TestNode::Start(&net, "i", o, 8 << 20, "", &clock));
  net.SetFault("t", FakePeerNetwork::Fault::kRefuse);
  const absl::Time end = clock.Now() + absl::Seconds(2);
  size_t slices = 0;
  std::vector<absl::Status> failures;
  while (clock.Now() < end) {
    TestSink sink;
    auto batch = init->MakeSlices(*target, OpCode::kWrite, 0, 65536, 64, &sink);
    init->Submit(&batch);
    // All done before time moves: a failed handshake is timed now.
    ASSERT_TRUE(sink.WaitFor(batch.size(), absl::Seconds(10)));
    slices += batch.size();
    for (const absl::Status& s : sink.statuses()) failures.push_back(s);
    clock.Advance(absl::Milliseconds(10));
  }
  const TransportStats st = init->stats();
  const int handshakes = net.calls("t");
  // One handshake at first contact (the other rails wait for it, then see
  // the peer backed off), then one probe per backoff period: 50 ms
  // doubling, probes at 50, 150, 350, 750 and 1550 ms within 2 s.
  EXPECT_EQ(handshakes, 1 + 5) << slices << " slices";
  std::printf("%d handshakes, %zu slices, %llu fast failures\n", handshakes,
              slices, static_cast<unsigned long long>(st.fast_failures));
  EXPECT_EQ(failures.size(), slices);
  for (const absl::Status& s : failures) {
    ASSERT_FALSE(s.ok());
    ASSERT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    // Names the peer and the cause.
    ASSERT_TRUE(absl::StrContains(s.message(), "'t'")) << s;
    ASSERT_TRUE(absl::StrContains(s.message(), "connection refused")) << s;
  }
  // Nearly all of them failed without touching the network.
  EXPECT_GE(st.fast_failures, slices - 64 * 10) << st.fast_failures;
  EXPECT_EQ(slices, 200u * 64u);
}

TEST(RdmaTransportTest, HandshakeWithSilentPeerEndsByTheDeadline) {
  // The peer's control path accepts the call and never answers (a stopped
  // process): every slice still ends by its deadline plus the documented
  // bound (the housekeeping interval), and not before its deadline.
  SimulatedClock clock;
  FakePeerNetwork net(/*rpc_timeout=*/absl::Seconds(30));
  ASSERT_OK_AND_ASSIGN(
      auto target, TestNode::Start(&net, "t", OneNic(), 1 << 20, "", &clock));
  ASSERT_OK_AND_ASSIGN(
      auto init, TestNode::Start(&net, "i", OneNic(), 1 << 20, "", &clock));
  net.SetFault("t", FakePeerNetwork::Fault::kSilent);
  TestSink sink;
  const absl::Time deadline = clock.Now() + absl::Seconds(1);
  auto slices = init->MakeSlices(*target, OpCode::kWrite, 0, 4096, 8, &sink,
                                 absl::Seconds(1));
  init->Submit(&slices);
  // Housekeeping runs every 50 ms of the clock, from the nodes' start.
  while (clock.Now() + kHousekeeping < deadline) {
    ASSERT_TRUE(Step(&clock, kHousekeeping, 2));
  }
  EXPECT_EQ(sink.done(), 0u) << "ended before the deadline";
  ASSERT_TRUE(Step(&clock, kHousekeeping, 2));
  EXPECT_EQ(clock.Now(), deadline);
  ASSERT_TRUE(sink.WaitFor(slices.size(), absl::Seconds(10)));
  for (const absl::Status& s : sink.statuses()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  net.SetFault("t", FakePeerNetwork::Fault::kNone);  // Frees the connector.
}

TEST(RdmaTransportTest, DisconnectNoticeIsAnsweredAtOnce) {
  // The target is busy on the rail -- posting slowly (softrnic delays each
  // frame, and posting blocks on it) -- when the initiator's DISCONNECT
  // arrives: the answer must not wait for that work (the handler runs on a
  // gRPC thread in the real engine); the drain is the transport's job.
  FakePeerNetwork net;
  ASSERT_OK_AND_ASSIGN(auto target, TestNode::Start(&net, "t", OneNic()));
  ASSERT_OK_AND_ASSIGN(auto init, TestNode::Start(&net, "i", OneNic()));
  ASSERT_TRUE(WriteAndWait(init.get(), *target, 0, 4096, 1).empty());
  const uint64_t routed = target->stats().nics[0].slices;
  // These tests run on softrnic, whose control calls must work: a
  // failure is a failure, never a skip.
  ASSERT_EQ(softrnic::SetDelayUs("softrnic0", 100000), 0)
      << std::strerror(errno);
  TestSink sink;
  auto work = target->MakeSlices(*init, OpCode::kWrite, 0, 4096, 8, &sink);
  std::thread poster([&] { target->Submit(&work); });
  // The slices are on the endpoint (counted before they are posted).
  ASSERT_TRUE(
      WaitUntil([&] { return target->stats().nics[0].slices >= routed + 8; },
                absl::Seconds(5)));
  RdmaMessage msg;
  RailNotice* n = msg.mutable_notice();
  n->set_kind(RailNotice::DISCONNECT);
  n->set_initiator_segment("i");
  n->set_initiator_incarnation(init->incarnation());
  n->set_initiator_nic("softrnic0");
  n->set_target_nic("softrnic0");
  n->set_epoch(1);  // The rail's first connection.
  auto as_i = net.Join("i", "i-test");
  const absl::Time start = absl::Now();
  auto reply = as_i->Call("t", "rdma", msg.SerializeAsString());
  const absl::Duration took = absl::Now() - start;
  poster.join();
  softrnic::SetDelayUs("softrnic0", 0);
  EXPECT_OK(reply);
  // Waiting for the work would take most of its 8 frames of 100 ms; the
  // bound leaves a loaded CI machine room (it once took over 50 ms there).
  EXPECT_LT(took, absl::Milliseconds(300)) << took;
  // The work still ends, completed where it was or on a new endpoint.
  ASSERT_TRUE(sink.WaitFor(work.size(), absl::Seconds(20)));
  for (const absl::Status& s : sink.statuses()) EXPECT_OK(s);
}

TEST(RdmaTransportTest, ThousandPeersOpenedUsedAndClosedStayFlat) {
  // One initiator opens, uses and closes 1,000 targets in turn (each a new
  // transport with its own segment); a long-lived target serves 1,000
  // initiators in turn the same way. Peer records, endpoints and threads
  // must not grow with the number of peers ever seen. (250 of each under
  // the sanitizers: still four times max_peers past the count at 100.)
  FakePeerNetwork net;
  TransportOptions o = OneNic();
  o.rdma.max_peers = 64;
  ASSERT_OK_AND_ASSIGN(auto hub, TestNode::Start(&net, "hub", o));
  constexpr int kPeers = 1000 / kSanitizerVolumeDivisor;
  int threads_at_100 = 0;
  TransportStats at_100;
  for (int k = 0; k < kPeers; ++k) {
    SCOPED_TRACE(k);
    ASSERT_OK_AND_ASSIGN(auto other,
                         TestNode::Start(&net, absl::StrCat("p", k), o));
    // Even peers are targets of the hub, odd ones initiators to it.
    TestNode* from = k % 2 == 0 ? hub.get() : other.get();
    TestNode* to = k % 2 == 0 ? other.get() : hub.get();
    FillPattern(from->mem(), 4096, 0, k);
    ASSERT_TRUE(WriteAndWait(from, *to, 0, 4096, 1).empty());
    ASSERT_EQ(CheckPattern(to->mem(), 4096, 0, k), 4096u);
    from->transport().ClosePeer(*to->view());
    // The closing side's DISCONNECT reaches the other, which lets go too.
    other->Stop();
    if (k == 100) {
      ASSERT_TRUE(WaitUntil([&] { return hub->stats().endpoints == 0; },
                            absl::Seconds(5)));
      threads_at_100 = ::ferry::testing::ThreadCount();
      at_100 = hub->stats();
    }
  }
  ASSERT_TRUE(
      WaitUntil([&] { return hub->stats().endpoints == 0; }, absl::Seconds(5)))
      << hub->stats().endpoints;
  const TransportStats st = hub->stats();
  // Records of peers without endpoints beyond max_peers are dropped.
  EXPECT_LE(at_100.peers, 64u);
  EXPECT_TRUE(
      WaitUntil([&] { return hub->stats().peers <= 64; }, absl::Seconds(2)))
      << hub->stats().peers;
  EXPECT_EQ(st.threads, at_100.threads);
  EXPECT_GT(st.threads, 0u);
  EXPECT_LE(::ferry::testing::ThreadCount(), threads_at_100 + 2);
}

TEST(RdmaTransportTest, KeepaliveReapsEndpointsOfAVanishedPeer) {
  // The initiator goes away without a word (its QPs are destroyed, as
  // when its process is killed): the target's idle endpoint to it is
  // probed once it has been idle for the keepalive interval (counted from
  // the first housekeeping that saw it idle), fails, and is dropped.
  SimulatedClock clock;
  FakePeerNetwork net;
  TransportOptions o = OneNic();
  o.rdma.keepalive_interval = absl::Seconds(2);
  ASSERT_OK_AND_ASSIGN(auto target,
                       TestNode::Start(&net, "t", o, 1 << 20, "", &clock));
  ASSERT_OK_AND_ASSIGN(auto init,
                       TestNode::Start(&net, "i", o, 1 << 20, "", &clock));
  const absl::Time start = clock.Now();
  ASSERT_TRUE(WriteAndWait(init.get(), *target, 0, 4096, 1).empty());
  ASSERT_EQ(target->stats().endpoints, 1u);
  net.SetFault("i", FakePeerNetwork::Fault::kRefuse);  // No notices either.
  init->Stop();
  // The first housekeeping (at 50 ms) finds it idle; no probe until the
  // interval has passed since, at the housekeeping after 2 s.
  while (clock.Now() < start + o.rdma.keepalive_interval) {
    ASSERT_TRUE(Step(&clock, kHousekeeping, 1));
  }
  EXPECT_EQ(target->stats().endpoints, 1u) << "reaped before the interval";
  EXPECT_EQ(target->stats().nics[0].outstanding_wrs, 0u) << "probed early";
  ASSERT_TRUE(Step(&clock, kHousekeeping, 1));  // The probe.
  EXPECT_TRUE(WaitUntil([&] { return target->stats().endpoints == 0; },
                        absl::Seconds(10)))
      << target->stats().endpoints;
  // And the objects (with their QPs) are gone, not just out of the store.
  init.reset();
  EXPECT_TRUE(
      WaitUntil([&] { return EndpointsAlive() == 0; }, absl::Seconds(5)))
      << EndpointsAlive();
}

TEST(RdmaTransportTest, ShutdownWithAKeepaliveOutstanding) {
  // A keepalive probe has no slice (a null entry among the posted ones):
  // shutting down while one waits for its acknowledgement must skip it.
  SimulatedClock clock;
  FakePeerNetwork net;
  TransportOptions o = OneNic();
  o.rdma.keepalive_interval = absl::Seconds(2);
  ASSERT_OK_AND_ASSIGN(auto target,
                       TestNode::Start(&net, "t", o, 1 << 20, "", &clock));
  ASSERT_OK_AND_ASSIGN(auto init,
                       TestNode::Start(&net, "i", o, 1 << 20, "", &clock));
  ASSERT_TRUE(WriteAndWait(init.get(), *target, 0, 4096, 1).empty());
  ASSERT_EQ(target->stats().nics[0].outstanding_wrs, 0u);
  net.SetFault("i", FakePeerNetwork::Fault::kRefuse);
  init->Stop();  // Its QPs are gone: the probe waits out the retries.
  const absl::Time end = clock.Now() + 10 * o.rdma.keepalive_interval;
  while (target->stats().nics[0].outstanding_wrs == 0 && clock.Now() < end) {
    ASSERT_TRUE(Step(&clock, kHousekeeping, 1));
  }
  ASSERT_GT(target->stats().nics[0].outstanding_wrs, 0u);
  target->Stop();
  EXPECT_EQ(EndpointsAlive(), 0);
}

// softrnic raises the event on every context of the device, so both
// transports of this process see it.
TEST(RdmaTransportTest, DeviceFatalFailsOverAndIsReported) {
  FakePeerNetwork net;
  TransportOptions o;  // Both NICs.
  ASSERT_OK_AND_ASSIGN(auto target, TestNode::Start(&net, "t", o, 32 << 20));
  ASSERT_OK_AND_ASSIGN(auto init, TestNode::Start(&net, "i", o, 32 << 20));
  ASSERT_TRUE(WriteAndWait(init.get(), *target, 0, 65536, 8).empty());
  FillPattern(init->mem(), 32 << 20, 0, 5);
  TestSink sink;
  auto slices =
      init->MakeSlices(*target, OpCode::kWrite, 0, 64 << 10, 512, &sink);
  init->Submit(&slices);
  if (softrnic::InjectAsyncEvent("softrnic1", IBV_EVENT_DEVICE_FATAL) != 0) {
    const int err = errno;
    ASSERT_TRUE(sink.WaitFor(slices.size(), absl::Seconds(20)));
    FAIL() << "InjectAsyncEvent: " << std::strerror(err);
  }
  ASSERT_TRUE(sink.WaitFor(slices.size(), absl::Seconds(20)));
  for (const absl::Status& s : sink.statuses()) ASSERT_OK(s);
  EXPECT_EQ(CheckPattern(target->mem(), 32 << 20, 0, 5), size_t{32 << 20});
  for (TestNode* n : {init.get(), target.get()}) {
    // Each context's async-event thread handles the event in its own time:
    // the slices may all have completed (on either NIC) before it has.
    EXPECT_TRUE(
        WaitUntil([&] { return n->stats().nics[1].fatal; }, absl::Seconds(10)))
        << n->name();
    const TransportStats st = n->stats();
    ASSERT_EQ(st.nics.size(), 2u);
    EXPECT_TRUE(st.nics[0].port_active);
    EXPECT_FALSE(st.nics[1].port_active) << n->name();
    EXPECT_TRUE(st.nics[1].fatal) << n->name();
  }
  // New transfers avoid the dead NIC from the start.
  const uint64_t before = init->stats().nics[1].slices;
  ASSERT_TRUE(WriteAndWait(init.get(), *target, 0, 65536, 64).empty());
  EXPECT_EQ(init->stats().nics[1].slices, before);
}

TEST(RdmaTransportTest, GidChangeIsPickedUpByNewConnections) {
  FakePeerNetwork net;
  ASSERT_OK_AND_ASSIGN(auto target, TestNode::Start(&net, "t", OneNic()));
  ASSERT_OK_AND_ASSIGN(auto init, TestNode::Start(&net, "i", OneNic()));
  // Every GID the initiator puts in a connect request.
  Mutex mu;
  std::vector<std::string> gids;
  net.SetInterceptor([&](const std::string& from, const std::string&,
                         const std::string& payload) {
    RdmaMessage m;
    if (from == "i" && m.ParseFromString(payload) && m.has_connect()) {
      MutexLock lock(&mu);
      for (const QpInfo& q : m.connect().initiator_qps()) {
        gids.push_back(q.gid());
      }
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(WriteAndWait(init.get(), *target, 0, 4096, 1).empty());
  ASSERT_EQ(softrnic::InjectAsyncEvent("softrnic0", IBV_EVENT_GID_CHANGE), 0)
      << std::strerror(errno);
  // The GID now in the device's table, at the entry Ferry uses (on a
  // table with several entries, the RoCE v2 one).
  ibv_gid now{};
  {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    ASSERT_NE(list, nullptr);
    ibv_context* ctx = nullptr;
    for (int i = 0; i < n; ++i) {
      if (std::string(ibv_get_device_name(list[i])) == "softrnic0") {
        ctx = ibv_open_device(list[i]);
      }
    }
    ibv_free_device_list(list);
    ASSERT_NE(ctx, nullptr);
    int index = 0;
    absl::Status picked = rdma::PickGid(ctx, -1, &now, &index);
    ibv_close_device(ctx);
    ASSERT_OK(picked);
  }
  // A new connection (to a new peer) carries the GID from after the event.
  ASSERT_OK_AND_ASSIGN(auto second, TestNode::Start(&net, "u", OneNic()));
  ASSERT_TRUE(WriteAndWait(init.get(), *second, 0, 4096, 1).empty());
  MutexLock lock(&mu);
  ASSERT_FALSE(gids.empty());
  EXPECT_EQ(gids.back(), std::string(reinterpret_cast<char*>(now.raw), 16));
}

}  // namespace
}  // namespace ferry::rdma
