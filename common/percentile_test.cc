#include "common/percentile.h"

#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(PercentileTest, EmptyIsZero) {
  std::vector<double> v;
  EXPECT_EQ(Percentile(v, 0.5), 0);
}

TEST(PercentileTest, NearestRankBelow) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i);  // Unsorted on purpose.
  EXPECT_EQ(Percentile(v, 0.0), 1);
  // Rank 0.5 x 99 = 49.5 rounds down to 49: the 50th value.
  EXPECT_EQ(Percentile(v, 0.50), 50);
  EXPECT_EQ(Percentile(v, 0.99), 99);
  EXPECT_EQ(Percentile(v, 1.0), 100);
}

TEST(PercentileTest, OneValue) {
  std::vector<double> v = {42.5};
  EXPECT_EQ(Percentile(v, 0.5), 42.5);
  EXPECT_EQ(Percentile(v, 0.99), 42.5);
}

}  // namespace
}  // namespace ferry
