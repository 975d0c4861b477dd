// Who is at the other end of each connection RpcServer accepted. RpcServer
// accepts connections itself and hands gRPC their fds, so gRPC names such
// a call's peer "fd:N"; this registry maps N back to the address the
// connection came from, for CallerAddress (auth.h). Thread-safe.
#ifndef FERRY_METADATA_CONNECTION_PEERS_H_
#define FERRY_METADATA_CONNECTION_PEERS_H_

#include <string>

namespace ferry::metadata {

// Records that connection `fd` came from `address` ("ipv4:10.0.0.7"),
// replacing what an earlier connection with that fd number left.
void SetConnectionPeer(int fd, const std::string& address);

// The address of connection `fd`, or "" if none was recorded.
std::string ConnectionPeer(int fd);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_CONNECTION_PEERS_H_
