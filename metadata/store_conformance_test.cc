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
#include "metadata/segment_store.h"
#include "metadata/store_over_grpc.h"

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

using ::ferry::metadata::testing::OverGrpc;

INSTANTIATE_TEST_SUITE_P(
    Backends, StoreConformanceTest,
    // The durable backends get 1 s leases: their writes wait for
    // fdatasync, which a busy shared disk can stretch past 500 ms.
    ::testing::Values(StoreBackend{"Memory", Memory},
                      StoreBackend{"Durable", Durable, absl::Seconds(1)},
                      StoreBackend{"GrpcMemory",
                                   [] { return OverGrpc(Memory()); },
                                   absl::Milliseconds(500), /*pushes=*/true},
                      StoreBackend{"GrpcDurable",
                                   [] { return OverGrpc(Durable()); },
                                   absl::Seconds(1), /*pushes=*/true}),
    BackendName);

}  // namespace
}  // namespace ferry::metadata
