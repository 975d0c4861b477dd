// Conversions between absl::Status and grpc::Status. The canonical codes
// have the same numbering in both.
#ifndef FERRY_METADATA_GRPC_STATUS_H_
#define FERRY_METADATA_GRPC_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace ferry::metadata {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

// `what` names the call and peer, so the caller sees which RPC failed where.
inline absl::Status FromGrpcStatus(const grpc::Status& s,
                                   absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_GRPC_STATUS_H_
