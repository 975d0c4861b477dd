#include "common/identity.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

std::shared_ptr<const IdentityKey> NewKey() {
  auto key = IdentityKey::Generate();
  EXPECT_TRUE(key.ok()) << key.status();
  return key.ok() ? *key : nullptr;
}

TEST(IdentityTest, ASignatureVerifiesWithItsKeyOnly) {
  auto a = NewKey();
  auto b = NewKey();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->public_key().size(), kIdentityKeyBytes);
  EXPECT_NE(a->public_key(), b->public_key());
  const std::string msg = SignedContent("exchange", {"rdma", "prefill-0", "x"});
  auto sig = a->Sign(msg);
  ASSERT_TRUE(sig.ok()) << sig.status();
  EXPECT_EQ(sig->size(), kSignatureBytes);
  EXPECT_TRUE(VerifySignature(a->public_key(), msg, *sig).ok());
  const absl::Status other = VerifySignature(b->public_key(), msg, *sig);
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied) << other;
  EXPECT_NE(other.message().find("does not match"), std::string::npos) << other;
}

TEST(IdentityTest, AnyChangeToTheMessageOrSignatureIsRefused) {
  auto a = NewKey();
  ASSERT_NE(a, nullptr);
  const std::string msg = SignedContent("notify", {"prefill-0", "kv", "ready"});
  auto sig = a->Sign(msg);
  ASSERT_TRUE(sig.ok()) << sig.status();
  for (size_t i = 0; i < msg.size(); i += 7) {
    std::string m = msg;
    m[i] ^= 1;
    EXPECT_FALSE(VerifySignature(a->public_key(), m, *sig).ok()) << i;
  }
  for (size_t i = 0; i < sig->size(); i += 5) {
    std::string s = *sig;
    s[i] ^= 1;
    EXPECT_FALSE(VerifySignature(a->public_key(), msg, s).ok()) << i;
  }
}

TEST(IdentityTest, MalformedInputsSayWhat) {
  auto a = NewKey();
  ASSERT_NE(a, nullptr);
  auto sig = a->Sign("m");
  ASSERT_TRUE(sig.ok()) << sig.status();
  absl::Status s = VerifySignature(a->public_key(), "m", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("not signed"), std::string::npos) << s;
  s = VerifySignature(a->public_key(), "m", "short");
  EXPECT_NE(s.message().find("5 bytes"), std::string::npos) << s;
  s = VerifySignature("", "m", *sig);
  EXPECT_NE(s.message().find("0 bytes"), std::string::npos) << s;
  s = VerifySignature(std::string(kIdentityKeyBytes, '\xff'), "m", *sig);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
}

TEST(IdentityTest, KindsAndFieldBoundariesSignDifferently) {
  // A signature made for one kind of message, or one split of the same
  // bytes into fields, is no signature for another.
  EXPECT_NE(SignedContent("exchange", {"a", "b"}),
            SignedContent("notify", {"a", "b"}));
  EXPECT_NE(SignedContent("exchange", {"ab", ""}),
            SignedContent("exchange", {"a", "b"}));
  EXPECT_NE(SignedContent("exchange", {"a"}),
            SignedContent("exchange", {"a", ""}));
}

TEST(IdentityTest, OneKeySignsFromManyThreads) {
  auto a = NewKey();
  ASSERT_NE(a, nullptr);
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const std::string msg = SignedContent("exchange", {std::to_string(i)});
        auto sig = a->Sign(msg);
        if (!sig.ok() || !VerifySignature(a->public_key(), msg, *sig).ok()) {
          ++bad[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int b : bad) EXPECT_EQ(b, 0);
}

}  // namespace
}  // namespace ferry
