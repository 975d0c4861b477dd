// PeerChannel: how a transport exchanges small control messages
// (handshakes, notices) with the same transport of a peer engine. The
// engine provides it over its peer service; tests provide scripted ones.
// Keeps the transport interface free of RPC types.
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_PEER_CHANNEL_H_
#define FERRY_TRANSPORT_PEER_CHANNEL_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {

class PeerChannel {
 public:
  // Answers one message from segment `from` (already checked to be a
  // well-formed segment name; the payload is untrusted). An error is
  // returned to the caller as its status.
  using Handler = std::function<absl::StatusOr<std::string>(
      const std::string& from, const std::string& payload)>;

  virtual ~PeerChannel() = default;

  // Routes messages for `transport` to `handler`, replacing any.
  virtual void SetHandler(const std::string& transport, Handler handler) = 0;
  // Stops routing messages to the handler of `transport` and waits until
  // the calls in progress in it have returned: afterwards the handler (and
  // what it captured) is not used again.
  virtual void RemoveHandler(const std::string& transport) = 0;

  // Sends `payload` to `transport` of the engine whose peer service is at
  // `address` and returns its reply. Bounded by the engine's RPC timeout;
  // may block the calling thread that long (never call it on the data
  // path).
  virtual absl::StatusOr<std::string> Call(const std::string& address,
                                           const std::string& transport,
                                           const std::string& payload) = 0;
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_PEER_CHANNEL_H_
