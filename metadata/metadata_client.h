// MetadataClient: talks to a MetadataService (embedded in some engine or a
// standalone tools/metadata_server). Every call has a deadline, so an
// unreachable server yields Unavailable or DeadlineExceeded, never a hang.
//
// Connections. Unary calls go over one connection of this client's own
// and watch streams over others, at most kWatchesPerConnection each: a
// server serves a bounded number of streams per connection
// (RpcServerOptions::max_streams_per_connection, 32) and gRPC queues a
// call beyond it until a stream ends, so 32 watches sharing the unary
// calls' connection would hold every later call -- KeepAlive included --
// until its deadline. No two clients share a connection either (gRPC
// would otherwise merge channels of equal settings in one process: many
// engines in one process, each watching, stalled one another).
// Thread-safe.
#ifndef FERRY_METADATA_METADATA_CLIENT_H_
#define FERRY_METADATA_METADATA_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "grpcpp/support/channel_arguments.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/store.h"
#include "metadata/tls.h"

namespace ferry::metadata {

class MetadataClient final : public Store {
 public:
  // Watch streams one connection carries: half of a server's default
  // stream cap, so a server configured lower still takes them.
  static constexpr int kWatchesPerConnection = 16;
  // Watch connections at most; WatchSegment fails ResourceExhausted
  // beyond (the watcher then refreshes on a miss). A service caps one
  // caller's watches lower anyway (MetadataServiceImpl).
  static constexpr int kMaxWatchConnections = 64;

  // `address` is "host:port". Does not connect yet. Every call carries
  // `auth_token` (auth.h) if it is not empty, over TLS (tls.h) if `tls` is
  // not null.
  MetadataClient(const std::string& address, absl::Duration rpc_timeout,
                 std::string auth_token = "",
                 std::shared_ptr<const Tls> tls = nullptr);

  const std::string& address() const { return address_; }

  // Store, over gRPC. Get validates the descriptor
  // (ValidateSegmentDescriptor) before returning it: a bad one from the
  // server yields InvalidArgument naming the field; DataLoss if the server
  // answers with another segment.
  absl::StatusOr<uint64_t> Put(const PutSegmentRequest& request) override;
  absl::StatusOr<absl::Duration> KeepAlive(
      const KeepAliveRequest& request) override;
  absl::StatusOr<uint64_t> UpdateBuffers(
      const UpdateBuffersRequest& request) override;
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override;
  absl::Status Remove(const RemoveSegmentRequest& request) override;
  absl::StatusOr<std::vector<std::string>> List() override;
  std::string Describe() const override { return address_; }
  // A WatchSegment stream; events are delivered on gRPC's threads. An
  // error of the stream (the service went away) ends the watch with no
  // further event: the reader then refreshes on a miss as before.
  // ResourceExhausted when kMaxWatchConnections are full.
  absl::StatusOr<std::unique_ptr<Watch>> WatchSegment(const std::string& name,
                                                      uint64_t after_version,
                                                      EventFn fn) override;

 private:
  // One connection for watch streams, and how many it carries now (a
  // watch gives its slot back when its stream is over).
  struct WatchLane {
    std::unique_ptr<MetadataService::Stub> stub;
    std::atomic<int> watches{0};
  };

  void Prepare(grpc::ClientContext* ctx) const;

  std::string address_;
  absl::Duration rpc_timeout_;
  std::string token_;
  std::shared_ptr<const Tls> tls_;
  std::unique_ptr<MetadataService::Stub> stub_;
  Mutex lanes_mu_;
  std::vector<std::shared_ptr<WatchLane>> lanes_ ABSL_GUARDED_BY(lanes_mu_);
};

// Ferry's channel settings: message-size limits and quick reconnection.
grpc::ChannelArguments ChannelArgs();

// Creates a channel with ChannelArgs(), over TLS if `tls` is not null.
// `own_connection`: never share the connection with another channel of
// the process (gRPC shares one between channels of equal settings).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const Tls* tls = nullptr,
                                           bool own_connection = false);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_METADATA_CLIENT_H_
