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
#include "metadata/proto/metadata.grpc.pb.h"

namespace ferry::metadata {

class MetadataClient {
 public:
  // `address` is "host:port". Does not connect yet.
  MetadataClient(const std::string& address, absl::Duration rpc_timeout);

  const std::string& address() const { return address_; }

  // Returns the version assigned by the server. With a nonzero `lease_ttl`
  // the server removes the segment that long after the last PutSegment,
  // KeepAlive or UpdateBuffers for it.
  absl::StatusOr<uint64_t> PutSegment(
      const SegmentDescriptor& segment,
      absl::Duration lease_ttl = absl::ZeroDuration());
  // Renews the segment's lease; NotFound: the server does not know it
  // (restarted, or the lease expired): publish it again.
  absl::StatusOr<absl::Duration> KeepAlive(const std::string& name,
                                           uint64_t incarnation);
  absl::StatusOr<uint64_t> UpdateBuffers(const UpdateBuffersRequest& request);
  // The descriptor is validated (ValidateSegmentDescriptor) before it is
  // returned: a bad one from the server yields InvalidArgument naming the
  // field. DataLoss if the server answers with another segment.
  absl::StatusOr<SegmentDescriptor> GetSegment(const std::string& name);
  absl::Status RemoveSegment(const std::string& name, uint64_t incarnation);
  absl::StatusOr<std::vector<std::string>> ListSegments();

 private:
  void Prepare(grpc::ClientContext* ctx) const;

  std::string address_;
  absl::Duration rpc_timeout_;
  std::unique_ptr<MetadataService::Stub> stub_;
};

// Creates a channel with Ferry's message-size limits.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_METADATA_CLIENT_H_
