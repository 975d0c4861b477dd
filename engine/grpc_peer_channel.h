// GrpcPeerChannel: the transports' PeerChannel (transport/peer_channel.h)
// over the engine's gRPC peer service, so that a transport exchanges its
// handshakes with no RPC type in sight. The engine is where the two
// layers meet: transports never include metadata/, nor metadata/
// transport/.
//
// Thread-safe (as PeerServiceImpl and PeerClient are).
#ifndef FERRY_ENGINE_GRPC_PEER_CHANNEL_H_
#define FERRY_ENGINE_GRPC_PEER_CHANNEL_H_

#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "metadata/peer_service.h"
#include "transport/peer_channel.h"

namespace ferry {

// Handlers are served by `service`; calls go out through `client` as
// segment `local_segment`. Both must outlive it.
class GrpcPeerChannel final : public PeerChannel {
 public:
  GrpcPeerChannel(metadata::PeerServiceImpl* service,
                  metadata::PeerClient* client, std::string local_segment)
      : service_(service),
        client_(client),
        local_segment_(std::move(local_segment)) {}

  void SetHandler(const std::string& transport, Handler handler) override {
    service_->SetExchangeHandler(transport, std::move(handler));
  }
  void RemoveHandler(const std::string& transport) override {
    service_->RemoveExchangeHandler(transport);
  }
  absl::StatusOr<std::string> Call(const std::string& address,
                                   const std::string& transport,
                                   const std::string& payload) override {
    return client_->Exchange(address, transport, local_segment_, payload);
  }

 private:
  metadata::PeerServiceImpl* const service_;
  metadata::PeerClient* const client_;
  const std::string local_segment_;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_GRPC_PEER_CHANNEL_H_
