// The build without the etcd back end (--define=ferry_etcd=0, the demo's
// quick build): etcd addresses still parse, and connecting says why not.
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/address/metadata_address.h"

namespace ferry::metadata {
namespace {

TEST(MetadataAddressWithoutEtcdTest, EtcdAddressesSayTheBuildLeftItOut) {
  ASSERT_OK_AND_ASSIGN(MetadataAddress a,
                       ParseMetadataAddress("etcd://127.0.0.1:2379"));
  auto store = ConnectStore(a, absl::Seconds(1));
  EXPECT_STATUS(store, absl::StatusCode::kUnimplemented);
  EXPECT_NE(store.status().message().find("ferry_etcd=0"), std::string::npos)
      << store.status();
}

TEST(MetadataAddressWithoutEtcdTest, OtherAddressesAreUnchanged) {
  ASSERT_OK_AND_ASSIGN(MetadataAddress a, ParseMetadataAddress("embedded"));
  EXPECT_EQ(a.kind, MetadataAddress::Kind::kEmbedded);
  EXPECT_STATUS(ParseMetadataAddress("redis://h:6379"),
                absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::metadata
