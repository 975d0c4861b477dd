// ControlQueue's choice of the next job, without threads: per-peer connect
// admission, FIFO order otherwise, and the farewell.
#include "transport/rdma/control_queue.h"

#include <memory>

#include "common/simulated_clock.h"
#include "gtest/gtest.h"

namespace ferry::rdma {
namespace {

using Kind = ControlJob::Kind;

std::shared_ptr<Peer> MakePeer(const std::string& name) {
  return std::make_shared<Peer>(name, true, 1000);
}

ControlJob Job(Kind kind, const std::shared_ptr<Peer>& peer, uint64_t id) {
  ControlJob j;
  j.kind = kind;
  j.ep = std::make_shared<Endpoint>(id, peer, 1, 0, nullptr, "nic");
  j.attempt = id;
  return j;
}

// Takes what may run now; 0 when nothing may.
uint64_t Next(ControlQueue* q) {
  bool over = false;
  std::optional<ControlJob> j = q->TryTake(&over);
  EXPECT_FALSE(over);
  return j.has_value() ? j->attempt : 0;
}

TEST(ControlQueueTest, OneConnectAtATimeToAPeerNotReachedYet) {
  ControlQueue q;
  auto a = MakePeer("a");
  auto b = MakePeer("b");
  q.Push(Job(Kind::kConnect, a, 1));
  q.Push(Job(Kind::kConnect, a, 2));
  q.Push(Job(Kind::kConnect, b, 3));
  q.Push(Job(Kind::kNotice, a, 4));
  bool over = false;
  std::optional<ControlJob> first = q.TryTake(&over);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->attempt, 1u);
  EXPECT_EQ(q.connects_running(a.get()), 1);
  // a's second connect waits; b's and the notice pass it.
  EXPECT_EQ(Next(&q), 3u);
  EXPECT_EQ(Next(&q), 4u);
  EXPECT_EQ(Next(&q), 0u);
  q.Done(*first);
  EXPECT_EQ(q.connects_running(a.get()), 0);
  EXPECT_EQ(Next(&q), 2u);
}

TEST(ControlQueueTest, AReachedPeerRunsSeveralConnects) {
  ControlQueue q;
  auto a = MakePeer("a");
  a->reached.store(true);
  for (uint64_t i = 1; i <= ControlQueue::kMaxConnectsPerPeer + 1; ++i) {
    q.Push(Job(Kind::kConnect, a, i));
  }
  for (uint64_t i = 1; i <= ControlQueue::kMaxConnectsPerPeer; ++i) {
    EXPECT_EQ(Next(&q), i);
  }
  EXPECT_EQ(Next(&q), 0u);
  EXPECT_EQ(q.connects_running(a.get()), ControlQueue::kMaxConnectsPerPeer);
  // Only a connect's end frees a place.
  q.Done(Job(Kind::kNotice, a, 99));
  EXPECT_EQ(Next(&q), 0u);
  q.Done(Job(Kind::kConnect, a, 98));
  EXPECT_EQ(Next(&q), ControlQueue::kMaxConnectsPerPeer + 1u);
}

// A queue on a simulated clock (the farewell's deadline) and one peer.
class FarewellTest : public ::testing::Test {
 protected:
  FarewellTest() { q.SetClock(&clock); }
  SimulatedClock clock;
  ControlQueue q;
  std::shared_ptr<Peer> a = MakePeer("a");
};

TEST_F(FarewellTest, FarewellSendsOnlyQueuedNoticesUntilItsDeadline) {
  q.Push(Job(Kind::kConnect, a, 1));
  q.Push(Job(Kind::kNotice, a, 2));
  q.Push(Job(Kind::kPost, a, 3));
  q.Push(Job(Kind::kNotice, a, 4));
  q.BeginFarewell(clock.Now() + absl::Milliseconds(200));
  EXPECT_EQ(Next(&q), 2u);
  clock.Advance(absl::Milliseconds(200));  // Not past it yet.
  EXPECT_EQ(Next(&q), 4u);
  bool over = false;
  EXPECT_FALSE(q.TryTake(&over).has_value());
  EXPECT_TRUE(over) << "no notice left: the control threads exit";
  // What never ran is handed back for Shutdown to cancel.
  EXPECT_EQ(q.TakeEndpoints().size(), 2u);
  EXPECT_EQ(q.size(), 0u);
}

// Between the start of Shutdown and its deadline being set, a peer request
// still in progress may queue a DISCONNECT: the threads wait for it rather
// than exit, and it goes out.
TEST_F(FarewellTest, NoticesQueuedBeforeTheDeadlineIsSetGoOut) {
  q.BeginFarewell(absl::InfiniteFuture());
  bool over = true;
  EXPECT_FALSE(q.TryTake(&over).has_value());
  EXPECT_FALSE(over) << "a control thread left before the deadline was set";
  q.Push(Job(Kind::kConnect, a, 1));  // Never runs any more.
  q.Push(Job(Kind::kNotice, a, 2));
  EXPECT_EQ(Next(&q), 2u);
  q.BeginFarewell(clock.Now() + absl::Milliseconds(200));
  EXPECT_FALSE(q.TryTake(&over).has_value());
  EXPECT_TRUE(over);
}

TEST_F(FarewellTest, FarewellEndsAtItsDeadline) {
  q.Push(Job(Kind::kNotice, a, 1));
  q.BeginFarewell(clock.Now() + absl::Milliseconds(200));
  clock.Advance(absl::Milliseconds(201));
  bool over = false;
  EXPECT_FALSE(q.TryTake(&over).has_value());
  EXPECT_TRUE(over);
  // Take returns at once too: a control thread never waits past it.
  EXPECT_FALSE(q.Take().has_value());
}

}  // namespace
}  // namespace ferry::rdma
