// The RDMA handshake messages (handshake.proto) as they cross the wire:
// parsing and complete validation before anything acts on them. Every
// field of a message from a peer is untrusted: names, counts, QP numbers,
// GIDs, epochs (an epoch near 2^64 would wrap the rail's epoch), enum
// values (proto3 keeps unknown ones).
#ifndef FERRY_TRANSPORT_RDMA_HANDSHAKE_H_
#define FERRY_TRANSPORT_RDMA_HANDSHAKE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/rdma/connector.h"
#include "transport/rdma/handshake.pb.h"

namespace ferry::rdma {

constexpr int kMaxQpsPerRequest = 16;
constexpr size_t kMaxNicNameBytes = 64;
constexpr size_t kMaxRpcAddressBytes = 256;
constexpr size_t kMaxReasonBytes = 1024;
// Epochs count connections of one rail; anything near this is forged.
constexpr uint64_t kMaxEpoch = uint64_t{1} << 48;

// Parses a PeerChannel payload; InvalidArgument if it is not an
// RdmaMessage with a known kind.
absl::StatusOr<RdmaMessage> ParseRdmaMessage(absl::string_view payload);

// A ConnectRequest from segment `from`.
absl::Status ValidateConnectRequest(const ConnectRequest& req,
                                    absl::string_view from);
// A RailNotice from segment `from`.
absl::Status ValidateRailNotice(const RailNotice& n, absl::string_view from);
// The reply to our request, which offered `our_qps` QPs.
absl::Status ValidateConnectReply(const ConnectReply& reply, int our_qps);
// One QP's addressing.
absl::Status ValidateQpInfo(const QpInfo& qp);

// What a (validated) reply means for the rail's RailConnector.
RailConnector::Outcome OutcomeOf(const ConnectReply& reply);

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_HANDSHAKE_H_
