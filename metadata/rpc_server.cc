#include "metadata/rpc_server.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/socket_util.h"
#include "metadata/validation.h"

namespace ferry::metadata {

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(
    const std::string& listen_address,
    const std::vector<grpc::Service*>& services) {
  auto hp = ParseHostPort(listen_address);
  if (!hp.ok()) return hp.status();
  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort(listen_address, grpc::InsecureServerCredentials(),
                           &bound_port);
  // gRPC sets SO_REUSEPORT by default: a second server (another engine, or
  // a restarted one while the old is alive) then binds the same port
  // without an error, and connections are split between the two -- RPCs
  // meant for one engine reach another (gRPC issue 10755; this made
  // e2e_test flaky under load, with servers on ports picked by port 0).
  // An engine's address must be its own.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(kMaxRpcMessageBytes);
  builder.SetMaxSendMessageSize(kMaxRpcMessageBytes);
  for (grpc::Service* s : services) builder.RegisterService(s);
  std::unique_ptr<RpcServer> server(new RpcServer());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || bound_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot start gRPC server on ", listen_address,
                     " (address in use or not local?)"));
  }
  server->address_ = absl::StrCat(hp->host, ":", bound_port);
  return server;
}

RpcServer::~RpcServer() { Shutdown(); }

void RpcServer::Shutdown() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(500));
  server_->Wait();
  server_.reset();
}

}  // namespace ferry::metadata
