// The test suite every Store (store.h) passes: the in-memory and durable
// stores, the gRPC client in front of each, and the etcd store. A backend
// joins it with
//   INSTANTIATE_TEST_SUITE_P(Mine, StoreConformanceTest,
//                            testing::Values(StoreBackend{...}));
// Each test gets a fresh, empty store from the backend's factory. Leases
// are real time: a backend states the shortest it supports.
#ifndef FERRY_METADATA_STORE_CONFORMANCE_H_
#define FERRY_METADATA_STORE_CONFORMANCE_H_

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "metadata/store.h"

namespace ferry::metadata {

struct StoreBackend {
  std::string name;
  // A fresh, empty store; whatever serves it lives as long as it does.
  std::function<absl::StatusOr<std::shared_ptr<Store>>()> make;
  // The shortest lease TTL the backend honours.
  absl::Duration min_lease = absl::Milliseconds(500);
  // Whether it must push changes (Store::WatchSegment); others may answer
  // UNIMPLEMENTED, and the watch test skips them.
  bool pushes = false;
};

// gtest prints a parameter by its name.
inline void PrintTo(const StoreBackend& backend, std::ostream* os) {
  *os << backend.name;
}

class StoreConformanceTest : public ::testing::TestWithParam<StoreBackend> {
 protected:
  void SetUp() override;
  std::shared_ptr<Store> store_;
};

// For INSTANTIATE_TEST_SUITE_P's name generator.
std::string BackendName(const ::testing::TestParamInfo<StoreBackend>& info);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_STORE_CONFORMANCE_H_
