// The shared store suite (store_conformance.h) over every backend in this
// package: in memory, durable, and the gRPC client in front of each (the
// real MetadataServiceImpl on a real RpcServer).
#include "metadata/store_conformance.h"

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "metadata/durable_store.h"
#include "metadata/metadata_client.h"
#include "metadata/metadata_service.h"
#include "metadata/rpc_server.h"
#include "metadata/segment_store.h"

namespace ferry::metadata {
namespace {

std::string FreshDir() {
  static std::atomic<int> n{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/store-", getpid(), "-",
                      n.fetch_add(1));
}

absl::StatusOr<std::shared_ptr<Store>> Memory() {
  return std::shared_ptr<Store>(std::make_shared<SegmentStore>());
}

absl::StatusOr<std::shared_ptr<Store>> Durable() {
  auto s = DurableStore::Open(FreshDir());
  if (!s.ok()) return s.status();
  return std::shared_ptr<Store>(std::move(*s));
}

// A MetadataClient in front of a real server over `backend`.
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

absl::StatusOr<std::shared_ptr<Store>> OverGrpc(
    absl::StatusOr<std::shared_ptr<Store>> backend) {
  if (!backend.ok()) return backend.status();
  auto served = std::make_shared<Served>();
  served->backend = *backend;
  served->service = std::make_unique<MetadataServiceImpl>(backend->get());
  auto server = RpcServer::Start("127.0.0.1:0", {served->service.get()});
  if (!server.ok()) return server.status();
  served->server = std::move(*server);
  served->client = std::make_unique<MetadataClient>(served->server->address(),
                                                    absl::Seconds(5));
  return std::shared_ptr<Store>(served, served->client.get());
}

INSTANTIATE_TEST_SUITE_P(
    Backends, StoreConformanceTest,
    ::testing::Values(
        StoreBackend{"Memory", Memory}, StoreBackend{"Durable", Durable},
        StoreBackend{"GrpcMemory", [] { return OverGrpc(Memory()); }},
        StoreBackend{"GrpcDurable", [] { return OverGrpc(Durable()); }}),
    BackendName);

}  // namespace
}  // namespace ferry::metadata
