// RailRouter on its own: rail choice from a snapshot, no NIC.
#include "transport/rdma/rail_router.h"

#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ferry::rdma {
namespace {

constexpr uint64_t kUnit = 64 << 10;

// Two local and two remote NICs, all up, every remote key present.
RailRouter TwoByTwo(uint64_t rotation = 0) {
  RailRouter r(2, 2, kUnit, rotation);
  for (int i = 0; i < 2; ++i) r.SetNic(i, 0, true);
  for (int j = 0; j < 2; ++j) r.SetKey(j, 100 + j);
  return r;
}

TEST(RailRouterTest, IdlePrefersTheMatchedPairOfTheNearestNic) {
  RailRouter r = TwoByTwo();
  // The buffer is near NIC 1: rail 1 -> 1 (index 3).
  const std::vector<int> near1 = {1, 0};
  EXPECT_EQ(r.Choose(near1, 0), 3);
  const std::vector<int> same = {0, 0};
  const int best = r.Choose(same, 0);
  EXPECT_TRUE(best == 0 || best == 3) << best;  // A matched pair.
}

TEST(RailRouterTest, StripesUnderLoad) {
  RailRouter r = TwoByTwo();
  const std::vector<int> tiers = {0, 1};  // NIC 0 is nearer.
  std::map<int, int> per_nic;
  for (int k = 0; k < 64; ++k) {
    const int best = r.Choose(tiers, 0);
    ASSERT_GE(best, 0);
    r.Assign(best, kUnit);
    ++per_nic[r.local_of(best)];
  }
  // Both NICs carry slices; the nearer one more.
  EXPECT_GT(per_nic[1], 0);
  EXPECT_GT(per_nic[0], per_nic[1]);
}

TEST(RailRouterTest, AvoidsDownNicsMissingKeysPausedAndFailedRails) {
  RailRouter r = TwoByTwo();
  const std::vector<int> tiers = {0, 0};
  r.SetNic(0, 0, false);             // Port down: never.
  r.SetKey(1, -1);                   // No key on remote NIC 1: never.
  EXPECT_EQ(r.Choose(tiers, 0), 2);  // 1 -> 0, the only one left.
  // Paused or failed on: used only as the last resort.
  RailRouter p = TwoByTwo();
  p.rail(0).paused = true;
  p.rail(3).paused = true;
  const int best = p.Choose(tiers, /*failed=*/uint64_t{1} << 1);
  EXPECT_EQ(best, 2);
  // All paused or failed on: then the best of them all.
  p.rail(2).paused = true;
  const int last = p.Choose(tiers, uint64_t{1} << 1);
  EXPECT_TRUE(last == 0 || last == 3) << last;
  // Nothing usable at all.
  r.SetKey(0, -1);
  EXPECT_EQ(r.Choose(tiers, 0), -1);
}

TEST(RailRouterTest, RotationSpreadsTies) {
  const std::vector<int> tiers = {0, 0};
  std::map<int, int> chosen;
  for (uint64_t rot = 0; rot < 4; ++rot)
    ++chosen[TwoByTwo(rot).Choose(tiers, 0)];
  EXPECT_EQ(chosen.size(), 2u);  // Both matched pairs get turns.
}

// Choose keeps each local NIC's best remote NIC between slices rather
// than scoring every rail; it must pick exactly the rail a full scan picks
// (ties included), whatever the loads, pauses, keys, ports and failures,
// and as they change between slices.
TEST(RailRouterTest, ChooseAgreesWithAFullScan) {
  std::mt19937_64 rng(42);
  int checked = 0;
  for (int round = 0; round < 300; ++round) {
    const int n_local = 1 + static_cast<int>(rng() % 8);
    const int n_remote = 1 + static_cast<int>(rng() % 8);
    const uint64_t unit = 1 + rng() % 4;  // Small: many ties.
    RailRouter r(n_local, n_remote, unit, rng() % 16);
    for (int i = 0; i < n_local; ++i) r.SetNic(i, rng() % 8, rng() % 8 != 0);
    for (int j = 0; j < n_remote; ++j) {
      r.SetKey(j, rng() % 6 == 0 ? -1 : 7);
    }
    for (int k = 0; k < n_local * n_remote; ++k) {
      r.rail(k).load = rng() % 8;
      r.rail(k).paused = rng() % 5 == 0;
    }
    std::vector<int> tiers(n_local);
    for (int step = 0; step < 40; ++step) {
      for (int& t : tiers) t = static_cast<int>(rng() % 3);
      switch (rng() % 8) {  // Change the snapshot between some slices.
        case 0:             // Another buffer: keys change, present or not.
          r.SetKey(static_cast<int>(rng() % n_remote),
                   rng() % 3 == 0 ? -1 : static_cast<int64_t>(rng() % 1000));
          break;
        case 1:
          r.rail(static_cast<int>(rng() % (n_local * n_remote))).paused ^= true;
          break;
        default:
          break;
      }
      const uint64_t failed = rng() % 4 == 0 ? rng() : 0;
      const int scan = r.ChooseByScan(tiers, failed);
      const int fast = r.Choose(tiers, failed);
      ASSERT_EQ(fast, scan) << "round " << round << " step " << step << ", "
                            << n_local << "x" << n_remote;
      ++checked;
      if (fast >= 0) r.Assign(fast, rng() % (4 * unit));
    }
  }
  EXPECT_EQ(checked, 300 * 40);
}

}  // namespace
}  // namespace ferry::rdma
