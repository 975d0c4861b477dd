// Shared-token authentication of Ferry's gRPC services (metadata and peer).
//
// With a token configured, a service answers only calls that carry it in
// the "authorization: Bearer <token>" header; any other call gets
// UNAUTHENTICATED before its request is looked at, so it changes nothing.
// Every engine and metadata_server of a cluster is given the same token.
//
// What it protects against: clients on the network that do not know the
// token (a stray or hostile process that can reach the ports) reading,
// publishing, removing or watching segments, handshaking with engines or
// sending them notifications. What it does not: the token travels in the
// clear unless TLS is on, so anyone who can sniff the traffic can learn
// it; anyone who knows it is trusted as much as any engine (still bound by
// owner keys: it cannot change another engine's segment); it does not
// cover the data path (TCP frames and RDMA are authorized by their own
// keys).
#ifndef FERRY_METADATA_AUTH_H_
#define FERRY_METADATA_AUTH_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/auth_token.h"
#include "grpcpp/grpcpp.h"

namespace ferry::metadata {

// The token's form, file and environment (common/auth_token.h), under the
// names callers here have always used.
using ::ferry::AuthTokenFromEnv;
using ::ferry::kAuthTokenEnv;
using ::ferry::kAuthTokenFileEnv;
using ::ferry::kMaxAuthTokenBytes;
using ::ferry::ReadAuthTokenFile;
using ::ferry::ValidateAuthToken;

// Adds `token` to an outgoing call (nothing if it is empty).
void AddAuthToken(grpc::ClientContext* ctx, const std::string& token);

// OK if `token` is empty or the call carries exactly it; UNAUTHENTICATED
// otherwise (compared in constant time).
grpc::Status CheckAuthToken(const grpc::ServerContextBase& ctx,
                            const std::string& token);

// The caller's address as the connection shows it, without its port
// ("ipv4:10.0.0.7", "ipv6:[fd00::7]"): what quotas are kept per, and what a
// notification's receiver is told it came from.
std::string CallerAddress(const grpc::ServerContextBase& ctx);

// The host a caller address (as CallerAddress gives it) stands for, for
// sharing a service fairly: an IPv4 address as it is, an IPv6 one as its
// /64 ("ipv6:[2001:db8:1:2::]/64"), since a host with a /64 could give
// every call an address of its own (SockAddr::AddressGroupKey).
std::string AddressGroup(const std::string& caller_address);

// Whether a server bound to `listen_host` ("" and "::" are every
// interface) can be reached from other hosts.
bool ListensBeyondLoopback(const std::string& listen_host);

// Logs, once per process for each `what` and `listen_address`, a warning
// that `what`, listening there with no token, is open to anyone who can
// reach it, and how to close it. For servers with no token that listen
// beyond loopback (an engine Init again on the same port says it once).
void WarnOpenServer(const std::string& what, const std::string& listen_address);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_AUTH_H_
