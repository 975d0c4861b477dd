// Completions' QP map and park lists, without a NIC or a thread: what a
// completion finds, what an endpoint that let go of its QPs no longer
// gets, and that parked endpoints are handed back once and in order.
#include "transport/rdma/completions.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace ferry::rdma {
namespace {

class NoHandler : public CompletionHandler {
 public:
  void OnCompletion(const QpRef&, const ibv_wc&) override { ++calls; }
  void PostParked(const std::shared_ptr<Endpoint>&) override { ++calls; }
  void OnPortChange(int, bool) override { ++calls; }
  void OnDeviceFatal(int) override { ++calls; }
  int calls = 0;
};

std::shared_ptr<Endpoint> MakeEndpoint(uint64_t id) {
  return std::make_shared<Endpoint>(id, nullptr, 1, 0, nullptr, "nic");
}

// Two test NICs (never polled) and two endpoints.
class TwoNicsTest : public ::testing::Test {
 protected:
  TwoNicsTest() {
    c.AddNic(nullptr);
    c.AddNic(nullptr);
  }
  NoHandler handler;
  Completions c{&handler, {}};
  std::shared_ptr<Endpoint> a = MakeEndpoint(1);
  std::shared_ptr<Endpoint> b = MakeEndpoint(2);
};

TEST_F(TwoNicsTest, UntrackForgetsOnlyTheEndpointsOwnQps) {
  c.Track(0, 10, QpRef{a, 0});
  c.Track(0, 11, QpRef{a, 1});
  c.Track(1, 10, QpRef{b, 0});  // The same number on another NIC.
  // QP 11 was reused by b after a let go of it: a's Untrack leaves it.
  c.Track(0, 11, QpRef{b, 1});
  c.Untrack(0, {10, 11}, *a);
  std::vector<std::shared_ptr<Endpoint>> all = c.TakeAll();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0], b);
  EXPECT_EQ(all[1], b);
  EXPECT_TRUE(c.TakeAll().empty()) << "TakeAll empties the maps";
  EXPECT_EQ(handler.calls, 0);
}

TEST_F(TwoNicsTest, ParkedEndpointsComeBackOncePerNic) {
  c.Park(0, a);
  c.Park(1, b);
  c.Park(0, b);
  std::vector<std::shared_ptr<Endpoint>> nic0 = c.TakeParked(0);
  ASSERT_EQ(nic0.size(), 2u);
  EXPECT_EQ(nic0[0], a);
  EXPECT_EQ(nic0[1], b);
  EXPECT_TRUE(c.TakeParked(0).empty());
  // Shutdown collects what is still parked elsewhere.
  std::vector<std::shared_ptr<Endpoint>> rest = c.TakeAll();
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0], b);
}

TEST(CompletionsTest, NoNicNoWorkerNothingToPoll) {
  NoHandler handler;
  Completions c(&handler, {});
  c.AddNic(nullptr);  // A test NIC is never polled.
  EXPECT_EQ(c.Poll(), 0u);
  c.Close();
  EXPECT_EQ(c.Poll(), 0u) << "after Close the NICs are gone";
  EXPECT_EQ(c.threads(), 0u);
}

}  // namespace
}  // namespace ferry::rdma
