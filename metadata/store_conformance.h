// The test suite every Store (store.h) passes: the in-memory and durable
// stores, the gRPC client in front of each, and the etcd store. A backend
// joins it with
//   INSTANTIATE_TEST_SUITE_P(Mine, StoreConformanceTest,
//                            testing::Values(StoreBackend{...}));
// Each test gets a fresh, empty store from the backend's factory. A
// backend whose leases run on a Clock (common/clock.h) gets a
// SimulatedClock, which the lease tests move: they take no real time and
// cannot fail under load. One whose leases run elsewhere (etcd's, on
// etcd's clock) is waited for in real time, and states the shortest lease
// it supports.
#ifndef FERRY_METADATA_STORE_CONFORMANCE_H_
#define FERRY_METADATA_STORE_CONFORMANCE_H_

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/simulated_clock.h"
#include "gtest/gtest.h"
#include "metadata/store.h"

namespace ferry::metadata {

struct StoreBackend {
  std::string name;
  // A fresh, empty store whose leases run on `clock` where the backend
  // can (then `simulated` is set, and `clock` outlives the store);
  // whatever serves it lives as long as it does.
  std::function<absl::StatusOr<std::shared_ptr<Store>>(Clock* clock)> make;
  // The shortest lease TTL the backend honours.
  absl::Duration min_lease = absl::Milliseconds(500);
  // Whether it must push changes (Store::WatchSegment); others may answer
  // UNIMPLEMENTED, and the watch test skips them.
  bool pushes = false;
  // Whether its leases run on the clock `make` is given: the suite gives
  // a SimulatedClock and moves it. Otherwise `make` gets null and leases
  // are waited for in real time.
  bool simulated = false;
};

// gtest prints a parameter by its name.
inline void PrintTo(const StoreBackend& backend, std::ostream* os) {
  *os << backend.name;
}

class StoreConformanceTest : public ::testing::TestWithParam<StoreBackend> {
 protected:
  void SetUp() override;
  // Lets `d` pass for the store's leases: the simulated clock moves at
  // once, or real time passes.
  void PassTime(absl::Duration d);
  SimulatedClock clock_;  // Outlives store_.
  std::shared_ptr<Store> store_;
};

// For INSTANTIATE_TEST_SUITE_P's name generator.
std::string BackendName(const ::testing::TestParamInfo<StoreBackend>& info);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_STORE_CONFORMANCE_H_
