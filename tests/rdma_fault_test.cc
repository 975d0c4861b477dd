// RDMA under process and link faults, across processes (on softrnic):
//   - initiators killed after a short session leave the target's endpoint
//     count and fd count bounded (the keepalive finds them);
//   - every request ends within transfer_timeout plus the documented
//     bound (rdma_transport.h) when the peer is stopped (SIGSTOP) after
//     or before the handshake, killed mid-transfer, or our links drop.
// tests/engine_peer is the target process, tests/rdma_session_peer the
// initiator process.
#include <signal.h>
#include <sys/types.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/pattern.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"
#include "testing/process_usage.h"
#include "testing/subprocess.h"
#include "transport/rdma/control_plane.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/rdma_test_util.h"
#include "transport/softrnic/softrnic_control.h"

namespace ferry {
namespace {

using ferry::testing::DescribeFds;
using ferry::testing::OpenFds;
using ferry::testing::RunfilePath;
using ferry::testing::Subprocess;
using ferry::testing::WaitUntil;

// What rdma_transport.h promises beyond transfer_timeout: the housekeeping
// interval, a flush and its completion, and a post blocked by a peer that
// stopped reading (softrnic's send timeout); with room for a loaded CI
// machine.
constexpr absl::Duration kDeadlineSlack = absl::Seconds(1);

uint64_t Endpoints(const TransferEngine& e) {
  auto st = e.GetTransportStats();
  return st.empty() ? 0 : st[0].endpoints;
}

// Advances `clock` by `d` in `step`s, letting what fell due at each step
// (housekeeping, keepalive probes) be done first (AdvanceAndSettle).
void StepFor(SimulatedClock& clock, absl::Duration d, absl::Duration step) {
  const absl::Time end = clock.Now() + d;
  while (clock.Now() < end) {
    clock.AdvanceAndSettle(std::min(step, end - clock.Now()));
  }
}

TEST(RdmaFaultTest, KilledInitiatorsLeaveTheTargetBounded) {
  // 50 initiator processes in turn each connect, write, and are killed
  // with their endpoints connected. The target runs on a SimulatedClock
  // and probes endpoints idle for K = 500 ms: after each kill the test
  // moves its clock by K and two sweeps of an idle engine's housekeeper
  // (H, 250 ms: the first finds the endpoint idle, the probe goes K
  // later; the clock moves in 50 ms steps, the busy sweep's), and the dead
  // session's endpoint must then fail and be dropped (its QPs and
  // softrnic's sockets with it) as soon as softrnic reports the probe
  // failed (after the QP retry time, in real time) -- or, for a session
  // killed before its READY reached the target, once the clock has also
  // passed the confirm deadline (see `reaped`). So the target holds at
  // most the one session it serves, and nothing once they are all gone.
  constexpr absl::Duration kKeepalive = absl::Milliseconds(500);
  constexpr absl::Duration kHousekeeping =
      rdma::ControlPlane::kHousekeepingInterval;
  const absl::Duration kWindow =
      kKeepalive + 2 * rdma::ControlPlane::kIdleHousekeepingInterval;
  SimulatedClock clock;  // Outlives the target.
  EngineOptions o;
  o.local_segment_name = "target";
  o.transports = {"rdma"};
  o.rdma.keepalive_interval = kKeepalive;
  // The probe of a dead peer fails after the QP retry time, which softrnic
  // counts in real time: 4.096 us * 2^10 * 8 = 34 ms here, not the default
  // 0.54 s, as every session waits for it.
  o.rdma.qp_timeout = 10;
  o.clock = &clock;
  TransferEngine target;
  ASSERT_OK(target.Init(o));
  constexpr size_t kBuffer = 1 << 20;
  std::unique_ptr<uint8_t[]> mem(new uint8_t[kBuffer]);
  ASSERT_OK(target.RegisterLocalMemory(mem.get(), kBuffer));
  auto session = [&](int k) {
    auto p = Subprocess::Start(
        {RunfilePath("tests/rdma_session_peer"), absl::StrCat("--name=s", k),
         absl::StrCat("--metadata=", target.metadata_address()),
         "--target=target", "--bytes=65536"});
    ASSERT_OK(p);
    auto line = (*p)->ReadLine(absl::Seconds(30));
    ASSERT_OK(line);
    ASSERT_EQ(*line, "DONE COMPLETED");
    (*p)->Kill();
  };
  // A session may be killed before its READY (sent by one of its control
  // threads while its WRITE runs) reached the target: the accepted
  // endpoint then stays unconfirmed -- not idle, so not probed -- until
  // the confirm deadline, R (rpc_timeout, 3 s) after the accept on the
  // target's clock, and is probed K after that.
  constexpr absl::Duration kConfirm = absl::Seconds(3);
  // Sessions still held a second after the window (their READY, most
  // likely, had not arrived), reaped with the clock moved on.
  int late_ready = 0;
  // Moves the target's clock through one keepalive window, then waits for
  // the probe's failure (softrnic's, in real time) to empty the store. If
  // it is not empty after a while, moves the clock on in H steps, up to
  // the confirm deadline and a keepalive window after it.
  auto reaped = [&] {
    const absl::Time limit = clock.Now() + kConfirm + kWindow;
    StepFor(clock, kWindow, kHousekeeping);
    const absl::Time slow = absl::Now() + absl::Seconds(1);
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    bool stepped = false;
    while (Endpoints(target) != 0) {
      if (absl::Now() >= give_up) return false;
      absl::SleepFor(absl::Milliseconds(1));
      if (absl::Now() >= slow && clock.Now() < limit) {
        clock.AdvanceAndSettle(kHousekeeping);
        stepped = true;
      }
    }
    late_ready += stepped;
    return true;
  };
  session(-1);  // Warms up what stays (gRPC, softrnic listeners).
  // An endpoint leaves the store before its last reference (a poller's or
  // the housekeeper's) drops it and its QPs' fds: wait for both, so that
  // the fd baseline holds no endpoint.
  ASSERT_TRUE(reaped()) << Endpoints(target) << " in the store";
  ASSERT_TRUE(
      WaitUntil([&] { return rdma::EndpointsAlive() == 0; }, absl::Seconds(10)))
      << rdma::EndpointsAlive() << " alive";
  const int fds = OpenFds();
  const std::string fds_before = DescribeFds(getpid());
  uint64_t most = 0;
  for (int k = 0; k < 50; ++k) {
    SCOPED_TRACE(k);
    session(k);
    if (HasFatalFailure()) return;
    most = std::max(most, Endpoints(target));
    // Nothing reaps it before its keepalive window has passed on the
    // target's clock, which has not moved since the session began.
    EXPECT_EQ(Endpoints(target), 1u);
    EXPECT_TRUE(reaped()) << Endpoints(target) << " endpoints held";
  }
  // One session's endpoint, and for a moment a second: seen once (in a
  // cold CI run's sanitizer stage, under full load) a store of 2 right
  // after a session that read 1 a moment later with the clock not moved,
  // so not a missed reap. Probably a handshake the session retried when
  // its real-time RPC deadline passed, whose superseded endpoint the
  // target drops when the retry lands (connector_test's
  // StaleRequestsAreSupersededAndResentOnce); not confirmed. What this
  // test is for, no growth across 50 killed sessions, holds either way:
  // every session's endpoints are reaped before the next one starts.
  EXPECT_LE(most, 2u);
  EXPECT_TRUE(WaitUntil([&] { return OpenFds() <= fds; }, absl::Seconds(5)))
      << OpenFds() << " fds: " << DescribeFds(getpid()) << "; before: " << fds
      << ": " << fds_before;
  EXPECT_TRUE(
      WaitUntil([] { return rdma::EndpointsAlive() == 0; }, absl::Seconds(5)))
      << rdma::EndpointsAlive();
  std::printf(
      "at most %llu endpoints held at once for 50 sessions; %d reaped past "
      "the keepalive window\n",
      static_cast<unsigned long long>(most), late_ready);
  target.Shutdown();
}

// The test's engine initiates; tests/engine_peer is the target.
class RdmaDeadlineTest : public ::testing::Test {
 protected:
  static constexpr size_t kPeerBuffer = 32 << 20;
  static constexpr absl::Duration kTimeout = absl::Seconds(2);

  void SetUp() override {
    EngineOptions o;
    o.local_segment_name = "initiator";
    o.transports = {"rdma"};
    o.transfer_timeout = kTimeout;
    o.rpc_timeout = absl::Seconds(5);  // Longer than the transfers'.
    if (qp_timeout_ > 0) {
      o.rdma.qp_timeout = qp_timeout_;
      // No keepalives: the housekeeper posts them itself, and under the
      // frame delay one would block it for the delay (a keepalive goes
      // only on an idle endpoint, whose socket is empty: without an
      // injected delay its post does not block).
      o.rdma.keepalive_interval = absl::ZeroDuration();
    }
    ASSERT_OK(engine_.Init(o));
    local_.reset(new uint8_t[kPeerBuffer]);
    FillPattern(local_.get(), kPeerBuffer, 0, 3);
    ASSERT_OK(engine_.RegisterLocalMemory(local_.get(), kPeerBuffer));
    auto peer = Subprocess::Start(
        {RunfilePath("tests/engine_peer"), "--name=peer",
         absl::StrCat("--metadata=", engine_.metadata_address()),
         absl::StrCat("--buffer_size=", kPeerBuffer), "--seed=9",
         "--transport=rdma",
         // The peer's probes: under a frame delay our ACKs to them are
         // late, and the peer would fail the connection (ending a blocked
         // post on our side) by itself.
         absl::StrCat("--keepalive_ms=", qp_timeout_ > 0 ? 0 : -1)});
    ASSERT_OK(peer);
    peer_ = std::move(*peer);
    auto ready = peer_->ReadLine(absl::Seconds(30));
    ASSERT_OK(ready);
    std::vector<std::string> parts = absl::StrSplit(*ready, ' ');
    ASSERT_EQ(parts[0], "READY") << *ready;
    remote_ = std::stoull(parts[1]);
    auto seg = engine_.OpenSegment("peer");
    ASSERT_OK(seg);
    seg_ = *seg;
  }

  void TearDown() override {
    if (stopped_) ::kill(peer_->pid(), SIGCONT);
    softrnic::SetDelayUs("softrnic0", 0);
    softrnic::SetDelayUs("softrnic1", 0);
    softrnic::SetLink("softrnic0", true);
    softrnic::SetLink("softrnic1", true);
    peer_.reset();
    engine_.Shutdown();
  }

  void Stop() {
    ASSERT_EQ(::kill(peer_->pid(), SIGSTOP), 0);
    stopped_ = true;
  }

  // `n` WRITEs and `n` READs of `len` bytes.
  std::vector<TransferRequest> Requests(int n, size_t len) {
    std::vector<TransferRequest> reqs;
    for (int i = 0; i < 2 * n; ++i) {
      TransferRequest r;
      r.opcode = i % 2 == 0 ? OpCode::kWrite : OpCode::kRead;
      r.source = local_.get() + i * len;
      r.target_id = seg_;
      r.target_offset = remote_ + i * len;
      r.length = len;
      reqs.push_back(r);
    }
    return reqs;
  }

  absl::StatusOr<BatchId> Submit(const std::vector<TransferRequest>& reqs) {
    auto batch = engine_.AllocateBatch(reqs.size());
    if (!batch.ok()) return batch.status();
    if (absl::Status s = engine_.SubmitTransfer(*batch, reqs); !s.ok()) {
      return s;
    }
    return *batch;
  }

  // Waits for `batch` (submitted at `start`) and checks that it ended by
  // the deadline plus the slack, and how.
  void ExpectEndsInTime(BatchId batch, absl::Time start, bool may_complete) {
    auto st = engine_.WaitBatch(batch, kTimeout + absl::Seconds(20));
    const absl::Duration took = absl::Now() - start;
    ASSERT_OK(st);
    EXPECT_LE(took, kTimeout + kDeadlineSlack) << took;
    std::printf("ended after %s: state %d, %zu completed, %zu failed: %s\n",
                absl::FormatDuration(took).c_str(), static_cast<int>(st->state),
                st->completed, st->failed, st->first_error.ToString().c_str());
    if (!may_complete) {
      EXPECT_TRUE(st->state == TransferState::kTimeout ||
                  st->state == TransferState::kFailed)
          << static_cast<int>(st->state);
    }
    EXPECT_NE(st->state, TransferState::kPending);
    ASSERT_OK(engine_.FreeBatch(batch));
  }

  // A first transfer, so that rails are connected: `n` WRITEs and READs
  // of 64 KiB (n = 1 uses one rail, more stripe over all).
  void Connect(int n) {
    auto batch = Submit(Requests(n, n == 1 ? 4096 : 64 << 10));
    ASSERT_OK(batch);
    auto st = engine_.WaitBatch(*batch, absl::Seconds(30));
    ASSERT_OK(st);
    ASSERT_EQ(st->state, TransferState::kCompleted) << st->first_error;
    ASSERT_OK(engine_.FreeBatch(*batch));
  }

  // Submits 128 slices with softrnic slowing every frame (posting blocks
  // on it, so the submission runs on its own thread), runs `fault` once
  // some are posted, and checks that the batch ends in time.
  template <typename F>
  void MidTransfer(F fault) {
    auto nic_slices = [&] {
      uint64_t n = 0;
      // A named copy: a range-for over a member of the temporary would
      // outlive it.
      const std::vector<TransportStats> stats = engine_.GetTransportStats();
      for (const NicStats& s : stats[0].nics) {
        n += s.slices;
      }
      return n;
    };
    const uint64_t before = nic_slices();
    ASSERT_EQ(softrnic::SetDelayUs("softrnic0", 2000), 0);
    ASSERT_EQ(softrnic::SetDelayUs("softrnic1", 2000), 0);
    const absl::Time start = absl::Now();
    absl::StatusOr<BatchId> batch;
    std::thread submit([&] { batch = Submit(Requests(64, 128 << 10)); });
    const bool posting = WaitUntil([&] { return nic_slices() >= before + 16; },
                                   absl::Seconds(10));
    fault();
    submit.join();
    softrnic::SetDelayUs("softrnic0", 0);
    softrnic::SetDelayUs("softrnic1", 0);
    ASSERT_TRUE(posting);
    ASSERT_OK(batch);
    ExpectEndsInTime(*batch, start, /*may_complete=*/true);
  }

  TransferEngine engine_;
  std::unique_ptr<uint8_t[]> local_;
  std::unique_ptr<Subprocess> peer_;
  uint64_t remote_ = 0;
  SegmentHandle seg_ = 0;
  bool stopped_ = false;
  int qp_timeout_ = 0;  // rdma.qp_timeout, if set.
};

TEST_F(RdmaDeadlineTest, PeerStoppedAfterTheHandshake) {
  Connect(8);
  Stop();
  const absl::Time start = absl::Now();
  auto batch = Submit(Requests(64, 128 << 10));
  ASSERT_OK(batch);
  ExpectEndsInTime(*batch, start, /*may_complete=*/false);
}

TEST_F(RdmaDeadlineTest, PeerStoppedDuringTheHandshakes) {
  // One rail (and the peer-service channel) is up; the peer stops; the
  // next requests stripe over all four rails, three of which must connect
  // first: their connect RPCs wait for an answer that does not come
  // (rpc_timeout is longer than the transfer timeout), and the slices
  // waiting on those endpoints end by their deadline anyway.
  Connect(1);
  Stop();
  const absl::Time start = absl::Now();
  auto batch = Submit(Requests(32, 64 << 10));
  ASSERT_OK(batch);
  ExpectEndsInTime(*batch, start, /*may_complete=*/false);
}

TEST_F(RdmaDeadlineTest, PeerStoppedBeforeTheHandshake) {
  Stop();
  const absl::Time start = absl::Now();
  auto batch = Submit(Requests(16, 64 << 10));
  ASSERT_OK(batch);
  ExpectEndsInTime(*batch, start, /*may_complete=*/false);
}

// With the NIC's retry time (Q) far past T + 1 s: a flush is then the only
// thing that ends a stuck post in time.
class RdmaBlockedPostTest : public RdmaDeadlineTest {
 protected:
  void SetUp() override {
    qp_timeout_ = 20;  // Q = 4.096 us * 2^20 * 8, about 34 s.
    RdmaDeadlineTest::SetUp();
  }
};

TEST_F(RdmaBlockedPostTest, PostBlockedPastTheDeadline) {
  // Every frame takes 6 s to leave: posting the first blocks (softrnic
  // sends on the posting thread), holding the endpoint. The housekeeper
  // must still end the batch at its deadline: it flushes the endpoint's
  // QPs, which cuts the frame's delay short, instead of waiting for the
  // endpoint; the other rails' slices, past their deadline by then, are
  // not posted. (Without that the batch took a frame delay per rail:
  // about 24 s here, and minutes with a longer delay.)
  Connect(8);
  ASSERT_EQ(softrnic::SetDelayUs("softrnic0", 6'000'000), 0);
  ASSERT_EQ(softrnic::SetDelayUs("softrnic1", 6'000'000), 0);
  const absl::Time start = absl::Now();
  auto batch = Submit(Requests(8, 64 << 10));  // Returns once flushed.
  ASSERT_OK(batch);
  ExpectEndsInTime(*batch, start, /*may_complete=*/false);
}

TEST_F(RdmaDeadlineTest, PeerKilledMidTransfer) {
  Connect(8);
  MidTransfer([&] { peer_->Kill(); });
}

TEST_F(RdmaDeadlineTest, OurLinksDropMidTransfer) {
  Connect(8);
  MidTransfer([&] {
    ASSERT_EQ(softrnic::SetLink("softrnic0", false), 0);
    ASSERT_EQ(softrnic::SetLink("softrnic1", false), 0);
  });
}

}  // namespace
}  // namespace ferry
