// MetadataServiceImpl: the gRPC front of a Store (store.h). Hosted either
// inside an engine (metadata endpoint "embedded", an in-memory store) or by
// tools/metadata_server (in-memory or durable). Thread-safe; gRPC calls it
// from its own threads.
#ifndef FERRY_METADATA_METADATA_SERVICE_H_
#define FERRY_METADATA_METADATA_SERVICE_H_

#include <memory>

#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/segment_store.h"

namespace ferry::metadata {

class MetadataServiceImpl final : public MetadataService::Service {
 public:
  // Serves an in-memory SegmentStore of its own.
  MetadataServiceImpl();
  // Serves `store`, which must outlive the service.
  explicit MetadataServiceImpl(Store* store) : store_(store) {}

  grpc::Status PutSegment(grpc::ServerContext* ctx,
                          const PutSegmentRequest* request,
                          PutSegmentResponse* response) override;
  grpc::Status UpdateBuffers(grpc::ServerContext* ctx,
                             const UpdateBuffersRequest* request,
                             UpdateBuffersResponse* response) override;
  grpc::Status GetSegment(grpc::ServerContext* ctx,
                          const GetSegmentRequest* request,
                          GetSegmentResponse* response) override;
  grpc::Status RemoveSegment(grpc::ServerContext* ctx,
                             const RemoveSegmentRequest* request,
                             RemoveSegmentResponse* response) override;
  grpc::Status ListSegments(grpc::ServerContext* ctx,
                            const ListSegmentsRequest* request,
                            ListSegmentsResponse* response) override;
  grpc::Status KeepAlive(grpc::ServerContext* ctx,
                         const KeepAliveRequest* request,
                         KeepAliveResponse* response) override;

 private:
  std::unique_ptr<SegmentStore> own_store_;
  Store* store_;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_METADATA_SERVICE_H_
