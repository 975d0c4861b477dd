#include "common/pattern.h"

#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(PatternTest, WordAndByteFormsAgree) {
  for (uint64_t off : {0, 1, 7, 8, 13}) {
    for (size_t len : {0, 1, 5, 8, 9, 100}) {
      std::vector<uint8_t> buf(len);
      FillPattern(buf.data(), len, off, 42);
      for (size_t i = 0; i < len; ++i) {
        ASSERT_EQ(buf[i], PatternByte(off + i, 42)) << off << " " << i;
      }
      EXPECT_EQ(CheckPattern(buf.data(), len, off, 42), len);
    }
  }
}

TEST(PatternTest, CheckFindsFirstBadByte) {
  std::vector<uint8_t> buf(1000);
  FillPattern(buf.data(), buf.size(), 3, 1);
  buf[517] ^= 1;
  EXPECT_EQ(CheckPattern(buf.data(), buf.size(), 3, 1), 517u);
  EXPECT_NE(CheckPattern(buf.data(), buf.size(), 3, 2), buf.size());
}

}  // namespace
}  // namespace ferry
