// RailLifecycle on one thread: two engines' lifecycles on softrnic NICs,
// their messages carried by a FakePeerNetwork (which runs the other
// side's handler on the calling thread), and their control jobs run by
// the test -- no control thread, no housekeeper, no completion worker.
// What RdmaTransport's threads would interleave happens here in an order
// the test chooses.
#include "transport/rdma/rail_lifecycle.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "transport/rdma/rdma_test_util.h"

namespace ferry::rdma {
namespace {

using testing::FakePeerNetwork;

// Records what the lifecycle hands back to the data path.
class RecordingHost final : public RailHost {
 public:
  void Retry(Slice* slice, const absl::Status& why) override {
    retried.push_back(slice);
    retry_why.push_back(why);
  }
  void Reroute(SliceQueue* slices) override {
    while (Slice* s = slices->pop_front()) rerouted.push_back(s);
  }
  std::vector<Slice*> retried;
  std::vector<absl::Status> retry_why;
  std::vector<Slice*> rerouted;
};

// Completions are reaped by the test (Completions::Poll), if at all.
class NoCompletions final : public CompletionHandler {
 public:
  void OnCompletion(const QpRef&, const ibv_wc&) override {}
  void PostParked(const std::shared_ptr<Endpoint>&) override {}
  void OnPortChange(int, bool) override {}
  void OnDeviceFatal(int) override {}
};

TransportOptions Options() {
  TransportOptions o;
  o.rdma.devices = {"softrnic0"};
  o.rdma.qps_per_endpoint = 1;
  o.connect_timeout = absl::Seconds(3);
  return o;
}

// One engine's lifecycle and what it sits on.
class Side {
 public:
  Side(FakePeerNetwork* net, const std::string& name, Clock* clock)
      : ctx_(Options()), channel_(net->Join(name, name + ":1")) {
    ctx_.env.local_segment = name;
    ctx_.env.rpc_address = name + ":1";
    ctx_.env.peer_channel = channel_.get();
    ctx_.clock = clock;
    std::random_device rd;
    ctx_.incarnation = (static_cast<uint64_t>(rd()) << 32) | rd() | 1;
    queue_.SetClock(clock);
  }

  absl::Status Open() {
    auto devices = ListDevices(ctx_.options.rdma.devices);
    if (!devices.ok()) return devices.status();
    auto nic = Nic::Open((*devices)[0], EffectiveGidIndex(ctx_.options.rdma));
    if (!nic.ok()) return nic.status();
    ctx_.nics.push_back(std::move(*nic));
    completions_.AddNic(ctx_.nics[0].get());
    channel_->SetHandler(
        "rdma", [this](const std::string& from, const std::string& payload) {
          return rails_.OnExchange(from, payload);
        });
    return absl::OkStatus();
  }

  // As RdmaTransport::Shutdown: every endpoint, wherever it is held, is
  // failed and its QPs destroyed before the NIC goes.
  ~Side() {
    channel_->RemoveHandler("rdma");
    queue_.BeginFarewell(absl::InfinitePast());
    std::vector<std::shared_ptr<Endpoint>> eps = rails_.TakeAll();
    for (auto& ep : queue_.TakeEndpoints()) eps.push_back(std::move(ep));
    for (auto& ep : completions_.TakeAll()) eps.push_back(std::move(ep));
    for (auto& ep : eps) {
      MutexLock lock(&ep->mu);
      ep->SetStateLocked(Endpoint::State::kFailed);
      for (QueuePair& q : ep->qps) {
        if (q.qp != nullptr) ibv_destroy_qp(q.qp);
        q.qp = nullptr;
      }
    }
    completions_.Close();
  }

  // The view peers have of this side.
  std::shared_ptr<const SegmentView> View() const {
    descriptor::SegmentDescriptor d;
    d.set_name(ctx_.env.local_segment);
    d.set_incarnation(ctx_.incarnation);
    d.set_rpc_address(ctx_.env.rpc_address);
    descriptor::TransportEndpoint* t = d.add_transports();
    t->set_transport("rdma");
    t->add_devices()->set_name("softrnic0");
    auto view = SegmentView::Create(d);
    EXPECT_OK(view.status());
    return *view;
  }

  // Runs the jobs that may run now, one at a time; returns how many ran.
  int RunJobs() {
    int ran = 0;
    bool over = false;
    while (std::optional<ControlJob> job = queue_.TryTake(&over)) {
      rails_.RunJob(*job);
      queue_.Done(*job);
      ++ran;
    }
    return ran;
  }

  RailLifecycle& rails() { return rails_; }
  RecordingHost& host() { return host_; }
  const RdmaCounters& counters() const { return ctx_.counters; }
  size_t queued() const { return queue_.size(); }

 private:
  RdmaContext ctx_;
  std::unique_ptr<PeerChannel> channel_;
  RecordingHost host_;
  NoCompletions handler_;
  Completions completions_{&handler_, {}};
  ControlQueue queue_;
  RailLifecycle rails_{&ctx_, &completions_, &queue_, &host_};
};

// Runs both sides' jobs until neither has one left (bounded).
void Settle(Side* a, Side* b) {
  for (int round = 0; round < 100; ++round) {
    int ran = a->RunJobs();
    ran += b->RunJobs();
    if (ran == 0) return;
  }
  ADD_FAILURE() << "jobs still queued after 100 rounds";
}

Endpoint::State StateOf(const std::shared_ptr<Endpoint>& ep) {
  MutexLock lock(&ep->mu);
  return ep->state();
}

class RailLifecycleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK(a_.Open());
    ASSERT_OK(b_.Open());
  }

  // A's endpoint on its one rail to B, connected.
  std::shared_ptr<Endpoint> Connect() {
    absl::Status why;
    std::shared_ptr<Peer> peer = a_.rails().PeerForView(*b_.View(), &why);
    EXPECT_NE(peer, nullptr) << why;
    if (peer == nullptr) return nullptr;
    auto ep = a_.rails().RailEndpoint(peer, 0, "softrnic0", &why);
    EXPECT_NE(ep, nullptr) << why;
    Settle(&a_, &b_);
    return ep;
  }

  // Both sides gone, no endpoint is left anywhere (no QP outlives them).
  void TearDown() override {
    a_owner_.reset();
    b_owner_.reset();
    EXPECT_EQ(EndpointsAlive(), 0);
  }

  SimulatedClock clock_;
  FakePeerNetwork net_;
  std::unique_ptr<Side> a_owner_ = std::make_unique<Side>(&net_, "a", &clock_);
  std::unique_ptr<Side> b_owner_ = std::make_unique<Side>(&net_, "b", &clock_);
  Side& a_ = *a_owner_;
  Side& b_ = *b_owner_;
};

TEST_F(RailLifecycleTest, AHandshakeConnectsBothSides) {
  absl::Status why;
  std::shared_ptr<Peer> peer = a_.rails().PeerForView(*b_.View(), &why);
  ASSERT_NE(peer, nullptr) << why;
  auto ep = a_.rails().RailEndpoint(peer, 0, "softrnic0", &why);
  ASSERT_NE(ep, nullptr) << why;
  // The data path never waits for the handshake: it is a queued job.
  EXPECT_EQ(StateOf(ep), Endpoint::State::kConnecting);
  EXPECT_EQ(a_.queued(), 1u);
  EXPECT_EQ(a_.rails().RailEndpoint(peer, 0, "softrnic0", &why), ep);
  Settle(&a_, &b_);
  EXPECT_EQ(StateOf(ep), Endpoint::State::kConnected);
  EXPECT_TRUE(ep->confirmed.load());
  EXPECT_EQ(a_.counters().connects_started.load(), 1u);
  EXPECT_EQ(b_.counters().connects_accepted.load(), 1u);
  EXPECT_EQ(a_.rails().endpoints(), 1u);
  EXPECT_EQ(b_.rails().endpoints(), 1u);
  // One endpoint per rail, both directions: B's need reuses its end.
  std::shared_ptr<Peer> back = b_.rails().PeerForView(*a_.View(), &why);
  ASSERT_NE(back, nullptr) << why;
  auto b_ep = b_.rails().RailEndpoint(back, 0, "softrnic0", &why);
  ASSERT_NE(b_ep, nullptr) << why;
  EXPECT_EQ(StateOf(b_ep), Endpoint::State::kConnected);
  EXPECT_EQ(b_.queued(), 0u);
  EXPECT_EQ(b_.rails().endpoints(), 1u);
}

TEST_F(RailLifecycleTest, ARefusedHandshakeBacksThePeerOff) {
  net_.SetFault("b:1", FakePeerNetwork::Fault::kRefuse);
  absl::Status why;
  std::shared_ptr<Peer> peer = a_.rails().PeerForView(*b_.View(), &why);
  ASSERT_NE(peer, nullptr) << why;
  auto ep = a_.rails().RailEndpoint(peer, 0, "softrnic0", &why);
  ASSERT_NE(ep, nullptr) << why;
  // A slice waiting for the connection goes back to the data path.
  Slice slice;
  slice.length = 4096;
  {
    MutexLock lock(&ep->mu);
    ep->Load(1, slice.length);
    ep->waiting.push_back(&slice);
  }
  Settle(&a_, &b_);
  EXPECT_EQ(StateOf(ep), Endpoint::State::kFailed);
  EXPECT_EQ(ep->busy.load(), 0u);
  EXPECT_EQ(a_.counters().connect_failures.load(), 1u);
  ASSERT_EQ(a_.host().retried.size(), 1u);
  EXPECT_EQ(a_.host().retried[0], &slice);
  EXPECT_EQ(a_.host().retry_why[0].code(), absl::StatusCode::kUnavailable)
      << a_.host().retry_why[0];
  // Until the back-off passes, the rail fails fast: no handshake storm.
  EXPECT_EQ(a_.rails().RailEndpoint(peer, 0, "softrnic0", &why), nullptr);
  EXPECT_EQ(why.code(), absl::StatusCode::kUnavailable) << why;
  EXPECT_NE(why.message().find("unreachable"), absl::string_view::npos) << why;
  EXPECT_EQ(a_.queued(), 0u);
  // Once it has, one probe handshake goes, and connects.
  net_.SetFault("b:1", FakePeerNetwork::Fault::kNone);
  clock_.Advance(absl::Seconds(2));
  auto again = a_.rails().RailEndpoint(peer, 0, "softrnic0", &why);
  ASSERT_NE(again, nullptr) << why;
  EXPECT_NE(again, ep);
  Settle(&a_, &b_);
  EXPECT_EQ(StateOf(again), Endpoint::State::kConnected);
}

TEST_F(RailLifecycleTest, ClosingTellsThePeerAndBothSidesDrop) {
  auto ep = Connect();
  ASSERT_NE(ep, nullptr);
  ASSERT_EQ(StateOf(ep), Endpoint::State::kConnected);
  // Idle: closed at once, and the peer is told (a DISCONNECT job).
  a_.rails().ClosePeer("b");
  EXPECT_EQ(StateOf(ep), Endpoint::State::kClosing);
  EXPECT_EQ(a_.queued(), 1u);
  Settle(&a_, &b_);
  // The peer had nothing posted: it answered "drained", and both sides
  // dropped their QPs without waiting for the linger.
  EXPECT_EQ(a_.rails().endpoints(), 0u);
  EXPECT_EQ(b_.rails().endpoints(), 0u);
  EXPECT_TRUE(a_.host().retried.empty());
  EXPECT_TRUE(b_.host().rerouted.empty());
}

TEST_F(RailLifecycleTest, AFailedEndpointLeavesItsRailAndReturnsItsSlices) {
  auto ep = Connect();
  ASSERT_NE(ep, nullptr);
  Slice waiting;
  waiting.length = 4096;
  {
    MutexLock lock(&ep->mu);
    ep->Load(1, waiting.length);
    ep->waiting.push_back(&waiting);
  }
  a_.rails().FailEndpoint(ep, absl::UnavailableError("test: QP error"),
                          /*flush=*/true);
  EXPECT_EQ(StateOf(ep), Endpoint::State::kFailed);
  ASSERT_EQ(a_.host().retried.size(), 1u);
  EXPECT_EQ(a_.host().retried[0], &waiting);
  EXPECT_EQ(a_.host().retry_why[0].message(), "test: QP error");
  EXPECT_EQ(ep->busy.load(), 0u);
  // Nothing posted: gone from the store at once.
  EXPECT_EQ(a_.rails().endpoints(), 0u);
  // B is told (DISCONNECT) and drops its end.
  Settle(&a_, &b_);
  EXPECT_EQ(b_.rails().endpoints(), 0u);
  // The rail gets a new endpoint, and a new handshake.
  absl::Status why;
  std::shared_ptr<Peer> peer = a_.rails().PeerForView(*b_.View(), &why);
  ASSERT_NE(peer, nullptr) << why;
  auto next = a_.rails().RailEndpoint(peer, 0, "softrnic0", &why);
  ASSERT_NE(next, nullptr) << why;
  EXPECT_NE(next, ep);
  Settle(&a_, &b_);
  EXPECT_EQ(StateOf(next), Endpoint::State::kConnected);
  EXPECT_EQ(b_.rails().endpoints(), 1u);
}

TEST_F(RailLifecycleTest, APeerThatRestartedFailsItsOldEndpoints) {
  auto ep = Connect();
  ASSERT_NE(ep, nullptr);
  descriptor::SegmentDescriptor d = b_.View()->descriptor();
  d.set_incarnation(d.incarnation() + 2);
  auto restarted = SegmentView::Create(d);
  ASSERT_OK(restarted.status());
  absl::Status why;
  EXPECT_NE(a_.rails().PeerForView(**restarted, &why), nullptr) << why;
  EXPECT_EQ(StateOf(ep), Endpoint::State::kFailed);
  // The old view is now refused, with what to do about it.
  EXPECT_EQ(a_.rails().PeerForView(*b_.View(), &why), nullptr);
  EXPECT_EQ(why.code(), absl::StatusCode::kFailedPrecondition) << why;
  EXPECT_NE(why.message().find("RefreshSegment"), absl::string_view::npos)
      << why;
}

}  // namespace
}  // namespace ferry::rdma
