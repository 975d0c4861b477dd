// RpcServer: one gRPC server hosting any set of Ferry services on one port
// (an engine hosts its PeerService and, when embedded, the MetadataService).
// Start and Shutdown are not thread-safe with each other; address() is.
#ifndef FERRY_METADATA_RPC_SERVER_H_
#define FERRY_METADATA_RPC_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace ferry::metadata {

class RpcServer {
 public:
  // Starts serving `services` (not owned; must outlive the server) on
  // `listen_address` ("host:port", port 0 picks a free one). Requests larger
  // than kMaxRpcMessageBytes are rejected by gRPC with RESOURCE_EXHAUSTED.
  static absl::StatusOr<std::unique_ptr<RpcServer>> Start(
      const std::string& listen_address,
      const std::vector<grpc::Service*>& services);

  ~RpcServer();

  // "host:port" with the port actually bound.
  const std::string& address() const { return address_; }

  // Stops accepting calls and waits for running ones (bounded by a short
  // deadline). Idempotent.
  void Shutdown();

 private:
  RpcServer() = default;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_RPC_SERVER_H_
