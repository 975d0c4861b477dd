#include "transport/rdma/topology.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "transport/rdma/fake_sysfs_testing.h"

namespace ferry::rdma {
namespace {

const std::vector<std::string> kNics = {"nic0", "nic1", "nic2"};

TEST(TopologyTest, PriorityMatrix) {
  auto t = Topology::FromJson(
      R"({"cpu:0": [["nic0"], ["nic1"]], "cuda:0": [["nic1", "nic2"]]})",
      kNics);
  ASSERT_OK(t);
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

// A fake sysfs tree: two PCI root complexes (NUMA nodes 0 and 1), each
// with a PCIe switch holding one NVIDIA GPU and one NIC, plus a third NIC
// straight under root complex 0, a non-NVIDIA display device, and a soft
// NIC with no sysfs entry at all.
class FakeSysfs : public testing::FakeSysfs {
 public:
  FakeSysfs() {
    Device("pci0000:00/0000:00:01.0/0000:01:00.0", "0x030200", "0x10de", 0);
    Device("pci0000:00/0000:00:01.0/0000:01:01.0", "0x020700", "0x15b3", 0);
    Device("pci0000:00/0000:00:02.0", "0x020700", "0x15b3", 0);
    Device("pci0000:80/0000:80:01.0/0000:81:00.0", "0x030200", "0x10de", 1);
    Device("pci0000:80/0000:80:01.0/0000:81:01.0", "0x020700", "0x15b3", 1);
    Device("pci0000:80/0000:80:03.0", "0x030000", "0x1a03", 1);  // BMC VGA.
    Nic("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:01.0");
    Nic("mlx5_1", "pci0000:80/0000:80:01.0/0000:81:01.0");
    Nic("mlx5_2", "pci0000:00/0000:00:02.0");
  }
};

TEST(TopologyTest, FromSysfsPlacesNicsByNumaNodeAndGpuPciDistance) {
  FakeSysfs sysfs;
  const std::vector<std::string> nics = {"mlx5_0", "mlx5_1", "mlx5_2",
                                         "softrnic0"};
  Topology t = Topology::FromSysfs(sysfs.root(), nics);
  // NUMA: mlx5_0 and mlx5_2 sit on node 0, mlx5_1 on node 1.
  EXPECT_EQ(t.Tier("cpu:0", 0), 0);
  EXPECT_EQ(t.Tier("cpu:0", 2), 0);
  EXPECT_EQ(t.Tier("cpu:0", 1), 1);
  EXPECT_EQ(t.Tier("cpu:1", 1), 0);
  EXPECT_EQ(t.Tier("cpu:1", 3), 1);  // The soft NIC is near nothing.
  // cuda:0 is the GPU at 0000:01:00.0: mlx5_0 shares its switch (tier 0),
  // mlx5_2 its NUMA node (tier 1), mlx5_1 is on the other node (tier 2);
  // the soft NIC's node is unknown, so it may be as near (tier 1).
  EXPECT_EQ(t.Tier("cuda:0", 0), 0);
  EXPECT_EQ(t.Tier("cuda:0", 2), 1);
  EXPECT_EQ(t.Tier("cuda:0", 1), 2);
  EXPECT_EQ(t.Tier("cuda:0", 3), 1);
  // cuda:1 (0000:81:00.0) shares a switch with mlx5_1.
  EXPECT_EQ(t.Tier("cuda:1", 1), 0);
  EXPECT_EQ(t.Tier("cuda:1", 0), 2);
  // The BMC's VGA device is not an NVIDIA GPU: there is no cuda:2.
  EXPECT_EQ(t.Tier("cuda:2", 1), 0);
  EXPECT_EQ(t.ToJson(nics),
            R"({"cpu:0": [["mlx5_0", "mlx5_2"], ["mlx5_1", "softrnic0"]], )"
            R"("cpu:1": [["mlx5_1"], ["mlx5_0", "mlx5_2", "softrnic0"]], )"
            R"("cuda:0": [["mlx5_0"], ["mlx5_2", "softrnic0"], ["mlx5_1"]], )"
            R"("cuda:1": [["mlx5_1"], ["softrnic0"], ["mlx5_0", "mlx5_2"]]})");
}

// CUDA's ordinals are the driver's (fastest first by default), not PCI
// order: given the driver's addresses, cuda:N is the GPU at N's address.
TEST(TopologyTest, CudaOrdinalsFollowTheDriversPciAddresses) {
  FakeSysfs sysfs;
  const std::vector<std::string> nics = {"mlx5_0", "mlx5_1", "mlx5_2"};
  Topology t = Topology::FromSysfs(
      sysfs.root(), nics, {"0000:81:00.0", "0000:01:00.0", "0000:c1:00.0"});
  EXPECT_EQ(t.Tier("cuda:0", 1), 0);  // 0000:81:00.0, beside mlx5_1.
  EXPECT_EQ(t.Tier("cuda:0", 0), 2);
  EXPECT_EQ(t.Tier("cuda:1", 0), 0);  // 0000:01:00.0, beside mlx5_0.
  EXPECT_EQ(t.Tier("cuda:1", 2), 1);
  // An address sysfs does not have: no preference, not a wrong one.
  EXPECT_EQ(t.Describe("cuda:2", nics), "every NIC alike");
  EXPECT_EQ(t.Describe("cuda:1", nics),
            "mlx5_0 (tier 0), mlx5_2 (tier 1), mlx5_1 (tier 2)");
}

// A GPU whose nearest NIC in the PCI tree is on another NUMA node: that
// NIC is across the CPU interconnect (nvidia-smi's SYS), tier 2, however
// near it is in the tree, and the doctor's affinity check warns of it.
TEST(TopologyTest, TheNearestNicOnAnotherNodeIsStillFar) {
  testing::FakeSysfs sysfs;
  sysfs.Device("pci0000:00/0000:00:01.0/0000:01:01.0", "0x020700", "0x15b3", 0);
  sysfs.Device("pci0000:80/0000:80:01.0/0000:81:00.0", "0x030200", "0x10de", 1);
  sysfs.Nic("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:01.0");
  Topology t = Topology::FromSysfs(sysfs.root(), {"mlx5_0"});
  EXPECT_EQ(t.Tier("cuda:0", 0), 2);
  EXPECT_EQ(t.Tier("cpu:0", 0), 0);
}

TEST(TopologyTest, FromSysfsWithoutATreeGivesNoPreference) {
  Topology t = Topology::FromSysfs("/nonexistent", {"softrnic0", "softrnic1"});
  EXPECT_EQ(t.Tier("cpu:0", 0), 0);
  EXPECT_EQ(t.Tier("cpu:0", 1), 0);
  EXPECT_EQ(t.Tier("cuda:0", 1), 0);
  EXPECT_EQ(t.ToJson({"softrnic0", "softrnic1"}), "{}");
}

}  // namespace
}  // namespace ferry::rdma
