// MetadataClient: talks to a MetadataService (embedded in some engine or a
// standalone tools/metadata_server). Every call has a deadline, so an
// unreachable server yields Unavailable or DeadlineExceeded, never a hang.
// Thread-safe.
#ifndef FERRY_METADATA_METADATA_CLIENT_H_
#define FERRY_METADATA_METADATA_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/support/channel_arguments.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/store.h"
#include "metadata/tls.h"

namespace ferry::metadata {

class MetadataClient final : public Store {
 public:
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
  absl::StatusOr<std::unique_ptr<Watch>> WatchSegment(const std::string& name,
                                                      uint64_t after_version,
                                                      EventFn fn) override;

 private:
  void Prepare(grpc::ClientContext* ctx) const;

  std::string address_;
  absl::Duration rpc_timeout_;
  std::string token_;
  std::unique_ptr<MetadataService::Stub> stub_;
};

// Ferry's channel settings: message-size limits and quick reconnection.
grpc::ChannelArguments ChannelArgs();

// Creates a channel with ChannelArgs(), over TLS if `tls` is not null.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const Tls* tls = nullptr);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_METADATA_CLIENT_H_
