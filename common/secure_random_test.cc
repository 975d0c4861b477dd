#include "common/secure_random.h"

#include <string>

#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(SecureRandomTest, SecretsEqualComparesWholeSecrets) {
  EXPECT_TRUE(SecretsEqual("", ""));
  EXPECT_TRUE(SecretsEqual("owner-key-1234", "owner-key-1234"));
  EXPECT_FALSE(SecretsEqual("owner-key-1234", "owner-key-1235"));
  EXPECT_FALSE(SecretsEqual("xwner-key-1234", "owner-key-1234"));
  EXPECT_FALSE(SecretsEqual("owner-key-1234", "owner-key-123"));
  EXPECT_FALSE(SecretsEqual("", "a"));
  // Embedded NULs are compared like any byte.
  EXPECT_FALSE(SecretsEqual(std::string("a\0b", 3), std::string("a\0c", 3)));
  // Lengths differ: a candidate shorter than the secret is walked as if
  // padded with NULs, which must not make it equal to a NUL-ended secret;
  // a longer one is read only as far as the secret goes.
  EXPECT_FALSE(SecretsEqual("abc", std::string("abc\0", 4)));
  EXPECT_FALSE(SecretsEqual(std::string("abc\0", 4), "abc"));
  EXPECT_FALSE(SecretsEqual("owner-key-12345", "owner-key-1234"));
  EXPECT_FALSE(SecretsEqual("a", ""));
}

TEST(SecureRandomTest, NonZeroValuesDiffer) {
  const uint64_t a = SecureRandomNonZero64(), b = SecureRandomNonZero64();
  EXPECT_NE(a, 0u);
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace ferry
