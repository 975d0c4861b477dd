// Conversions between absl::Status and grpc::Status. The canonical codes
// have the same numbering in both.
#ifndef FERRY_METADATA_GRPC_STATUS_H_
#define FERRY_METADATA_GRPC_STATUS_H_

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace ferry::metadata {

// What a Ferry peer should do about a refusal: a payload on the status,
// carried across gRPC in its error details (a google.rpc.Status holding a
// google.rpc.ErrorInfo of domain "ferry", as other gRPC stacks expect that
// trailer to be), so that no caller has to match a message's words.
//   kRetryLater: try again soon, as it is (a receiver that cannot check a
//     call's sender right now);
//   kRefreshReceiver: the receiver restarted since the sender read its
//     descriptor (or another engine has its address now): read it again,
//     then send again.
enum class Hint { kNone, kRetryLater, kRefreshReceiver };

inline constexpr absl::string_view kHintPayload =
    "type.googleapis.com/ferry.Hint";
inline constexpr absl::string_view kRetryLaterDetails = "RETRY_LATER";
inline constexpr absl::string_view kRefreshReceiverDetails = "REFRESH_RECEIVER";
inline constexpr absl::string_view kHintDomain = "ferry";

inline absl::Status WithHint(absl::Status s, Hint hint) {
  if (s.ok() || hint == Hint::kNone) return s;
  s.SetPayload(kHintPayload,
               absl::Cord(hint == Hint::kRetryLater ? kRetryLaterDetails
                                                    : kRefreshReceiverDetails));
  return s;
}

inline Hint HintOf(const absl::Status& s) {
  const auto p = s.GetPayload(kHintPayload);
  if (!p.has_value()) return Hint::kNone;
  if (*p == kRetryLaterDetails) return Hint::kRetryLater;
  if (*p == kRefreshReceiverDetails) return Hint::kRefreshReceiver;
  return Hint::kNone;
}

inline absl::Status MarkRetryLater(absl::Status s) {
  return WithHint(std::move(s), Hint::kRetryLater);
}

inline bool IsRetryLater(const absl::Status& s) {
  return HintOf(s) == Hint::kRetryLater;
}

// The status for gRPC; a hint goes in its error details.
grpc::Status ToGrpcStatus(const absl::Status& s);

// `what` names the call and peer, so the caller sees which RPC failed where.
// A hint in the error details comes back as the status's; details that are
// not a google.rpc.Status, or hold no Ferry hint, are ignored.
absl::Status FromGrpcStatus(const grpc::Status& s, absl::string_view what);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_GRPC_STATUS_H_
