// Facts about this host's network that decide which address an engine
// advertises to its peers. Thread-safe; each call reads the kernel's
// current state (no caching), except NetworkIdentity.
#ifndef FERRY_COMMON_HOST_INFO_H_
#define FERRY_COMMON_HOST_INFO_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {

// The address peers most likely reach this host at: the first IPv4
// address of the interface that carries the default route, else of the
// first interface that is up and not loopback, else the first global IPv6
// address of such an interface. NotFound if the host has only loopback.
absl::StatusOr<std::string> PrimaryHostAddress();

// True if the numeric address `host` belongs to an interface of this host
// (its network namespace). Wildcards are not local addresses.
bool IsLocalAddress(absl::string_view host);

// Names this host's network stack: the kernel's boot id and the network
// namespace. Two processes with the same identity share loopback; with
// different ones, one cannot reach the other's 127.0.0.1. Computed once.
const std::string& NetworkIdentity();

// The kernel's boot id (random per boot; computed once), and the inode of
// this process's namespace of `kind` ("net", "pid"; 0 if unknown): two
// processes share a namespace when both match.
const std::string& BootId();
uint64_t NamespaceInode(const char* kind);

}  // namespace ferry

#endif  // FERRY_COMMON_HOST_INFO_H_
