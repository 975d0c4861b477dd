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

absl::StatusOr<std::shared_ptr<Store>> Memory(Clock* clock) {
  return std::shared_ptr<Store>(std::make_shared<SegmentStore>(clock));
}

absl::StatusOr<std::shared_ptr<Store>> Durable(Clock* clock) {
  auto s = DurableStore::Open(FreshDir(), clock);
  if (!s.ok()) return s.status();
  return std::shared_ptr<Store>(std::move(*s));
}

using ::ferry::metadata::testing::OverGrpc;

// Every backend here runs its leases on the suite's SimulatedClock: a
// durable write's fdatasync, however slow, takes none of a lease.
constexpr absl::Duration kLease = absl::Milliseconds(500);

INSTANTIATE_TEST_SUITE_P(
    Backends, StoreConformanceTest,
    ::testing::Values(
        StoreBackend{"Memory", Memory, kLease, /*pushes=*/false,
                     /*simulated=*/true},
        StoreBackend{"Durable", Durable, kLease, /*pushes=*/false,
                     /*simulated=*/true},
        StoreBackend{"GrpcMemory",
                     [](Clock* clock) { return OverGrpc(Memory(clock)); },
                     kLease, /*pushes=*/true, /*simulated=*/true},
        StoreBackend{"GrpcDurable",
                     [](Clock* clock) { return OverGrpc(Durable(clock)); },
                     kLease, /*pushes=*/true, /*simulated=*/true}),
    BackendName);

}  // namespace
}  // namespace ferry::metadata
