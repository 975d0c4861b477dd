// Deadlines handed to gRPC. gRPC measures them on the system clock, and
// no Clock (common/clock.h) can move them: they stay on real time even in
// a component that runs on a SimulatedClock. Such a component gives gRPC
// the time it has left on its own clock, as a real-time timeout; this is
// the one place the metadata plane turns a timeout into a gRPC deadline.
#ifndef FERRY_METADATA_GRPC_DEADLINE_H_
#define FERRY_METADATA_GRPC_DEADLINE_H_

#include <chrono>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ferry::metadata {

// `timeout` from now, on the system clock (an infinite one: never).
inline std::chrono::system_clock::time_point GrpcDeadline(
    absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_GRPC_DEADLINE_H_
