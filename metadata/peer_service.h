// The peer service every engine runs: transports route handshake payloads
// through it (Exchange), and engines send each other notifications (Notify).
//
// PeerServiceImpl is thread-safe. Handlers run on gRPC threads and must not
// block for long.
#ifndef FERRY_METADATA_PEER_SERVICE_H_
#define FERRY_METADATA_PEER_SERVICE_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "metadata/proto/metadata.grpc.pb.h"

namespace ferry::metadata {

constexpr size_t kMaxExchangePayloadBytes = 1 << 20;
constexpr size_t kMaxNotifyNameBytes = 256;
constexpr size_t kMaxNotifyMessageBytes = 64 << 10;

class PeerServiceImpl final : public PeerService::Service {
 public:
  // Answers one Exchange payload from `from_segment`; the returned bytes are
  // the reply payload, an error is passed back to the caller as its status.
  using ExchangeHandler = std::function<absl::StatusOr<std::string>(
      const std::string& from_segment, const std::string& payload)>;
  // An error (e.g. a full queue) is returned to the sender.
  using NotifyHandler = std::function<absl::Status(
      const std::string& from_segment, const std::string& name,
      const std::string& message)>;

  // Routes Exchange calls for `transport` to `handler`, replacing any.
  void SetExchangeHandler(const std::string& transport,
                          ExchangeHandler handler);
  // Stops routing calls to the handler of `transport` and waits until the
  // calls in progress in it have returned: after this, the handler (and
  // what it captured) is not used again. For a transport's Shutdown.
  void RemoveExchangeHandler(const std::string& transport);
  void SetNotifyHandler(NotifyHandler handler);

  grpc::Status Exchange(grpc::ServerContext* ctx,
                        const ExchangeRequest* request,
                        ExchangeResponse* response) override;
  grpc::Status Notify(grpc::ServerContext* ctx, const NotifyRequest* request,
                      NotifyResponse* response) override;

 private:
  struct Handler {
    ExchangeHandler fn;
    int calls = 0;  // In progress; guarded by mu_.
  };

  absl::Mutex mu_;
  absl::CondVar call_done_;
  absl::flat_hash_map<std::string, std::shared_ptr<Handler>> handlers_
      ABSL_GUARDED_BY(mu_);
  std::shared_ptr<NotifyHandler> notify_ ABSL_GUARDED_BY(mu_);
};

// Client side of the peer service: one cached channel per peer address.
// Thread-safe.
class PeerClient {
 public:
  explicit PeerClient(absl::Duration rpc_timeout) : rpc_timeout_(rpc_timeout) {}

  absl::StatusOr<std::string> Exchange(const std::string& address,
                                       const std::string& transport,
                                       const std::string& from_segment,
                                       const std::string& payload);
  absl::Status Notify(const std::string& address,
                      const std::string& from_segment, const std::string& name,
                      const std::string& message);

 private:
  PeerService::Stub* StubFor(const std::string& address);

  absl::Duration rpc_timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<PeerService::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_PEER_SERVICE_H_
