#include "metadata/address/metadata_address.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/segment_store.h"
#include "metadata/store_testing.h"

namespace ferry::metadata {
namespace {

using Kind = MetadataAddress::Kind;

TEST(MetadataAddressTest, MooncakeForms) {
  ASSERT_OK_AND_ASSIGN(MetadataAddress a, ParseMetadataAddress("embedded"));
  EXPECT_EQ(a.kind, Kind::kEmbedded);
  ASSERT_OK_AND_ASSIGN(a, ParseMetadataAddress("P2PHANDSHAKE"));
  EXPECT_EQ(a.kind, Kind::kP2p);
  ASSERT_OK_AND_ASSIGN(a, ParseMetadataAddress("10.0.0.1:12050"));
  EXPECT_EQ(a.kind, Kind::kFerry);
  EXPECT_EQ(a.endpoints, std::vector<std::string>{"10.0.0.1:12050"});
  ASSERT_OK_AND_ASSIGN(a, ParseMetadataAddress("ferry://[fd00::1]:12050"));
  EXPECT_EQ(a.kind, Kind::kFerry);
  EXPECT_EQ(a.endpoints, std::vector<std::string>{"[fd00::1]:12050"});
  ASSERT_OK_AND_ASSIGN(
      a,
      ParseMetadataAddress("etcd://10.0.0.5:2379,etcd-b:2379,[fd00::7]:2379"));
  EXPECT_EQ(a.kind, Kind::kEtcd);
  EXPECT_EQ(a.endpoints,
            (std::vector<std::string>{"10.0.0.5:2379", "etcd-b:2379",
                                      "[fd00::7]:2379"}));
}

TEST(MetadataAddressTest, OtherFormsAreRefusedNamingTheForms) {
  for (const char* bad :
       {"", "p2phandshake", "http://10.0.0.1:8080/metadata", "redis://h:6379",
        "etcd://", "etcd://h", "etcd://h:1,", "10.0.0.1", "h:0", "fe80::1:80",
        "ferry://"}) {
    auto a = ParseMetadataAddress(bad);
    EXPECT_STATUS(a, absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(a.status().message().find("etcd://host:port"), std::string::npos)
        << a.status();
  }
}

// Two namespaces over one store: the same short name twice, each sees its
// own, and descriptors come back under the short name.
TEST(MetadataAddressTest, NamespacesKeepClustersApart) {
  auto shared = std::make_shared<SegmentStore>();
  struct Borrowed final : Store {
    std::shared_ptr<Store> s;
    absl::StatusOr<uint64_t> Put(const PutSegmentRequest& r) override {
      return s->Put(r);
    }
    absl::StatusOr<absl::Duration> KeepAlive(
        const KeepAliveRequest& r) override {
      return s->KeepAlive(r);
    }
    absl::StatusOr<uint64_t> UpdateBuffers(
        const UpdateBuffersRequest& r) override {
      return s->UpdateBuffers(r);
    }
    absl::StatusOr<descriptor::SegmentDescriptor> Get(
        const std::string& n) override {
      return s->Get(n);
    }
    absl::Status Remove(const RemoveSegmentRequest& r) override {
      return s->Remove(r);
    }
    absl::StatusOr<std::vector<std::string>> List() override {
      return s->List();
    }
    std::string Describe() const override { return "shared"; }
  };
  auto make = [&](const std::string& ns) {
    auto b = std::make_unique<Borrowed>();
    b->s = shared;
    return NamespacedStore::Create(std::move(b), ns);
  };
  ASSERT_OK_AND_ASSIGN(auto a, make("cluster-a"));
  ASSERT_OK_AND_ASSIGN(auto b, make("cluster-b"));
  descriptor::SegmentDescriptor d;
  d.set_name("prefill-0");
  d.set_incarnation(1);
  ASSERT_OK(a->Put(LeasedPutOf(d)));
  d.set_incarnation(2);
  ASSERT_OK(b->Put(LeasedPutOf(d)));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, a->Get("prefill-0"));
  EXPECT_EQ(got.name(), "prefill-0");
  EXPECT_EQ(got.incarnation(), 1u);
  ASSERT_OK_AND_ASSIGN(auto names, b->List());
  EXPECT_EQ(names, std::vector<std::string>{"prefill-0"});
  ASSERT_OK_AND_ASSIGN(names, shared->List());
  EXPECT_EQ(names, (std::vector<std::string>{"cluster-a/prefill-0",
                                             "cluster-b/prefill-0"}));
  ASSERT_OK(a->Remove(RemoveOf("prefill-0", 1)));
  EXPECT_STATUS(a->Get("prefill-0"), absl::StatusCode::kNotFound);
  EXPECT_OK(b->Get("prefill-0"));
  EXPECT_STATUS(make("has space"), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::metadata
