// For store tests: a store served by the real MetadataServiceImpl on a real
// RpcServer over loopback, seen through a MetadataClient -- what engines
// see of a metadata_server with that store.
#ifndef FERRY_METADATA_STORE_OVER_GRPC_H_
#define FERRY_METADATA_STORE_OVER_GRPC_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "metadata/metadata_client.h"
#include "metadata/metadata_service.h"
#include "metadata/rpc_server.h"
#include "metadata/store.h"

namespace ferry::metadata::testing {

// The client, keeping the server and `backend` alive as long as it lives.
inline absl::StatusOr<std::shared_ptr<Store>> OverGrpc(
    absl::StatusOr<std::shared_ptr<Store>> backend) {
  struct Served {
    std::shared_ptr<Store> backend;
    std::unique_ptr<MetadataServiceImpl> service;
    std::unique_ptr<RpcServer> server;
    std::unique_ptr<MetadataClient> client;
    ~Served() {
      client.reset();
      if (server != nullptr) server->Shutdown();
    }
  };
  if (!backend.ok()) return backend.status();
  auto served = std::make_shared<Served>();
  served->backend = *backend;
  served->service = std::make_unique<MetadataServiceImpl>(backend->get());
  // With a token, as a deployment that uses segments with no lease must
  // be (the conformance tests publish some).
  constexpr char kToken[] = "store-over-grpc-test-token";
  served->service->SetAuthToken(kToken);
  auto server = RpcServer::Start("127.0.0.1:0", {served->service.get()});
  if (!server.ok()) return server.status();
  served->server = std::move(*server);
  served->client = std::make_unique<MetadataClient>(served->server->address(),
                                                    absl::Seconds(5), kToken);
  return std::shared_ptr<Store>(served, served->client.get());
}

}  // namespace ferry::metadata::testing

#endif  // FERRY_METADATA_STORE_OVER_GRPC_H_
