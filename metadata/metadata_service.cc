#include "metadata/metadata_service.h"

#include "metadata/grpc_status.h"
#include "metadata/validation.h"

namespace ferry::metadata {

MetadataServiceImpl::MetadataServiceImpl()
    : own_store_(std::make_unique<SegmentStore>()), store_(own_store_.get()) {}

grpc::Status MetadataServiceImpl::PutSegment(grpc::ServerContext*,
                                             const PutSegmentRequest* request,
                                             PutSegmentResponse* response) {
  auto version = store_->Put(*request);
  if (!version.ok()) return ToGrpcStatus(version.status());
  response->set_version(*version);
  return grpc::Status::OK;
}

grpc::Status MetadataServiceImpl::KeepAlive(grpc::ServerContext*,
                                            const KeepAliveRequest* request,
                                            KeepAliveResponse* response) {
  auto ttl = store_->KeepAlive(*request);
  if (!ttl.ok()) return ToGrpcStatus(ttl.status());
  response->set_lease_ttl_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(*ttl)));
  return grpc::Status::OK;
}

grpc::Status MetadataServiceImpl::UpdateBuffers(
    grpc::ServerContext*, const UpdateBuffersRequest* request,
    UpdateBuffersResponse* response) {
  auto version = store_->UpdateBuffers(*request);
  if (!version.ok()) return ToGrpcStatus(version.status());
  response->set_version(*version);
  return grpc::Status::OK;
}

grpc::Status MetadataServiceImpl::GetSegment(grpc::ServerContext*,
                                             const GetSegmentRequest* request,
                                             GetSegmentResponse* response) {
  if (absl::Status s = ValidateSegmentName(request->name()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  auto segment = store_->Get(request->name());
  if (!segment.ok()) return ToGrpcStatus(segment.status());
  *response->mutable_segment() = std::move(*segment);
  return grpc::Status::OK;
}

grpc::Status MetadataServiceImpl::RemoveSegment(
    grpc::ServerContext*, const RemoveSegmentRequest* request,
    RemoveSegmentResponse*) {
  return ToGrpcStatus(store_->Remove(*request));
}

grpc::Status MetadataServiceImpl::ListSegments(grpc::ServerContext*,
                                               const ListSegmentsRequest*,
                                               ListSegmentsResponse* response) {
  auto names = store_->List();
  if (!names.ok()) return ToGrpcStatus(names.status());
  for (std::string& name : *names) response->add_names(std::move(name));
  return grpc::Status::OK;
}

}  // namespace ferry::metadata
