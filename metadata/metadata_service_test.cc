// Runs the real gRPC metadata and peer services on loopback.
#include "metadata/metadata_service.h"

#include <memory>

#include "common/mutex.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/metadata_client.h"
#include "metadata/peer_service.h"
#include "metadata/rpc_server.h"
#include "metadata/store_testing.h"

namespace ferry::metadata {
namespace {

class MetadataServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = RpcServer::Start("127.0.0.1:0", {&service_, &peer_});
    ASSERT_OK(server);
    server_ = std::move(*server);
    client_ =
        std::make_unique<MetadataClient>(server_->address(), absl::Seconds(5));
  }

  MetadataServiceImpl service_;
  PeerServiceImpl peer_;
  std::unique_ptr<RpcServer> server_;
  std::unique_ptr<MetadataClient> client_;
};

TEST_F(MetadataServiceTest, RoundTrip) {
  SegmentDescriptor seg;
  seg.set_name("engine-a");
  seg.set_incarnation(42);
  auto* t = seg.add_transports();
  t->set_transport("tcp");
  t->set_address("127.0.0.1:5000");
  auto v = client_->Put(PutOf(seg));
  ASSERT_OK(v);
  auto got = client_->Get("engine-a");
  ASSERT_OK(got);
  EXPECT_EQ(got->transports(0).address(), "127.0.0.1:5000");
  auto names = client_->List();
  ASSERT_OK(names);
  EXPECT_EQ(names->size(), 1u);
  EXPECT_OK(client_->Remove(RemoveOf("engine-a", 42)));
  auto gone = client_->Get("engine-a");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("engine-a"), std::string::npos);
}

TEST_F(MetadataServiceTest, MalformedRequestsGetErrorsAndServerSurvives) {
  SegmentDescriptor bad;
  bad.set_name("bad name");
  EXPECT_EQ(client_->Put(PutOf(bad)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Get("").status().code(),
            absl::StatusCode::kInvalidArgument);
  // Oversized: 40 MiB of location strings exceeds the 32 MiB message cap.
  SegmentDescriptor huge;
  huge.set_name("huge");
  for (int i = 0; i < 700; ++i) {
    Buffer* b = huge.add_buffers();
    b->set_addr(static_cast<uint64_t>(i) << 20);
    b->set_length(1);
    b->set_location(std::string(60 << 10, 'x'));
  }
  auto s = client_->Put(PutOf(huge)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Still serving.
  SegmentDescriptor ok;
  ok.set_name("ok");
  EXPECT_OK(client_->Put(PutOf(ok)));
}

// A second server on a port in use fails, instead of sharing the port
// (SO_REUSEPORT) and receiving part of the first one's connections.
TEST_F(MetadataServiceTest, ASecondServerCannotTakeTheSamePort) {
  MetadataServiceImpl other;
  auto second = RpcServer::Start(server_->address(), {&other});
  EXPECT_STATUS(second, absl::StatusCode::kUnavailable);
  // The first still answers everything itself.
  for (int i = 0; i < 20; ++i) {
    metadata::MetadataClient fresh(server_->address(), absl::Seconds(3));
    EXPECT_OK(fresh.List());
  }
}

TEST_F(MetadataServiceTest, PeerExchangeAndNotify) {
  peer_.SetExchangeHandler(
      "echo",
      [](const std::string& from,
         const std::string& payload) -> absl::StatusOr<std::string> {
        if (payload == "fail") return absl::InternalError("asked to fail");
        return from + ":" + payload;
      });
  // Written on a gRPC thread: the RPC's reply orders it before the reads
  // below, but through gRPC's own synchronization, which ThreadSanitizer
  // cannot see; the lock makes the order explicit.
  Mutex mu;
  std::string got_name, got_msg;
  peer_.SetNotifyHandler(
      [&](const std::string&, const std::string& name, const std::string& msg) {
        MutexLock lock(&mu);
        got_name = name;
        got_msg = msg;
        return absl::OkStatus();
      });
  PeerClient peer(absl::Seconds(5));
  auto r = peer.Exchange(server_->address(), "echo", "me", "hi");
  ASSERT_OK(r);
  EXPECT_EQ(*r, "me:hi");
  EXPECT_EQ(
      peer.Exchange(server_->address(), "echo", "me", "fail").status().code(),
      absl::StatusCode::kInternal);
  EXPECT_EQ(
      peer.Exchange(server_->address(), "rdma", "me", "x").status().code(),
      absl::StatusCode::kUnimplemented);
  ASSERT_OK(peer.Notify(server_->address(), "me", "done", "42"));
  {
    MutexLock lock(&mu);
    EXPECT_EQ(got_name, "done");
    EXPECT_EQ(got_msg, "42");
  }
  EXPECT_EQ(peer.Notify(server_->address(), "me", "n",
                        std::string(kMaxNotifyMessageBytes + 1, 'x'))
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetadataClientTest, UnreachableServerFailsFast) {
  // Nothing listens on port 1 of loopback.
  MetadataClient client("127.0.0.1:1", absl::Seconds(2));
  absl::Time start = absl::Now();
  auto s = client.Get("x").status();
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded)
      << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace ferry::metadata
