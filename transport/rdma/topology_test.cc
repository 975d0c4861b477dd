#include "transport/rdma/topology.h"

#include "gtest/gtest.h"

namespace ferry::rdma {
namespace {

const std::vector<std::string> kNics = {"nic0", "nic1", "nic2"};

TEST(TopologyTest, PriorityMatrix) {
  auto t = Topology::FromJson(
      R"({"cpu:0": [["nic0"], ["nic1"]], "cuda:0": [["nic1", "nic2"]]})",
      kNics);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->Tier("cpu:0", 0), 0);
  EXPECT_EQ(t->Tier("cpu:0", 1), 1);
  EXPECT_EQ(t->Tier("cpu:0", 2), 2);  // Unlisted: after every tier.
  EXPECT_EQ(t->Tier("cuda:0", 1), 0);
  EXPECT_EQ(t->Tier("cuda:0", 2), 0);
  EXPECT_EQ(t->Tier("cuda:0", 0), 1);
  EXPECT_EQ(t->Tier("*", 0), 0);  // No preference.
  EXPECT_EQ(t->Tier("cpu:9", 2), 0);
}

TEST(TopologyTest, RejectsBadMatrices) {
  for (const char* bad :
       {"not json", R"({"cpu:0": "nic0"})", R"({"cpu:0": ["nic0"]})",
        R"({"cpu:0": [[1]]})", R"({"cpu:0": [["nic9"]]})"}) {
    EXPECT_EQ(Topology::FromJson(bad, kNics).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(TopologyTest, FromNumaNodes) {
  Topology t = Topology::FromNumaNodes(kNics, {0, 1, -1});
  EXPECT_EQ(t.Tier("cpu:0", 0), 0);
  EXPECT_EQ(t.Tier("cpu:0", 1), 1);
  EXPECT_EQ(t.Tier("cpu:1", 1), 0);
  EXPECT_EQ(t.Tier("cpu:1", 2), 1);
  EXPECT_EQ(t.Tier("*", 1), 0);
}

}  // namespace
}  // namespace ferry::rdma
