#include "metadata/grpc_status.h"

#include "metadata/proto/rpc_status.pb.h"

namespace ferry::metadata {
namespace {

constexpr absl::string_view kErrorInfoType =
    "type.googleapis.com/google.rpc.ErrorInfo";

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(s.code());
  const Hint hint = HintOf(s);
  if (hint == Hint::kNone) return grpc::Status(code, std::string(s.message()));
  wire::ErrorInfo info;
  info.set_reason(std::string(hint == Hint::kRetryLater
                                  ? kRetryLaterDetails
                                  : kRefreshReceiverDetails));
  info.set_domain(std::string(kHintDomain));
  wire::RpcStatus details;
  details.set_code(static_cast<int32_t>(s.code()));
  details.set_message(std::string(s.message()));
  wire::AnyMessage* any = details.add_details();
  any->set_type_url(std::string(kErrorInfoType));
  any->set_value(info.SerializeAsString());
  return grpc::Status(code, std::string(s.message()),
                      details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()),
                   absl::StrCat(what, ": ", s.error_message()));
  // From the wire: parsed, never trusted to be well formed.
  wire::RpcStatus details;
  if (s.error_details().empty() ||
      !details.ParseFromString(s.error_details())) {
    return out;
  }
  for (const wire::AnyMessage& any : details.details()) {
    wire::ErrorInfo info;
    if (any.type_url() != kErrorInfoType ||
        !info.ParseFromString(any.value()) || info.domain() != kHintDomain) {
      continue;
    }
    if (info.reason() == kRetryLaterDetails) {
      return WithHint(std::move(out), Hint::kRetryLater);
    }
    if (info.reason() == kRefreshReceiverDetails) {
      return WithHint(std::move(out), Hint::kRefreshReceiver);
    }
  }
  return out;
}

}  // namespace ferry::metadata
