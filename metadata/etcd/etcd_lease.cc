// EtcdStore's etcd leases: what a segment's keys hang off, so that etcd
// itself removes a dead engine's segment when its lease runs out. Granted
// per publication, renewed by KeepAlive, revoked when the segment goes.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "metadata/etcd/etcd_rpc.h"
#include "metadata/etcd/etcd_store.h"
#include "metadata/grpc_status.h"

namespace ferry::metadata {

absl::StatusOr<int64_t> EtcdStore::GrantLease(absl::Duration ttl,
                                              absl::Time deadline) {
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(std::max<int64_t>(
      1, absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)))));
  etcdserverpb::LeaseGrantResponse resp;
  grpc::Status s =
      RetryUnavailable(clock_, deadline, [&](grpc::ClientContext* ctx) {
        return lease_->LeaseGrant(ctx, req, &resp);
      });
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("etcd ", Describe(), " LeaseGrant"));
  }
  if (!resp.error().empty()) {
    return absl::UnavailableError(
        absl::StrCat("etcd LeaseGrant: ", resp.error()));
  }
  return resp.id();
}

void EtcdStore::RevokeLease(int64_t id, absl::Time deadline) {
  if (id == 0) return;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, clock_, deadline);
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(id);
  etcdserverpb::LeaseRevokeResponse resp;
  lease_->LeaseRevoke(&ctx, req, &resp);  // Best effort: it expires anyway.
}

absl::StatusOr<int64_t> EtcdStore::RenewLease(int64_t id, absl::Time deadline) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, clock_, deadline);
  auto stream = lease_->LeaseKeepAlive(&ctx);
  etcdserverpb::LeaseKeepAliveRequest req;
  req.set_id(id);
  etcdserverpb::LeaseKeepAliveResponse resp;
  const bool ok = stream->Write(req) && stream->Read(&resp);
  stream->WritesDone();
  grpc::Status s = stream->Finish();
  if (!ok) {
    return FromGrpcStatus(
        s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream ended")
               : s,
        absl::StrCat("etcd ", Describe(), " LeaseKeepAlive"));
  }
  return resp.ttl();
}

}  // namespace ferry::metadata
