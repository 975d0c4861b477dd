// Segments through the public API against hostile or changing metadata:
// forged descriptors, descriptors that change under requests, closing.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status_testing.h"
#include "engine/transfer_engine.h"
#include "gtest/gtest.h"
#include "metadata/grpc_status.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/rpc_server.h"
#include "metadata/segment_store.h"

namespace ferry {
namespace {

// A metadata service that stores what engines publish, like the real one,
// but serves forged descriptors for chosen names: what anyone who can reach
// a metadata service can do, since nothing authenticates descriptors.
class ForgingMetadataService final : public metadata::MetadataService::Service {
 public:
  void Forge(const metadata::SegmentDescriptor& d) {
    MutexLock lock(&mu_);
    forged_[d.name()] = d;
  }
  int gets() {
    MutexLock lock(&mu_);
    return gets_;
  }

  grpc::Status PutSegment(grpc::ServerContext*,
                          const metadata::PutSegmentRequest* req,
                          metadata::PutSegmentResponse* resp) override {
    auto v = store_.Put(req->segment());
    if (!v.ok()) return metadata::ToGrpcStatus(v.status());
    resp->set_version(*v);
    return grpc::Status::OK;
  }
  grpc::Status UpdateBuffers(grpc::ServerContext*,
                             const metadata::UpdateBuffersRequest* req,
                             metadata::UpdateBuffersResponse* resp) override {
    auto v = store_.UpdateBuffers(*req);
    if (!v.ok()) return metadata::ToGrpcStatus(v.status());
    resp->set_version(*v);
    return grpc::Status::OK;
  }
  grpc::Status GetSegment(grpc::ServerContext*,
                          const metadata::GetSegmentRequest* req,
                          metadata::GetSegmentResponse* resp) override {
    {
      MutexLock lock(&mu_);
      ++gets_;
      auto it = forged_.find(req->name());
      if (it != forged_.end()) {
        *resp->mutable_segment() = it->second;
        return grpc::Status::OK;
      }
    }
    auto d = store_.Get(req->name());
    if (!d.ok()) return metadata::ToGrpcStatus(d.status());
    *resp->mutable_segment() = *d;
    return grpc::Status::OK;
  }
  grpc::Status RemoveSegment(grpc::ServerContext*,
                             const metadata::RemoveSegmentRequest* req,
                             metadata::RemoveSegmentResponse*) override {
    return metadata::ToGrpcStatus(
        store_.Remove(req->name(), req->incarnation()));
  }

 private:
  metadata::SegmentStore store_;
  Mutex mu_;
  std::map<std::string, metadata::SegmentDescriptor> forged_
      ABSL_GUARDED_BY(mu_);
  int gets_ ABSL_GUARDED_BY(mu_) = 0;
};

class SegmentsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = metadata::RpcServer::Start("127.0.0.1:0", {&service_});
    ASSERT_OK(server);
    server_ = std::move(*server);
    EngineOptions t;
    t.local_segment_name = "target";
    t.metadata_endpoint = server_->address();
    ASSERT_OK(target_.Init(t));
    EngineOptions i;
    i.local_segment_name = "initiator";
    i.metadata_endpoint = server_->address();
    i.transfer_timeout = absl::Seconds(5);
    ASSERT_OK(initiator_.Init(i));
    remote_.assign(1 << 20, 0);
    local_.assign(1 << 20, 0);
    ASSERT_OK(target_.RegisterLocalMemory(remote_.data(), remote_.size()));
    ASSERT_OK(initiator_.RegisterLocalMemory(local_.data(), local_.size()));
  }

  // Writes `len` bytes of `fill` to the target and waits for the result.
  BatchStatus Write(SegmentHandle seg, uint64_t remote, size_t len,
                    uint8_t fill) {
    std::memset(local_.data(), fill, len);
    TransferRequest r;
    r.opcode = OpCode::kWrite;
    r.source = local_.data();
    r.target_id = seg;
    r.target_offset = remote;
    r.length = len;
    auto batch = initiator_.AllocateBatch(1);
    EXPECT_OK(batch);
    EXPECT_OK(initiator_.SubmitTransfer(*batch, {r}));
    auto st = initiator_.WaitBatch(*batch, absl::Seconds(20));
    EXPECT_OK(st);
    EXPECT_OK(initiator_.FreeBatch(*batch));
    return st.ok() ? *st : BatchStatus{};
  }

  uint64_t RemoteAddr() const {
    return reinterpret_cast<uint64_t>(remote_.data());
  }

  ForgingMetadataService service_;
  std::unique_ptr<metadata::RpcServer> server_;
  TransferEngine target_, initiator_;
  std::vector<uint8_t> remote_, local_;
};

// Reproduced on the unvalidated engine: a TCP endpoint of "nohost" left a
// null connection pool that the TCP transport's reaper dereferenced.
TEST_F(SegmentsTest, ForgedDescriptorFailsOpenSegmentAndChangesNothing) {
  metadata::SegmentDescriptor forged;
  forged.set_name("forged");
  forged.set_incarnation(1);
  auto* tcp = forged.add_transports();
  tcp->set_transport("tcp");
  tcp->set_address("nohost");
  auto* b = forged.add_buffers();
  b->set_addr(0x10000);
  b->set_length(0x10000);
  service_.Forge(forged);
  const std::vector<TransportStats> before = initiator_.GetTransportStats();

  auto h = initiator_.OpenSegment("forged");
  EXPECT_STATUS(h, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(h.status().message().find("transports[0] ('tcp').address"),
            absl::string_view::npos)
      << h.status();
  if (h.ok()) {
    // What the unvalidated engine then did: use it (and crash).
    std::vector<uint8_t> buf(64);
    TransferRequest r{OpCode::kWrite, local_.data(), *h, 0x10000, 64};
    auto batch = initiator_.AllocateBatch(1);
    ASSERT_OK(batch);
    EXPECT_OK(initiator_.SubmitTransfer(*batch, {r}));
    initiator_.WaitBatch(*batch, absl::Seconds(10)).IgnoreError();
    absl::SleepFor(absl::Milliseconds(100));  // Let the reaper run.
  }
  // Nothing else changed: no connection was opened, and the engine still
  // works with a good segment.
  const std::vector<TransportStats> after = initiator_.GetTransportStats();
  ASSERT_EQ(after.size(), before.size());
  EXPECT_EQ(after[0].connects_started, before[0].connects_started);
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, initiator_.OpenSegment("target"));
  EXPECT_EQ(Write(seg, RemoteAddr(), 4096, 0x5a).state,
            TransferState::kCompleted);
  EXPECT_EQ(remote_[4095], 0x5a);
}

// Each kind of forged field is refused by OpenSegment with its name.
TEST_F(SegmentsTest, EveryForgedFieldIsNamed) {
  struct Case {
    const char* name;
    const char* field;
    void (*spoil)(metadata::SegmentDescriptor*);
  };
  const Case cases[] = {
      {"f1", "rpc_address",
       [](metadata::SegmentDescriptor* d) { d->set_rpc_address("x"); }},
      {"f2", "buffers[1]",
       [](metadata::SegmentDescriptor* d) {
         auto* b = d->add_buffers();
         b->set_addr(0x18000);
         b->set_length(0x1000);
       }},
      {"f3", "buffers[0].keys[0].nic",
       [](metadata::SegmentDescriptor* d) {
         d->mutable_buffers(0)->add_keys()->set_nic("mlx5_9");
       }},
      {"f4", "transports[1].transport",
       [](metadata::SegmentDescriptor* d) {
         *d->add_transports() = d->transports(0);
       }},
  };
  for (const Case& c : cases) {
    metadata::SegmentDescriptor d;
    d.set_name(c.name);
    d.set_incarnation(1);
    auto* tcp = d.add_transports();
    tcp->set_transport("tcp");
    tcp->set_address("127.0.0.1:9");
    auto* b = d.add_buffers();
    b->set_addr(0x10000);
    b->set_length(0x10000);
    c.spoil(&d);
    service_.Forge(d);
    auto h = initiator_.OpenSegment(c.name);
    EXPECT_STATUS(h, absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(h.status().message().find(c.field), absl::string_view::npos)
        << h.status();
  }
}

}  // namespace
}  // namespace ferry
