// RailConnector and ConnectBackoff, driven by scripted events: no threads,
// no sleeps, no NIC.
//
// The model checker (connector_model.h) enumerates every interleaving of
// two sides' needs, requests, replies, notices, accepts, installs and
// deadlines -- with lost messages, failed QP operations, failed and
// evicted endpoints and a restart of one side -- up to a bounded number of
// events, and checks every quiescent state: each side idle or connected
// (never wedged in between), both connected to each other or both idle,
// no QP left over. Without faults, a side that wanted the rail ends
// connected.
#include "transport/rdma/connector.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_join.h"
#include "common/sanitizers.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "transport/rdma/connector_model.h"

namespace ferry::rdma {
namespace {

using Kind = RailConnector::Action::Kind;
using Outcome = RailConnector::Outcome;
using Phase = RailConnector::Phase;
using model::Budget;
using model::World;

constexpr int64_t kTimeout = 1000;

std::vector<Kind> Kinds(const RailConnector::Actions& acts) {
  std::vector<Kind> k;
  for (const auto& a : acts) k.push_back(a.kind);
  return k;
}

TEST(RailConnectorTest, ConnectsAsInitiator) {
  RailConnector c(/*we_win_ties=*/true, kTimeout);
  RailConnector::Actions acts;
  ASSERT_TRUE(c.Need(7, &acts));
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kSendRequest});
  const uint64_t attempt = acts[0].attempt;
  EXPECT_EQ(acts[0].ep, 7u);
  EXPECT_EQ(acts[0].epoch, 0u);
  EXPECT_FALSE(c.Need(8, &acts));  // One endpoint per rail.
  ASSERT_TRUE(c.BeginSend(attempt));
  acts.clear();
  c.OnReply(attempt, Outcome::kAccepted, 1, absl::OkStatus(), 0, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kInstall});
  acts.clear();
  c.Installed(7, 1, absl::OkStatus(), &acts);
  EXPECT_EQ(Kinds(acts),
            (std::vector<Kind>{Kind::kActivate, Kind::kTellReady}));
  EXPECT_EQ(c.phase(), Phase::kConnected);
  EXPECT_TRUE(c.confirmed());
  EXPECT_OK(c.CheckInvariants());
}

TEST(RailConnectorTest, AcceptedEndpointSendsAfterReadyOrDeadline) {
  RailConnector c(false, kTimeout);
  RailConnector::Actions acts;
  c.OnRequest(0, 5, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kAccept});
  EXPECT_TRUE(acts[0].fresh);
  const uint64_t epoch = acts[0].epoch;
  acts.clear();
  c.AcceptDone(5, epoch, absl::OkStatus(), 100, &acts);
  ASSERT_EQ(Kinds(acts),
            (std::vector<Kind>{Kind::kActivate, Kind::kReplyAccepted}));
  EXPECT_FALSE(acts[0].confirmed);
  acts.clear();
  c.OnReady(epoch + 1, &acts);  // Another connection's: ignored.
  EXPECT_TRUE(acts.empty());
  c.Tick(100 + kTimeout - 1, &acts);
  EXPECT_TRUE(acts.empty());
  c.Tick(100 + kTimeout, &acts);
  EXPECT_EQ(Kinds(acts), std::vector<Kind>{Kind::kConfirm});
  EXPECT_OK(c.CheckInvariants());
}

TEST(RailConnectorTest, TieBreakLoserAdoptsOrGivesUp) {
  // The loser's request is answered LOST_TIE_BREAK; the winner's request
  // is adopted into the loser's endpoint.
  RailConnector loser(false, kTimeout);
  RailConnector::Actions acts;
  loser.Need(3, &acts);
  const uint64_t attempt = acts[0].attempt;
  acts.clear();
  loser.OnReply(attempt, Outcome::kLostTieBreak, 0, absl::OkStatus(), 0, &acts);
  EXPECT_EQ(loser.phase(), Phase::kAwaitingPeer);
  loser.OnRequest(0, 99, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kAccept});
  EXPECT_EQ(acts[0].ep, 3u);  // Adopted into the waiting endpoint.
  EXPECT_FALSE(acts[0].fresh);

  // Without the winner's request, the endpoint fails at the deadline.
  RailConnector alone(false, kTimeout);
  acts.clear();
  alone.Need(4, &acts);
  const uint64_t a2 = acts[0].attempt;
  acts.clear();
  alone.OnReply(a2, Outcome::kLostTieBreak, 0, absl::OkStatus(), 10, &acts);
  alone.Tick(10 + kTimeout, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kFail});
  EXPECT_EQ(alone.phase(), Phase::kIdle);

  // The winner answers the loser's request while its own is out.
  RailConnector winner(true, kTimeout);
  acts.clear();
  winner.Need(5, &acts);
  acts.clear();
  winner.OnRequest(0, 6, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kReply});
  EXPECT_EQ(acts[0].result, ConnectReply::LOST_TIE_BREAK);
}

TEST(RailConnectorTest, AdoptionThatFailsFailsTheEndpoint) {
  // The defect of the former rdma_connect.cc: an endpoint whose own connect
  // was skipped because the peer's request was being adopted stayed
  // connecting forever when the adoption failed. Now it fails (its slices
  // move on) and the rail is free.
  RailConnector c(false, kTimeout);
  RailConnector::Actions acts;
  c.Need(3, &acts);
  const uint64_t attempt = acts[0].attempt;
  acts.clear();
  c.OnRequest(0, 9, &acts);  // Adopt before our request went out.
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kAccept});
  const uint64_t epoch = acts[0].epoch;
  EXPECT_FALSE(c.BeginSend(attempt));  // Moot now.
  acts.clear();
  c.AcceptDone(3, epoch, absl::UnavailableError("QP to RTR"), 0, &acts);
  EXPECT_EQ(Kinds(acts), (std::vector<Kind>{Kind::kFail, Kind::kRefuse}));
  EXPECT_EQ(c.phase(), Phase::kIdle);
  EXPECT_OK(c.CheckInvariants());
}

TEST(RailConnectorTest, StaleRequestsAreSupersededAndResentOnce) {
  RailConnector c(true, kTimeout);
  RailConnector::Actions acts;
  // The rail is connected at epoch 1 (accepted from the peer).
  c.OnRequest(0, 1, &acts);
  acts.clear();
  c.AcceptDone(1, 1, absl::OkStatus(), 0, &acts);
  acts.clear();
  // A request claiming no connection is stale...
  c.OnRequest(0, 2, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kReply});
  EXPECT_EQ(acts[0].result, ConnectReply::SUPERSEDED);
  EXPECT_EQ(acts[0].epoch, 1u);
  // ...one claiming the current connection replaces it.
  acts.clear();
  c.OnRequest(1, 3, &acts);
  ASSERT_EQ(Kinds(acts), (std::vector<Kind>{Kind::kFail, Kind::kAccept}));
  EXPECT_EQ(acts[0].ep, 1u);
  EXPECT_EQ(acts[1].ep, 3u);
  EXPECT_EQ(acts[1].epoch, 2u);

  // The sender of a superseded request resends once with the newer epoch.
  RailConnector s(false, kTimeout);
  acts.clear();
  s.Need(4, &acts);
  uint64_t attempt = acts[0].attempt;
  acts.clear();
  s.OnReply(attempt, Outcome::kSuperseded, 5, absl::OkStatus(), 0, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kSendRequest});
  EXPECT_EQ(acts[0].epoch, 5u);
  attempt = acts[0].attempt;
  acts.clear();
  s.OnReply(attempt, Outcome::kSuperseded, 6, absl::OkStatus(), 0, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kFail});
  EXPECT_EQ(s.phase(), Phase::kIdle);
  EXPECT_EQ(s.epoch(), 6u);
}

TEST(RailConnectorTest, MootRepliesCloseWhatThePeerMade) {
  RailConnector c(true, kTimeout);
  RailConnector::Actions acts;
  c.Need(3, &acts);
  const uint64_t attempt = acts[0].attempt;
  acts.clear();
  c.Failed(3, &acts);  // E.g. the port went down meanwhile.
  EXPECT_TRUE(acts.empty());
  c.OnReply(attempt, Outcome::kAccepted, 4, absl::OkStatus(), 0, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kTellDisconnect});
  EXPECT_EQ(acts[0].epoch, 4u);
  EXPECT_EQ(c.phase(), Phase::kIdle);
}

TEST(RailConnectorTest, DisconnectsAndRestarts) {
  RailConnector c(true, kTimeout);
  RailConnector::Actions acts;
  c.OnRequest(0, 1, &acts);
  acts.clear();
  c.AcceptDone(1, 1, absl::OkStatus(), 0, &acts);
  acts.clear();
  c.OnDisconnect(2, &acts);  // Not this connection.
  EXPECT_TRUE(acts.empty());
  c.OnDisconnect(1, &acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kClose});
  EXPECT_EQ(c.phase(), Phase::kIdle);
  acts.clear();
  c.OnRequest(1, 2, &acts);
  c.AcceptDone(2, 2, absl::OkStatus(), 0, &acts);
  acts.clear();
  c.Restart(&acts);
  ASSERT_EQ(Kinds(acts), std::vector<Kind>{Kind::kFail});
  EXPECT_EQ(c.epoch(), 0u);
  EXPECT_OK(c.CheckInvariants());
}

TEST(ConnectBackoffTest, OneProbeAtATimeAfterFailures) {
  ConnectBackoff b(/*probe_window_ns=*/3'000'000'000);
  int64_t t = 1'000'000'000;
  EXPECT_EQ(b.Admit(t), ConnectBackoff::Verdict::kGo);
  EXPECT_EQ(b.Admit(t), ConnectBackoff::Verdict::kGo);
  // Four rails fail together: one backoff step, not four.
  for (int i = 0; i < 4; ++i) b.Failed(t + i, absl::UnavailableError("x"));
  EXPECT_EQ(b.failures(), 1u);
  EXPECT_EQ(b.retry_after_ns(), t + ConnectBackoff::kBaseNs);
  EXPECT_EQ(b.Admit(t + 10), ConnectBackoff::Verdict::kFailFast);
  t += ConnectBackoff::kBaseNs;
  EXPECT_EQ(b.Admit(t), ConnectBackoff::Verdict::kProbe);
  EXPECT_EQ(b.Admit(t), ConnectBackoff::Verdict::kFailFast);  // One probe.
  b.Failed(t + 5, absl::UnavailableError("y"));
  EXPECT_EQ(b.failures(), 2u);
  EXPECT_EQ(b.retry_after_ns(), t + 5 + 2 * ConnectBackoff::kBaseNs);
  EXPECT_EQ(b.last_error().message(), "y");
  // Doubling up to 32x.
  for (int i = 0; i < 10; ++i) {
    t = b.retry_after_ns();
    ASSERT_EQ(b.Admit(t), ConnectBackoff::Verdict::kProbe);
    b.Failed(t, absl::UnavailableError("z"));
  }
  EXPECT_EQ(b.retry_after_ns() - t,
            ConnectBackoff::kBaseNs << ConnectBackoff::kMaxShift);
  // A probe whose result never comes does not block the peer for good.
  t = b.retry_after_ns();
  ASSERT_EQ(b.Admit(t), ConnectBackoff::Verdict::kProbe);
  EXPECT_EQ(b.Admit(t + 3'000'000'000), ConnectBackoff::Verdict::kProbe);
  b.Succeeded();
  EXPECT_EQ(b.Admit(t), ConnectBackoff::Verdict::kGo);
}

// Depth-first search of every interleaving, with a visited set.
class Checker {
 public:
  Checker(const Budget& b, int max_depth, bool liveness)
      : budget_(b), max_depth_(max_depth), liveness_(liveness) {}

  absl::Status Run() { return Explore(World(budget_), 0); }

  size_t states() const { return seen_.size(); }
  size_t quiescent() const { return quiescent_; }
  size_t cut() const { return cut_; }

 private:
  absl::Status Fail(const absl::Status& s) {
    return absl::Status(
        s.code(),
        absl::StrCat(s.message(), "\n  after: ", absl::StrJoin(path_, " ")));
  }

  absl::Status Explore(const World& w, int depth) {
    // Seen at this depth or shallower: explored as far as it can be from
    // here. Seen only deeper (and maybe cut there): its subtree is explored
    // again, or states reachable only below the cut would be missed. Keys
    // are kept as 64-bit hashes: for a few million states a collision (a
    // state wrongly skipped) has a chance of about 1 in 10^6.
    auto [it, fresh] = seen_.try_emplace(absl::HashOf(w.Key()), depth);
    if (!fresh) {
      if (it->second <= depth) return absl::OkStatus();
      it->second = depth;
    }
    if (absl::Status s = w.CheckStep(); !s.ok()) return Fail(s);
    if (w.Quiescent()) {
      ++quiescent_;
      if (absl::Status s = w.CheckQuiescent(); !s.ok()) return Fail(s);
      if (liveness_) {
        // Quiescent and nothing left the sides could do but start over.
        bool more = false;
        for (const auto& e : w.Enabled()) {
          more |= e.kind != World::Event::Kind::kNeed;
        }
        if (!more) {
          if (absl::Status s = w.CheckLive(); !s.ok()) return Fail(s);
        }
      }
    }
    if (depth >= max_depth_) {
      if (cut_ == 0 && std::getenv("FERRY_MODEL_SHOW_CUT") != nullptr) {
        std::printf("cut: %s\n  state: %s\n", absl::StrJoin(path_, " ").c_str(),
                    w.Key().c_str());
        std::fflush(stdout);
      }
      ++cut_;
      return absl::OkStatus();
    }
    for (const World::Event& e : w.Enabled()) {
      World next = w;
      next.Apply(e);
      path_.push_back(e.Describe());
      absl::Status s = Explore(next, depth + 1);
      path_.pop_back();
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  const Budget budget_;
  const int max_depth_;
  const bool liveness_;
  absl::flat_hash_map<size_t, int> seen_;  // The shallowest depth seen.
  std::vector<std::string> path_;
  size_t quiescent_ = 0;
  size_t cut_ = 0;
};

struct Scenario {
  const char* name;
  Budget budget;
  bool liveness;
  int max_depth = 40;
  // The bound in ASan and TSan builds (FERRY_SANITIZER_ALLOCATOR), where a
  // state costs 5-10x more; 0: max_depth.
  int sanitizer_depth = 0;
};

class RailConnectorModelTest : public ::testing::TestWithParam<Scenario> {};

TEST_P(RailConnectorModelTest, EveryInterleavingSettles) {
  const Scenario& sc = GetParam();
  int depth = sc.max_depth;
  if (FERRY_SANITIZER_ALLOCATOR && sc.sanitizer_depth > 0) {
    depth = sc.sanitizer_depth;
  }
  if (const char* d = std::getenv("FERRY_MODEL_DEPTH")) depth = std::atoi(d);
  Checker c(sc.budget, depth, sc.liveness);
  const absl::Status s = c.Run();
  std::printf("%s: %zu states, %zu quiescent, %zu cut at the depth bound\n",
              sc.name, c.states(), c.quiescent(), c.cut());
  EXPECT_OK(s);
  EXPECT_GT(c.quiescent(), 0u);
}

Budget B(int needs, int drops, int op_failures, int local_failures,
         int evictions, int restarts, bool lazy_timers) {
  Budget b;
  b.needs = needs;
  b.drops = drops;
  b.op_failures = op_failures;
  b.local_failures = local_failures;
  b.evictions = evictions;
  b.restarts = restarts;
  b.lazy_timers = lazy_timers;
  return b;
}

INSTANTIATE_TEST_SUITE_P(
    Faults, RailConnectorModelTest,
    ::testing::Values(
        // Both sides need the rail, any order, timers only when idle: it
        // must end connected, with no endpoint failing on the way.
        Scenario{"connect", B(2, 0, 0, 0, 0, 0, true), true},
        // Timers may fire at any moment (a slow peer).
        Scenario{"early-timers", B(2, 0, 0, 0, 0, 0, false), false},
        // In sanitizer builds the larger scenarios stop earlier (states
        // in the full space -> under sanitizers): 1.1 of 6.3 million in
        // all, every kind of step still taken.
        Scenario{"lost-messages", B(2, 2, 0, 0, 0, 0, false), false},
        // 392,000 -> 110,000.
        Scenario{"qp-failures", B(2, 0, 2, 0, 0, 0, false), false, 40, 22},
        // 503,000 -> 177,000.
        Scenario{"endpoint-failures", B(2, 0, 0, 1, 0, 0, false), false, 40,
                 20},
        // 218,000 -> 90,000.
        Scenario{"evictions", B(2, 0, 0, 0, 1, 0, false), false, 40, 22},
        // 1.3 million -> 306,000.
        Scenario{"restart", B(2, 1, 0, 0, 0, 1, false), false, 40, 18},
        // Every kind of fault once: too many interleavings to finish, so
        // bounded at 16 events (3.7 million states); under sanitizers at
        // 12 (230,000).
        Scenario{"everything", B(2, 1, 1, 1, 1, 1, false), false, 16, 12}),
    [](const ::testing::TestParamInfo<Scenario>& info) {
      std::string n = info.param.name;
      for (char& ch : n) {
        if (ch == '-') ch = '_';
      }
      return n;
    });

}  // namespace
}  // namespace ferry::rdma
