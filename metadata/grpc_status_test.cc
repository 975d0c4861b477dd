#include "metadata/grpc_status.h"

#include "gtest/gtest.h"
#include "metadata/proto/rpc_status.pb.h"

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

// The details are a google.rpc.Status (what other gRPC stacks parse the
// trailer as) with the hint as a google.rpc.ErrorInfo of domain "ferry".
TEST(GrpcStatusTest, DetailsAreAGoogleRpcStatus) {
  const grpc::Status g =
      ToGrpcStatus(MarkRetryLater(absl::UnavailableError("receiver busy")));
  wire::RpcStatus details;
  ASSERT_TRUE(details.ParseFromString(g.error_details()));
  EXPECT_EQ(details.code(), static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_EQ(details.message(), "receiver busy");
  ASSERT_EQ(details.details_size(), 1);
  EXPECT_EQ(details.details(0).type_url(),
            "type.googleapis.com/google.rpc.ErrorInfo");
  wire::ErrorInfo info;
  ASSERT_TRUE(info.ParseFromString(details.details(0).value()));
  EXPECT_EQ(info.reason(), "RETRY_LATER");
  EXPECT_EQ(info.domain(), "ferry");
  // No hint, no details.
  EXPECT_TRUE(ToGrpcStatus(absl::InternalError("x")).error_details().empty());
}

// Details from the wire are untrusted: garbage, another domain's reason,
// or the same reason in another type are no hint.
TEST(GrpcStatusTest, OtherDetailsAreNoHint) {
  const auto code = grpc::StatusCode::UNAVAILABLE;
  EXPECT_EQ(
      HintOf(FromGrpcStatus(grpc::Status(code, "m", "\xff\x01garbage"), "x")),
      Hint::kNone);
  wire::ErrorInfo info;
  info.set_reason("RETRY_LATER");
  info.set_domain("googleapis.com");
  wire::RpcStatus details;
  wire::AnyMessage* any = details.add_details();
  any->set_type_url("type.googleapis.com/google.rpc.ErrorInfo");
  any->set_value(info.SerializeAsString());
  EXPECT_EQ(HintOf(FromGrpcStatus(
                grpc::Status(code, "m", details.SerializeAsString()), "x")),
            Hint::kNone);
  info.set_domain("ferry");
  any->set_value(info.SerializeAsString());
  any->set_type_url("type.googleapis.com/google.rpc.DebugInfo");
  EXPECT_EQ(HintOf(FromGrpcStatus(
                grpc::Status(code, "m", details.SerializeAsString()), "x")),
            Hint::kNone);
  any->set_type_url("type.googleapis.com/google.rpc.ErrorInfo");
  EXPECT_EQ(HintOf(FromGrpcStatus(
                grpc::Status(code, "m", details.SerializeAsString()), "x")),
            Hint::kRetryLater);
}

}  // namespace
}  // namespace ferry::metadata
