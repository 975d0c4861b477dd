#include "transport/rdma/handshake.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ferry::rdma {
namespace {

absl::Status CheckNic(absl::string_view what, const std::string& name) {
  if (name.empty() || name.size() > kMaxNicNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": NIC name of ",
                                                   name.size(), " bytes (1..",
                                                   kMaxNicNameBytes, ")"));
  }
  for (char c : name) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": NIC name with a non-printable character"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RdmaMessage> ParseRdmaMessage(absl::string_view payload) {
  RdmaMessage msg;
  if (!msg.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::InvalidArgumentError("malformed RDMA message");
  }
  if (msg.kind_case() == RdmaMessage::KIND_NOT_SET) {
    return absl::InvalidArgumentError("RDMA message of no known kind");
  }
  return msg;
}

absl::Status ValidateQpInfo(const QpInfo& qp) {
  if (qp.gid().size() != 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA QP with a GID of ", qp.gid().size(), " bytes"));
  }
  if (qp.qpn() < 2 || qp.qpn() > 0xffffff) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA QP number ", qp.qpn(), " out of range"));
  }
  if (qp.lid() > 0xffff || qp.psn() > 0xffffff) {
    return absl::InvalidArgumentError("RDMA QP with a bad LID or PSN");
  }
  return absl::OkStatus();
}

absl::Status ValidateConnectRequest(const ConnectRequest& req,
                                    absl::string_view from) {
  if (req.initiator_segment() != from) {
    return absl::InvalidArgumentError(
        "RDMA connect request names another segment than its sender");
  }
  const int n = req.initiator_qps_size();
  if (n < 1 || n > kMaxQpsPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RDMA connect request with ", n, " QPs (1..", kMaxQpsPerRequest, ")"));
  }
  FERRY_RETURN_IF_ERROR(CheckNic("RDMA connect request", req.initiator_nic()));
  FERRY_RETURN_IF_ERROR(CheckNic("RDMA connect request", req.target_nic()));
  if (req.initiator_incarnation() == 0) {
    return absl::InvalidArgumentError(
        "RDMA connect request without an incarnation");
  }
  if (req.initiator_rpc_address().size() > kMaxRpcAddressBytes) {
    return absl::InvalidArgumentError(
        "RDMA connect request: peer-service address too long");
  }
  for (char c : req.initiator_rpc_address()) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "RDMA connect request: peer-service address with a non-printable "
          "character");
    }
  }
  if (req.rail_epoch() >= kMaxEpoch) {
    return absl::InvalidArgumentError("RDMA connect request: epoch too large");
  }
  for (const QpInfo& q : req.initiator_qps()) {
    if (q.nic() != req.initiator_nic()) {
      return absl::InvalidArgumentError(
          "RDMA connect request: a QP on another NIC than the request's");
    }
    FERRY_RETURN_IF_ERROR(ValidateQpInfo(q));
  }
  return absl::OkStatus();
}

absl::Status ValidateRailNotice(const RailNotice& n, absl::string_view from) {
  if (n.initiator_segment() != from) {
    return absl::InvalidArgumentError(
        "RDMA notice names another segment than its sender");
  }
  if (n.kind() != RailNotice::READY && n.kind() != RailNotice::DISCONNECT) {
    return absl::InvalidArgumentError("RDMA notice of an unknown kind");
  }
  FERRY_RETURN_IF_ERROR(CheckNic("RDMA notice", n.initiator_nic()));
  FERRY_RETURN_IF_ERROR(CheckNic("RDMA notice", n.target_nic()));
  if (n.epoch() == 0 || n.epoch() >= kMaxEpoch) {
    return absl::InvalidArgumentError("RDMA notice: bad epoch");
  }
  return absl::OkStatus();
}

absl::Status ValidateConnectReply(const ConnectReply& reply, int our_qps) {
  switch (reply.result()) {
    case ConnectReply::ACCEPTED:
      if (reply.target_qps_size() != our_qps) {
        return absl::DataLossError(absl::StrCat("RDMA connect reply has ",
                                                reply.target_qps_size(),
                                                " QPs for our ", our_qps));
      }
      for (const QpInfo& q : reply.target_qps()) {
        FERRY_RETURN_IF_ERROR(ValidateQpInfo(q));
      }
      if (reply.epoch() == 0 || reply.epoch() >= kMaxEpoch) {
        return absl::DataLossError("RDMA connect reply: bad epoch");
      }
      return absl::OkStatus();
    case ConnectReply::LOST_TIE_BREAK:
    case ConnectReply::SUPERSEDED:
      if (reply.epoch() >= kMaxEpoch) {
        return absl::DataLossError("RDMA connect reply: bad epoch");
      }
      return absl::OkStatus();
    case ConnectReply::STALE_INCARNATION:
      return absl::OkStatus();
    case ConnectReply::REFUSED:
      if (reply.reason().size() > kMaxReasonBytes) {
        return absl::DataLossError("RDMA connect reply: reason too long");
      }
      return absl::OkStatus();
    default:
      return absl::DataLossError("RDMA connect reply with an unknown result");
  }
}

RailConnector::Outcome OutcomeOf(const ConnectReply& reply) {
  switch (reply.result()) {
    case ConnectReply::ACCEPTED:
      return RailConnector::Outcome::kAccepted;
    case ConnectReply::LOST_TIE_BREAK:
      return RailConnector::Outcome::kLostTieBreak;
    case ConnectReply::SUPERSEDED:
      return RailConnector::Outcome::kSuperseded;
    case ConnectReply::REFUSED:
      return RailConnector::Outcome::kRefused;
    default:
      return RailConnector::Outcome::kFailed;
  }
}

}  // namespace ferry::rdma
