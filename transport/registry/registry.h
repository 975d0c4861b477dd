// The transports an engine can run, by name: the one place that knows
// every Transport class. A package of its own, above the transports (each
// of which depends on transport/transport.h only), so that adding one
// touches its own package and one line of registry.cc.
#ifndef FERRY_TRANSPORT_REGISTRY_REGISTRY_H_
#define FERRY_TRANSPORT_REGISTRY_REGISTRY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

namespace ferry {

// Creates the transport called `name`, or NotFound listing the known ones.
// Thread-safe.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(
    absl::string_view name, const TransportOptions& options);

// The numeric address of the network interface behind transport `name`'s
// first usable device (for RDMA: the first ACTIVE NIC's RoCE GID), which
// the engine advertises by default; empty if the transport has no devices
// or none maps to an IP address (InfiniBand). Thread-safe.
std::string TransportAdvertiseHint(absl::string_view name,
                                   const TransportOptions& options);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_REGISTRY_REGISTRY_H_
