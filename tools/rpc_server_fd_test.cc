// The gRPC servers under fd exhaustion (issue 9, defect 2): the standalone
// tools/metadata_server and an engine's gRPC server (transfer_bench
// --mode=target), each started for real under a low fd limit. A flood of
// connections larger than the limit must be served or refused, never left
// hanging; the process must survive it; and once the clients leave, a new
// client must be answered again. gRPC 1.51's own listener stops accepting
// for good after one EMFILE (grpc issues 16058, 20418).
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "metadata/metadata_client.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "testing/process_usage.h"
#include "testing/subprocess.h"
#include "tools/tool_test_util.h"

namespace ferry {
namespace {

using ::ferry::testing::ProcessAlive;
using ::ferry::testing::ReadProcessUsage;
using ::ferry::testing::RunfilePath;
using ::ferry::testing::StartTool;
using ::ferry::testing::Subprocess;
using ::ferry::testing::WaitForLine;
using ::ferry::testing::WaitReadable;

constexpr int kFdLimit = 64;
// Well beyond what the limit can hold.
constexpr int kFlood = 3 * kFdLimit;
constexpr int kRounds = 2;
// Silent connections may wait for a handshake timeout before they are
// dropped; everything else is answered at once.
constexpr absl::Duration kAnswerBound = absl::Seconds(20);
constexpr absl::Duration kRecoveryBound = absl::Seconds(15);

// One ListSegments on a fresh connection of its own (a channel that shares
// no subchannel with any earlier one, so an old connection cannot hide a
// deaf listener).
absl::Status ListOnFreshConnection(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(
      address, grpc::InsecureChannelCredentials(), args);
  auto stub = metadata::MetadataService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  ctx.set_wait_for_ready(false);
  metadata::ListSegmentsRequest req;
  metadata::ListSegmentsResponse resp;
  grpc::Status s = stub->ListSegments(&ctx, req, &resp);
  if (s.ok()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("ListSegments: ", s.error_message()));
}

class RpcServerFdTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::vector<std::string> argv;
    std::string ready;
    if (GetParam() == "metadata_server") {
      argv = {RunfilePath("tools/metadata_server"), "--listen=127.0.0.1:0"};
      ready = "metadata_server listening on ";
    } else if (GetParam() == "uncapped_metadata_server") {
      // A cap above the fd limit: accept itself runs out of fds (EMFILE).
      argv = {RunfilePath("tools/metadata_server"), "--listen=127.0.0.1:0",
              "--max_connections=4096"};
      ready = "metadata_server listening on ";
    } else {
      argv = {RunfilePath("tools/transfer_bench"), "--mode=target",
              "--segment_id=fdtest", "--buffer_size=1048576"};
      ready = "target ready: segment=fdtest metadata=";
    }
    ASSERT_OK_AND_ASSIGN(server_, StartTool(argv, kFdLimit));
    ASSERT_OK_AND_ASSIGN(address_,
                         WaitForLine(*server_, ready, absl::Seconds(30)));
  }

  std::unique_ptr<Subprocess> server_;
  std::string address_;
};

TEST_P(RpcServerFdTest, SurvivesFdExhaustionAndRecovers) {
  ASSERT_OK(ListOnFreshConnection(address_));
  ASSERT_OK_AND_ASSIGN(HostPort hp, ParseHostPort(address_));
  const std::string preface = testing::Http2ClientPreface();
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::vector<UniqueFd> conns;
    for (int i = 0; i < kFlood; ++i) {
      auto fd = ConnectTcp(hp, absl::Seconds(2));
      ASSERT_OK(fd) << "connection " << i;
      // Half look like gRPC clients, half never say a word.
      if (i % 2 == 0)
        WriteFull(fd->get(), preface.data(), preface.size()).IgnoreError();
      conns.push_back(std::move(*fd));
    }
    // Served (the server's SETTINGS) or refused (EOF / reset), but answered:
    // a connection left in the accept queue is a deaf server.
    const absl::Time deadline = absl::Now() + kAnswerBound;
    int unanswered = 0;
    for (const UniqueFd& c : conns) {
      if (!WaitReadable(c.get(), deadline - absl::Now())) ++unanswered;
    }
    EXPECT_EQ(unanswered, 0)
        << "of " << kFlood << " connections, " << unanswered
        << " got no answer within " << kAnswerBound;
    ASSERT_TRUE(ProcessAlive(server_->pid())) << "the server died";
    auto usage = ReadProcessUsage(server_->pid());
    ASSERT_OK(usage);
    EXPECT_LE(usage->open_fds, kFdLimit);
    conns.clear();

    const absl::Time recover_by = absl::Now() + kRecoveryBound;
    absl::Status last = ListOnFreshConnection(address_);
    while (!last.ok() && absl::Now() < recover_by) {
      absl::SleepFor(absl::Milliseconds(50));  // Retry pace, not ordering.
      last = ListOnFreshConnection(address_);
    }
    ASSERT_OK(last) << "no answer within " << kRecoveryBound
                    << " after the clients left";
  }
  // And the ordinary client the engines use.
  metadata::MetadataClient client(address_, absl::Seconds(2));
  EXPECT_OK(client.List());
  ASSERT_TRUE(ProcessAlive(server_->pid()));
}

INSTANTIATE_TEST_SUITE_P(Servers, RpcServerFdTest,
                         ::testing::Values("metadata_server",
                                           "uncapped_metadata_server",
                                           "engine"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry
