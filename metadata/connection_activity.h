// Which of RpcServer's connections have been worth their slot: a
// connection that carried a call its service accepted is "useful"; one
// that carried none, or only calls refused as UNAUTHENTICATED, is not.
// RpcServer sheds connections that are not useful first when it is full
// (rpc_server.h). A gRPC server interceptor (InterceptorFactory) reports
// calls; the accept loop tracks and forgets connections. Thread-safe.
#ifndef FERRY_METADATA_CONNECTION_ACTIVITY_H_
#define FERRY_METADATA_CONNECTION_ACTIVITY_H_

#include <memory>
#include <string>

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
// brackets of IPv6 peers, and may keep the IPv4-mapped form.
std::string NormalizeGrpcPeer(std::string peer);

class ConnectionActivity {
 public:
  // Starts tracking the connection gRPC will call `name` (ConnectionName).
  // Calls on untracked connections are not recorded, so the table holds
  // only connections the accept loop knows about.
  void Track(const std::string& name);
  void Forget(const std::string& name);
  // True once a call on `name` got past authentication.
  bool Useful(const std::string& name) const;

  // Called by the interceptor: a call on `peer` (ServerContextBase::peer())
  // began, or ended with `code`.
  void CallBegan(const std::string& peer);
  void CallRefused(const std::string& peer);

  // An interceptor factory for grpc::ServerBuilder that reports every call
  // to `activity`, which must outlive the server.
  static std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  InterceptorFactory(ConnectionActivity* activity);

 private:
  enum class State { kSilent, kUseful, kRefused };
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, State> state_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_CONNECTION_ACTIVITY_H_
