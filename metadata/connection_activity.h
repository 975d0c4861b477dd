// Which of RpcServer's connections have been worth their slot: a
// connection on which a service sent a response message is "useful"; one
// that carried no call, or only calls answered with an error (a refusal
// for want of the token, an unknown method), is not, and one refused
// UNAUTHENTICATED never becomes useful.
// RpcServer sheds connections that are not useful first when it is full
// (rpc_server.h). A gRPC server interceptor (InterceptorFactory) reports
// calls; the accept loop tracks and forgets connections. Thread-safe.
#ifndef FERRY_METADATA_CONNECTION_ACTIVITY_H_
#define FERRY_METADATA_CONNECTION_ACTIVITY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "grpcpp/support/server_interceptor.h"

namespace ferry::metadata {

// The name gRPC gives the peer of a connection from `sa`
// ("ipv4:10.0.0.7:41234", "ipv6:[fd00::7]:41234"; an IPv4-mapped address
// as the IPv4 one it is).
std::string ConnectionName(const SockAddr& sa);

// ServerContextBase::peer() in the same form: gRPC percent-encodes the
// brackets of IPv6 peers, may keep the IPv4-mapped form, and names a
// link-local peer's scope, which ConnectionName leaves out.
std::string NormalizeGrpcPeer(std::string peer);

class ConnectionActivity {
 public:
  // Starts tracking the connection gRPC will call `name` (ConnectionName),
  // and returns its ticket for Forget. Calls on untracked connections are
  // not recorded, so the table holds only connections the accept loop
  // knows about.
  uint64_t Track(const std::string& name);
  // Stops tracking `name`, unless a later Track of the same name (a new
  // connection from the same address and port) replaced `ticket`'s.
  void Forget(const std::string& name, uint64_t ticket);
  // For each of `names`, under one lock: true once a response message was
  // sent on it, and it was never refused for want of the token.
  std::vector<bool> UsefulAll(
      const std::vector<const std::string*>& names) const;

  // Called by the interceptor: a call on `peer` (ServerContextBase::peer())
  // sent a response message, or ended UNAUTHENTICATED.
  void CallServed(const std::string& peer);
  void CallRefused(const std::string& peer);

  // An interceptor factory for grpc::ServerBuilder that reports every call
  // to `activity`, which must outlive the server.
  static std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  InterceptorFactory(ConnectionActivity* activity);

 private:
  enum class State { kSilent, kUseful, kRefused };
  struct Entry {
    State state = State::kSilent;
    uint64_t ticket = 0;
  };
  mutable Mutex mu_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Entry> state_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_CONNECTION_ACTIVITY_H_
