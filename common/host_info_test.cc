#include "common/host_info.h"

#include "common/socket_util.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(HostInfoTest, PrimaryAddressIsLocalAndNotLoopback) {
  auto primary = PrimaryHostAddress();
  if (!primary.ok()) {
    // A loopback-only host (a fresh network namespace): says so.
    EXPECT_STATUS(primary, absl::StatusCode::kNotFound);
    GTEST_SKIP() << primary.status();
  }
  EXPECT_FALSE(IsLoopbackHost(*primary)) << *primary;
  EXPECT_TRUE(IsLocalAddress(*primary)) << *primary;
}

TEST(HostInfoTest, LocalAddresses) {
  EXPECT_TRUE(IsLocalAddress("127.0.0.1"));
  EXPECT_TRUE(IsLocalAddress("::1"));
  EXPECT_FALSE(IsLocalAddress("0.0.0.0"));
  EXPECT_FALSE(IsLocalAddress("192.0.2.77"));  // TEST-NET-1.
  EXPECT_FALSE(IsLocalAddress("not an address"));
}

TEST(HostInfoTest, NetworkIdentityIsStableAndNamesTheNamespace) {
  const std::string& id = NetworkIdentity();
  EXPECT_EQ(id, NetworkIdentity());
  EXPECT_NE(id.find("/net:"), std::string::npos) << id;
  EXPECT_GT(id.size(), 10u) << id;
}

}  // namespace
}  // namespace ferry
