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
// carried across gRPC in its error details, so that no caller has to match
// a message's words.
//   kRetryLater: try again soon, as it is (a receiver that cannot check a
//     notification's sender right now);
//   kRefreshReceiver: the receiver restarted since the sender read its
//     descriptor: read it again, then send again.
enum class Hint { kNone, kRetryLater, kRefreshReceiver };

inline constexpr absl::string_view kHintPayload =
    "type.googleapis.com/ferry.Hint";
inline constexpr absl::string_view kRetryLaterDetails = "ferry:retry-later";
inline constexpr absl::string_view kRefreshReceiverDetails =
    "ferry:refresh-receiver";

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

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const Hint hint = HintOf(s);
  return grpc::Status(
      static_cast<grpc::StatusCode>(s.code()), std::string(s.message()),
      hint == Hint::kRetryLater        ? std::string(kRetryLaterDetails)
      : hint == Hint::kRefreshReceiver ? std::string(kRefreshReceiverDetails)
                                       : std::string());
}

// `what` names the call and peer, so the caller sees which RPC failed where.
inline absl::Status FromGrpcStatus(const grpc::Status& s,
                                   absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()),
                   absl::StrCat(what, ": ", s.error_message()));
  const std::string& d = s.error_details();
  return WithHint(std::move(out), d == kRetryLaterDetails ? Hint::kRetryLater
                                  : d == kRefreshReceiverDetails
                                      ? Hint::kRefreshReceiver
                                      : Hint::kNone);
}

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_GRPC_STATUS_H_
