#include "metadata/metadata_client.h"

#include <sys/socket.h>

#include "absl/strings/str_cat.h"
#include "common/happens_before.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "metadata/auth.h"
#include "metadata/grpc_deadline.h"
#include "metadata/grpc_status.h"
#include "metadata/validation.h"

namespace ferry::metadata {

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxRpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxRpcMessageBytes);
  // Reconnect quickly after a restart of the server instead of gRPC's
  // default backoff of up to two minutes. Not
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: despite its name gRPC uses it as the
  // deadline of each connection attempt (subchannel.cc), and 100 ms for TCP
  // connect plus the server's SETTINGS fails attempts on a loaded machine
  // ("handshaker shutdown", "timed out before receiving SETTINGS frame"), so
  // calls failed with UNAVAILABLE.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // A unary call a service refused at admission (its CallPool full, or
  // the caller's share of it: RESOURCE_EXHAUSTED before any handler ran)
  // is tried again after a jittered back-off, within the call's deadline:
  // a storm of engines opening one target at once queues instead of
  // failing. Whatever a pooled call ends RESOURCE_EXHAUSTED with after its
  // handler ran (a store full, the response over the byte caps) says "no
  // retry" with gRPC's pushback (ServeOnPool). Watch streams are not
  // retried: a refused watch is a refusal to keep (limits per service and
  // caller), and its watcher refreshes on a miss. No retry throttling:
  // in a storm most calls are refused once, and throttling would turn
  // that into failures, the very thing the retries avoid.
  args.SetServiceConfigJSON(R"({"methodConfig": [{
      "name": [
        {"service": "ferry.metadata.MetadataService", "method": "PutSegment"},
        {"service": "ferry.metadata.MetadataService", "method": "UpdateBuffers"},
        {"service": "ferry.metadata.MetadataService", "method": "GetSegment"},
        {"service": "ferry.metadata.MetadataService", "method": "RemoveSegment"},
        {"service": "ferry.metadata.MetadataService", "method": "ListSegments"},
        {"service": "ferry.metadata.MetadataService", "method": "KeepAlive"},
        {"service": "ferry.metadata.PeerService", "method": "Exchange"},
        {"service": "ferry.metadata.PeerService", "method": "Notify"},
        {"service": "ferry.metadata.PeerService", "method": "GetDescriptor"}],
      "retryPolicy": {
        "maxAttempts": 5,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]})");
  return args;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const Tls* tls,
                                           bool own_connection) {
  grpc::ChannelArguments args = ChannelArgs();
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A numeric address goes to gRPC's sockaddr resolver ("ipv4:", "ipv6:"),
  // not its DNS one: no c-ares resolution (and no c-ares allocation left
  // behind at exit) for what is already an address. Names still resolve.
  std::string target = address;
  if (auto sa = ParseNumericEndpoint(address); sa.ok()) {
    target = absl::StrCat(sa->family() == AF_INET6 ? "ipv6:" : "ipv4:",
                          sa->ToString());
  }
  if (tls == nullptr) {
    return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(),
                                     args);
  }
  tls->AddChannelArgs(&args);
  return grpc::CreateCustomChannel(target, tls->ChannelCredentials(), args);
}

MetadataClient::MetadataClient(const std::string& address,
                               absl::Duration rpc_timeout,
                               std::string auth_token,
                               std::shared_ptr<const Tls> tls)
    : address_(address),
      rpc_timeout_(rpc_timeout),
      token_(std::move(auth_token)),
      tls_(std::move(tls)),
      stub_(MetadataService::NewStub(
          MakeChannel(address, tls_.get(), /*own_connection=*/true))) {}

void MetadataClient::Prepare(grpc::ClientContext* ctx) const {
  ctx->set_deadline(GrpcDeadline(rpc_timeout_));
  AddAuthToken(ctx, token_);
}

absl::StatusOr<uint64_t> MetadataClient::Put(const PutSegmentRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  PutSegmentResponse resp;
  grpc::Status s = stub_->PutSegment(&ctx, request, &resp);
  if (!s.ok()) {
    return FromGrpcStatus(
        s, absl::StrCat("metadata server ", address_, " PutSegment"));
  }
  return resp.version();
}

absl::StatusOr<absl::Duration> MetadataClient::KeepAlive(
    const KeepAliveRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  KeepAliveResponse resp;
  grpc::Status s = stub_->KeepAlive(&ctx, request, &resp);
  if (!s.ok()) {
    return FromGrpcStatus(
        s, absl::StrCat("metadata server ", address_, " KeepAlive"));
  }
  return absl::Milliseconds(resp.lease_ttl_ms());
}

absl::StatusOr<uint64_t> MetadataClient::UpdateBuffers(
    const UpdateBuffersRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  UpdateBuffersResponse resp;
  grpc::Status s = stub_->UpdateBuffers(&ctx, request, &resp);
  if (!s.ok()) {
    return FromGrpcStatus(
        s, absl::StrCat("metadata server ", address_, " UpdateBuffers"));
  }
  return resp.version();
}

absl::StatusOr<descriptor::SegmentDescriptor> MetadataClient::Get(
    const std::string& name) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  GetSegmentRequest req;
  req.set_name(name);
  GetSegmentResponse resp;
  grpc::Status s = stub_->GetSegment(&ctx, req, &resp);
  if (!s.ok()) {
    return FromGrpcStatus(
        s, absl::StrCat("metadata server ", address_, " GetSegment"));
  }
  if (resp.segment().name() != name) {
    return absl::DataLossError(
        absl::StrCat("metadata server ", address_, " answered GetSegment('",
                     name, "') with segment '", resp.segment().name(), "'"));
  }
  // Nothing authenticates descriptors: whoever can reach the metadata
  // service can publish one. Check all of it before anything uses it.
  if (absl::Status v = descriptor::ValidateSegmentDescriptor(resp.segment());
      !v.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata server ", address_,
                     " sent an invalid descriptor: ", v.message()));
  }
  return std::move(*resp.mutable_segment());
}

absl::Status MetadataClient::Remove(const RemoveSegmentRequest& request) {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  RemoveSegmentResponse resp;
  return FromGrpcStatus(
      stub_->RemoveSegment(&ctx, request, &resp),
      absl::StrCat("metadata server ", address_, " RemoveSegment"));
}

absl::StatusOr<std::vector<std::string>> MetadataClient::List() {
  grpc::ClientContext ctx;
  Prepare(&ctx);
  ListSegmentsRequest req;
  ListSegmentsResponse resp;
  grpc::Status s = stub_->ListSegments(&ctx, req, &resp);
  if (!s.ok()) {
    return FromGrpcStatus(
        s, absl::StrCat("metadata server ", address_, " ListSegments"));
  }
  return std::vector<std::string>(resp.names().begin(), resp.names().end());
}

namespace {

class ClientWatch final : public Watch,
                          public grpc::ClientReadReactor<SegmentEvent> {
 public:
  // `slot` counts this watch's stream on its connection until it ends.
  ClientWatch(MetadataService::Stub* stub,
              std::shared_ptr<std::atomic<int>> slot, const std::string& name,
              uint64_t after, const std::string& token, Store::EventFn fn)
      : fn_(std::move(fn)), slot_(std::move(slot)) {
    AddAuthToken(&ctx_, token);
    req_.set_name(name);
    req_.set_after_version(after);
    stub->async()->WatchSegment(&ctx_, &req_, this);
    StartRead(&event_);
    HappensBefore(this);  // Callbacks run on gRPC's threads.
    StartCall();
  }
  ~ClientWatch() override {
    ctx_.TryCancel();
    MutexLock lock(&mu_);
    while (!done_) done_cv_.Wait(&mu_);
  }
  void OnReadDone(bool ok) override {
    HappensAfter(this);
    if (!ok) return;  // The stream ended; OnDone follows.
    fn_(event_);
    StartRead(&event_);  // After `gone` too: the name may come back.
  }
  void OnDone(const grpc::Status& status) override {
    HappensAfter(this);
    // The service ended the stream (refused it over a limit, went away):
    // the watcher can no longer tell what changed, so it hears "gone" and
    // reads the segment again. Not when we cancelled it (the watch is
    // being destroyed), nor where the service cannot push at all
    // (UNIMPLEMENTED: the watcher refreshes on a miss anyway).
    if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED &&
        status.error_code() != grpc::StatusCode::UNIMPLEMENTED) {
      SegmentEvent ended;
      ended.set_gone(true);
      fn_(ended);
    }
    slot_->fetch_sub(1);
    MutexLock lock(&mu_);
    done_ = true;
    done_cv_.SignalAll();
  }

 private:
  const Store::EventFn fn_;
  const std::shared_ptr<std::atomic<int>> slot_;
  grpc::ClientContext ctx_;
  WatchSegmentRequest req_;
  SegmentEvent event_;
  Mutex mu_;
  CondVar done_cv_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Watch>> MetadataClient::WatchSegment(
    const std::string& name, uint64_t after_version, EventFn fn) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  std::shared_ptr<WatchLane> lane;
  {
    MutexLock lock(&lanes_mu_);
    for (const auto& l : lanes_) {
      // Claimed here, given back when the stream is over: a lane never
      // carries more than kWatchesPerConnection streams.
      int n = l->watches.load();
      while (n < kWatchesPerConnection &&
             !l->watches.compare_exchange_weak(n, n + 1)) {
      }
      if (n < kWatchesPerConnection) {
        lane = l;
        break;
      }
    }
    if (lane == nullptr) {
      if (lanes_.size() >= static_cast<size_t>(kMaxWatchConnections)) {
        return absl::ResourceExhaustedError(
            absl::StrCat("metadata server ", address_, ": ",
                         kMaxWatchConnections * kWatchesPerConnection,
                         " segments watched at once already"));
      }
      lane = std::make_shared<WatchLane>();
      lane->stub = MetadataService::NewStub(
          MakeChannel(address_, tls_.get(), /*own_connection=*/true));
      lane->watches.store(1);
      lanes_.push_back(lane);
    }
  }
  // The watch keeps its lane (the stub its stream runs on) alive.
  std::shared_ptr<std::atomic<int>> slot(lane, &lane->watches);
  return std::unique_ptr<Watch>(
      std::make_unique<ClientWatch>(lane->stub.get(), std::move(slot), name,
                                    after_version, token_, std::move(fn)));
}

}  // namespace ferry::metadata
