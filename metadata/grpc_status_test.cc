#include "metadata/grpc_status.h"

#include "gtest/gtest.h"

namespace ferry::metadata {
namespace {

// "Try again later" crosses gRPC as a mark, not as words to match: a
// reworded message keeps it, and no other refusal carries it.
TEST(GrpcStatusTest, RetryLaterSurvivesTheWire) {
  const absl::Status later =
      MarkRetryLater(absl::UnavailableError("receiver busy"));
  EXPECT_TRUE(IsRetryLater(later));
  const absl::Status back =
      FromGrpcStatus(ToGrpcStatus(later), "peer x Notify");
  EXPECT_EQ(back.code(), absl::StatusCode::kUnavailable) << back;
  EXPECT_EQ(back.message(), "peer x Notify: receiver busy");
  EXPECT_TRUE(IsRetryLater(back)) << back;

  const absl::Status plain =
      FromGrpcStatus(ToGrpcStatus(absl::UnavailableError("down")), "peer x");
  EXPECT_FALSE(IsRetryLater(plain)) << plain;
  EXPECT_FALSE(IsRetryLater(absl::OkStatus()));
  EXPECT_TRUE(MarkRetryLater(absl::OkStatus()).ok());
}

TEST(GrpcStatusTest, RefreshReceiverSurvivesTheWire) {
  const absl::Status stale =
      WithHint(absl::FailedPreconditionError("receiver restarted"),
               Hint::kRefreshReceiver);
  const absl::Status back = FromGrpcStatus(ToGrpcStatus(stale), "peer x");
  EXPECT_EQ(HintOf(back), Hint::kRefreshReceiver) << back;
  EXPECT_FALSE(IsRetryLater(back)) << back;
  EXPECT_EQ(back.code(), absl::StatusCode::kFailedPrecondition) << back;
}

}  // namespace
}  // namespace ferry::metadata
