#include "common/token_proof.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ferry {
namespace {

constexpr char kToken[] = "a-cluster-token-0123";
constexpr char kLabel[] = "ferry test v1";

std::vector<uint8_t> Bytes(const char* s) {
  return std::vector<uint8_t>(s, s + std::strlen(s));
}

// The proof is HMAC-SHA256 over label, NUL, parts: what a peer written in
// another language computes with any HMAC library.
TEST(TokenProofTest, IsHmacSha256OfLabelNulAndParts) {
  const std::vector<uint8_t> a = Bytes("challenge-bytes!"), b = Bytes("frame");
  uint8_t proof[kTokenProofBytes];
  TokenProof(kToken, kLabel, {a, b}, proof);

  std::vector<uint8_t> msg(kLabel, kLabel + sizeof(kLabel));  // With NUL.
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  uint8_t want[32];
  unsigned int len = 0;
  ASSERT_NE(HMAC(EVP_sha256(), kToken, std::strlen(kToken), msg.data(),
                 msg.size(), want, &len),
            nullptr);
  ASSERT_EQ(len, 32u);
  EXPECT_EQ(std::memcmp(proof, want, sizeof(want)), 0);
  EXPECT_TRUE(TokenProofMatches(kToken, kLabel, {a, b}, proof));
}

TEST(TokenProofTest, AnyChangeRefuses) {
  const std::vector<uint8_t> a = Bytes("challenge-bytes!"), b = Bytes("frame");
  uint8_t proof[kTokenProofBytes];
  TokenProof(kToken, kLabel, {a, b}, proof);
  EXPECT_FALSE(TokenProofMatches("another-token-01234", kLabel, {a, b}, proof));
  EXPECT_FALSE(TokenProofMatches(kToken, "ferry test v2", {a, b}, proof));
  std::vector<uint8_t> other = a;
  other[0] ^= 1;
  EXPECT_FALSE(TokenProofMatches(kToken, kLabel, {other, b}, proof));
  for (size_t i = 0; i < kTokenProofBytes; i += 7) {
    uint8_t flipped[kTokenProofBytes];
    std::memcpy(flipped, proof, sizeof(flipped));
    flipped[i] ^= 0x80;
    EXPECT_FALSE(TokenProofMatches(kToken, kLabel, {a, b}, flipped)) << i;
  }
}

}  // namespace
}  // namespace ferry
