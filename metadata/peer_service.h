// The peer service every engine runs: transports route handshake payloads
// through it (Exchange), and engines send each other notifications (Notify).
//
// PeerServiceImpl is thread-safe. It is served with gRPC's callback API:
// handlers run on a CallPool (call_pool.h), so a handler may block for a
// while without stalling gRPC, and no call holds a thread while its
// response waits for a slow reader.
#ifndef FERRY_METADATA_PEER_SERVICE_H_
#define FERRY_METADATA_PEER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/identity.h"
#include "common/mutex.h"
#include "metadata/call_pool.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/store.h"
#include "metadata/tls.h"

namespace ferry::metadata {

constexpr size_t kMaxExchangePayloadBytes = 1 << 20;
constexpr size_t kMaxNotifyNameBytes = 256;
constexpr size_t kMaxNotifyMessageBytes = 64 << 10;

class PeerServiceImpl final : public PeerService::CallbackService {
 public:
  // Answers one Exchange payload from `from_segment`; the returned bytes are
  // the reply payload, an error is passed back to the caller as its status.
  // Answers one Exchange from segment `from` (already checked to be a
  // well-formed segment name and, where a verifier is set, to have signed
  // it; the payload is untrusted). An error goes back as the call's status.
  // The same type as PeerChannel::Handler (transport/peer_channel.h),
  // which the engine's GrpcPeerChannel hands over.
  using ExchangeHandler = std::function<absl::StatusOr<std::string>(
      const std::string& from, const std::string& payload)>;
  // An error (e.g. a full queue) is returned to the sender. The request's
  // from_segment is what the sender claims; `sender_address` is where the
  // call came from (CallerAddress), which it cannot choose; its signature
  // (empty if it sent none) is of NotifyContent(request): the handler
  // decides what an unverified one gets.
  using NotifyHandler = std::function<absl::Status(
      const NotifyRequest& request, const std::string& sender_address)>;
  // Whether a call comes from the segment it names: OK, or the status the
  // caller gets back. `content` is what the segment signs (SignedContent),
  // `signature` what the call carried, `caller` where it came from, `seq`
  // its number (accepted once; 0: unnumbered, a release before numbers).
  using SenderVerifier = std::function<absl::Status(
      const std::string& from_segment, const std::string& caller,
      const std::string& content, const std::string& signature, uint64_t seq)>;

  // Routes Exchange calls for `transport` to `handler`, replacing any.
  void SetExchangeHandler(const std::string& transport,
                          ExchangeHandler handler);
  // Stops routing calls to the handler of `transport` and waits until the
  // calls in progress in it have returned: after this, the handler (and
  // what it captured) is not used again. For a transport's Shutdown.
  void RemoveExchangeHandler(const std::string& transport);
  void SetNotifyHandler(NotifyHandler handler);
  // Checks every Exchange with `verifier` before its transport's handler
  // sees it (a spoofed handshake or rail notice never reaches the
  // transport). Null: every claim is believed, as a service alone in a
  // test is.
  void SetSenderVerifier(SenderVerifier verifier);
  // Answers only calls carrying `token` (auth.h); empty: any. Call before
  // serving.
  void SetAuthToken(std::string token) { token_ = std::move(token); }
  // Serves GetDescriptor from `source` (null: UNIMPLEMENTED), which must
  // stay valid until it is replaced. P2PHANDSHAKE mode.
  void SetDescriptorSource(Store* source);
  // Returns once no handler runs or waits to (after the server stopped,
  // none starts again). For an owner about to tear down what handlers use.
  void WaitIdle() { pool_.WaitIdle(); }

  grpc::ServerUnaryReactor* Exchange(grpc::CallbackServerContext* ctx,
                                     const ExchangeRequest* request,
                                     ExchangeResponse* response) override;
  grpc::ServerUnaryReactor* Notify(grpc::CallbackServerContext* ctx,
                                   const NotifyRequest* request,
                                   NotifyResponse* response) override;
  grpc::ServerUnaryReactor* GetDescriptor(
      grpc::CallbackServerContext* ctx, const GetSegmentRequest* request,
      GetSegmentResponse* response) override;

 private:
  struct Handler {
    ExchangeHandler fn;
    int calls = 0;  // In progress; guarded by mu_.
  };
  // The token check, before a call takes a pool slot (as in
  // MetadataServiceImpl::Admit).
  grpc::Status Admit(const grpc::CallbackServerContext& ctx);
  grpc::Status ServeExchange(const ExchangeRequest& request,
                             const std::string& caller,
                             ExchangeResponse* response);
  grpc::Status ServeGetDescriptor(const GetSegmentRequest& request,
                                  GetSegmentResponse* response);

  Mutex mu_;
  CondVar call_done_;
  absl::flat_hash_map<std::string, std::shared_ptr<Handler>> handlers_
      ABSL_GUARDED_BY(mu_);
  std::shared_ptr<NotifyHandler> notify_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<SenderVerifier> verifier_ ABSL_GUARDED_BY(mu_);
  Store* descriptor_source_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string token_;
  CallPool pool_;
};

// Client side of the peer service: one cached channel per peer address,
// at most kMaxStubs of them (least recently used ones are closed first).
// Thread-safe.
class PeerClient {
 public:
  static constexpr size_t kMaxStubs = 1024;

  // Every call carries `auth_token` (auth.h) if it is not empty, over TLS
  // (tls.h) if `tls` is not null. Exchange and Notify calls are signed
  // with `identity` (the key the sending segment publishes), unless it is
  // null.
  explicit PeerClient(absl::Duration rpc_timeout, size_t max_stubs = kMaxStubs,
                      std::string auth_token = "",
                      std::shared_ptr<const Tls> tls = nullptr,
                      std::shared_ptr<const IdentityKey> identity = nullptr)
      : rpc_timeout_(rpc_timeout),
        max_stubs_(max_stubs),
        token_(std::move(auth_token)),
        tls_(std::move(tls)),
        identity_(std::move(identity)) {}

  absl::StatusOr<std::string> Exchange(const std::string& address,
                                       const std::string& transport,
                                       const std::string& from_segment,
                                       const std::string& payload);
  // Notifies segment `to_segment` (run `to_incarnation`, as its
  // descriptor says) at `address`; signed, and numbered for the receiver's
  // replay check (every call takes a new number, a retry too).
  absl::Status Notify(const std::string& address,
                      const std::string& from_segment, const std::string& name,
                      const std::string& message, const std::string& to_segment,
                      uint64_t to_incarnation);
  // The descriptor the engine at `address` publishes as `name`
  // (P2PHANDSHAKE), validated; DataLoss if it answers with another one.
  absl::StatusOr<descriptor::SegmentDescriptor> GetDescriptor(
      const std::string& address, const std::string& name);

  // From now on a receiver that answers "retry later" is tried for one
  // RPC timeout only, not kBusyPatience (an engine shutting down); calls
  // already retrying stop at their timeout too.
  void EndPatience() { patient_.store(false, std::memory_order_relaxed); }

  // Closes the channel to `address`, if one is cached.
  void Forget(const std::string& address);
  // Channels cached now.
  size_t size() const;

 private:
  struct CachedStub {
    std::shared_ptr<PeerService::Stub> stub;
    std::list<std::string>::iterator lru;
  };
  // Shared, so that evicting it cannot pull it from under a call.
  std::shared_ptr<PeerService::Stub> StubFor(const std::string& address);

  const absl::Duration rpc_timeout_;
  const size_t max_stubs_;
  const std::string token_;
  const std::shared_ptr<const Tls> tls_;
  const std::shared_ptr<const IdentityKey> identity_;
  std::atomic<uint64_t> next_seq_{1};  // NotifyRequest.seq.
  std::atomic<bool> patient_{true};    // EndPatience.
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, CachedStub> stubs_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // Most recent first.
};

// What a sender signs: every field of the request but the signature, in a
// form no two requests share (SignedContent). A notification's includes
// whom it is for and its number, so that a captured one is good once, for
// one receiver's run.
std::string ExchangeContent(const ExchangeRequest& request);
std::string NotifyContent(const NotifyRequest& request);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_PEER_SERVICE_H_
