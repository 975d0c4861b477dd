#include "transport/rdma/sieve_cache.h"

#include <set>

#include "gtest/gtest.h"

namespace ferry::rdma {
namespace {

TEST(SieveCacheTest, EvictsUnvisitedOldestFirst) {
  SieveCache<int, int> c(3, [](const int&) { return false; });
  std::vector<int> ev;
  c.Insert(1, 10, &ev);
  c.Insert(2, 20, &ev);
  c.Insert(3, 30, &ev);
  ASSERT_NE(c.Find(1), nullptr);  // 1 is hot.
  c.Insert(4, 40, &ev);           // Evicts 2: oldest not visited.
  ASSERT_EQ(ev, std::vector<int>{20});
  EXPECT_EQ(c.Peek(2), nullptr);
  EXPECT_NE(c.Peek(1), nullptr);
  EXPECT_EQ(c.size(), 3u);
  c.Insert(5, 50, &ev);  // 1's bit was cleared by the sweep: 3 goes.
  EXPECT_EQ(ev.back(), 30);
}

TEST(SieveCacheTest, NeverEvictsBusyEntries) {
  std::set<int> busy = {1, 2};
  SieveCache<int, int> c(2, [&](const int& v) { return busy.count(v) > 0; });
  std::vector<int> ev;
  c.Insert(1, 1, &ev);
  c.Insert(2, 2, &ev);
  c.Insert(3, 3, &ev);  // Both busy: grows instead of evicting.
  EXPECT_TRUE(ev.empty());
  EXPECT_EQ(c.size(), 3u);
  EXPECT_EQ(c.over_capacity_inserts(), 1u);
  busy.erase(1);
  c.Insert(4, 4, &ev);  // Now 1 can go; 2 stays.
  EXPECT_NE(std::find(ev.begin(), ev.end(), 1), ev.end());
  EXPECT_NE(c.Peek(2), nullptr);
}

TEST(SieveCacheTest, HitsRecordedOutsideTheCacheCount) {
  // The data path marks values used without the cache's lock; the hand
  // asks and clears that mark.
  std::set<int> used;
  SieveCache<int, int> c(
      3, [](const int&) { return false; },
      [&](const int& v) { return used.erase(v) > 0; });
  std::vector<int> ev;
  c.Insert(1, 1, &ev);
  c.Insert(2, 2, &ev);
  c.Insert(3, 3, &ev);
  used.insert(1);
  c.Insert(4, 4, &ev);  // 1 was used: 2 goes.
  ASSERT_EQ(ev, std::vector<int>{2});
  EXPECT_TRUE(used.empty());  // The mark was taken.
  c.Insert(5, 5, &ev);        // 1's mark is gone now: 3 goes next...
  EXPECT_EQ(ev.back(), 3);
}

TEST(SieveCacheTest, EraseKeepsHandValid) {
  SieveCache<int, int> c(2, [](const int&) { return false; });
  std::vector<int> ev;
  for (int i = 0; i < 100; ++i) {
    c.Insert(i, i, &ev);
    if (i % 3 == 0) c.Erase(i - 1);
    if (i % 5 == 0) c.Find(i);
  }
  EXPECT_LE(c.size(), 2u);
  c.Clear();
  EXPECT_EQ(c.size(), 0u);
  c.Insert(7, 7, &ev);
  EXPECT_NE(c.Find(7), nullptr);
}

}  // namespace
}  // namespace ferry::rdma
