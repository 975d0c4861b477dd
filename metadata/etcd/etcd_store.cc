// EtcdStore's construction and its reads (Get, List, KeepAlive); the rest
// lives by concern: changes in etcd_write.cc, the consistent read of a
// segment in etcd_read.cc, leases in etcd_lease.cc, watches in
// etcd_watch.cc (etcd_store.h says how each works).
#include "metadata/etcd/etcd_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/secure_random.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "metadata/etcd/etcd_rpc.h"
#include "metadata/grpc_status.h"
#include "metadata/metadata_client.h"
#include "metadata/validation.h"

namespace ferry::metadata {

using etcdserverpb::RequestOp;
using etcdserverpb::TxnRequest;
using etcdserverpb::TxnResponse;

namespace {

std::shared_ptr<grpc::Channel> EtcdChannel(const std::vector<std::string>& eps,
                                           std::string* error) {
  std::vector<std::string> addrs;
  int family = 0;
  for (const std::string& ep : eps) {
    auto hp = ParseHostPort(ep);
    if (!hp.ok() || hp->port == 0) {
      *error = absl::StrCat("etcd endpoint '", ep, "' is not host:port");
      return nullptr;
    }
    auto host = ResolveHost(hp->host);
    if (!host.ok()) {
      *error =
          absl::StrCat("etcd endpoint '", ep, "': ", host.status().message());
      return nullptr;
    }
    auto sa = ParseNumericEndpoint(JoinHostPort(*host, hp->port));
    if (!sa.ok()) {
      *error = std::string(sa.status().message());
      return nullptr;
    }
    if (family != 0 && sa->family() != family) {
      *error = "etcd endpoints mix IPv4 and IPv6 addresses";
      return nullptr;
    }
    family = sa->family();
    addrs.push_back(sa->ToString());
  }
  grpc::ChannelArguments args = ChannelArgs();
  // Every member is a way in: calls go on over the live ones when one dies.
  args.SetLoadBalancingPolicyName("round_robin");
  const std::string target = absl::StrCat(
      family == AF_INET6 ? "ipv6:" : "ipv4:", absl::StrJoin(addrs, ","));
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(),
                                   args);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdStore>> EtcdStore::Create(
    EtcdOptions options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError("etcd store: no endpoints");
  }
  if (options.prefix.empty() || options.prefix.back() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd key prefix '", options.prefix, "' must end with '/'"));
  }
  if (options.max_txn_ops < 8) {
    return absl::InvalidArgumentError("etcd max_txn_ops must be at least 8");
  }
  std::string error;
  auto channel = EtcdChannel(options.endpoints, &error);
  if (channel == nullptr) return absl::InvalidArgumentError(error);
  std::unique_ptr<EtcdStore> store(new EtcdStore(std::move(options)));
  store->kv_ = etcdserverpb::KV::NewStub(channel);
  store->lease_ = etcdserverpb::Lease::NewStub(channel);
  store->watch_ = etcdserverpb::Watch::NewStub(channel);
  return store;
}

EtcdStore::EtcdStore(EtcdOptions options)
    : options_(std::move(options)),
      clock_(ClockOrReal(options_.clock)),
      keys_(options_.prefix),
      usage_(options_, options_.prefix),
      compaction_(options_) {}

std::string EtcdStore::Describe() const {
  return absl::StrCat("etcd://", absl::StrJoin(options_.endpoints, ","), " (",
                      options_.prefix, ")");
}

absl::Status EtcdStore::NotRegistered(const std::string& name) {
  return absl::NotFoundError(absl::StrCat(
      "segment '", name,
      "' is not registered (never published, or its lease expired)"));
}

absl::Status EtcdStore::HeldByAnother(const std::string& name) {
  return absl::FailedPreconditionError(
      absl::StrCat("segment '", name,
                   "' is held by another engine run (another owner key)"));
}

absl::StatusOr<TxnResponse> EtcdStore::Txn(const TxnRequest& txn,
                                           absl::Time deadline) {
  TxnResponse resp;
  grpc::Status s = RetryUnavailable(
      clock_, deadline,
      [&](grpc::ClientContext* ctx) { return kv_->Txn(ctx, txn, &resp); });
  if (!s.ok()) {
    if (absl::StrContains(s.error_message(), "database space exceeded")) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "etcd ", Describe(),
          " is out of space (its NOSPACE alarm is raised) and refuses every "
          "write: compact its history, defragment it and disarm the alarm "
          "(etcdctl compact, etcdctl defrag, etcdctl alarm disarm), and "
          "keep EtcdOptions::max_bytes below its --quota-backend-bytes"));
    }
    // etcd's own check ("request is too large") and its gRPC server's
    // (max-request-bytes plus 512 KiB; this client's own limit on replies
    // says "Received ..."): say which limit, and the size.
    if (absl::StrContains(s.error_message(), "request is too large") ||
        absl::StrContains(s.error_message(),
                          "grpc: received message larger than max")) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "etcd ", Describe(), " refused a transaction of ", txn.ByteSizeLong(),
          " bytes as too large (etcd's "
          "--max-request-bytes, 1.5 MiB by default): ",
          s.error_message()));
    }
    return FromGrpcStatus(s, absl::StrCat("etcd ", Describe(), " Txn"));
  }
  return resp;
}

absl::StatusOr<absl::Duration> EtcdStore::KeepAlive(
    const KeepAliveRequest& request) {
  const std::string& name = request.name();
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  FERRY_ASSIGN_OR_RETURN(const Snapshot snap,
                         ReadSegment(name, /*all_buffers=*/false, nullptr));
  if (!snap.exists) return NotRegistered(name);
  if (!SecretsEqual(request.owner_key(), snap.owner_key))
    return HeldByAnother(name);
  if (snap.meta.lease_id() == 0) return absl::ZeroDuration();
  FERRY_ASSIGN_OR_RETURN(
      const int64_t ttl,
      RenewLease(snap.meta.lease_id(), clock_->Now() + options_.rpc_timeout));
  if (ttl <= 0) return NotRegistered(name);  // Expired meanwhile.
  return absl::Seconds(ttl);
}

absl::StatusOr<descriptor::SegmentDescriptor> EtcdStore::Get(
    const std::string& name) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  FERRY_ASSIGN_OR_RETURN(Snapshot snap,
                         ReadSegment(name, /*all_buffers=*/true, nullptr));
  if (!snap.exists) return NotRegistered(name);
  descriptor::SegmentDescriptor d = snap.meta.segment();
  d.set_version(static_cast<uint64_t>(snap.meta_revision));
  d.mutable_buffers()->Reserve(static_cast<int>(snap.buffers.size()));
  for (auto& [addr, b] : snap.buffers) *d.add_buffers() = std::move(b);
  // Anyone with write access to etcd could have put anything there.
  if (absl::Status s = descriptor::ValidateSegmentDescriptor(d); !s.ok()) {
    return absl::DataLossError(absl::StrCat(
        "etcd holds an invalid descriptor for '", name, "': ", s.message()));
  }
  return d;
}

absl::StatusOr<std::vector<std::string>> EtcdStore::List() {
  const std::string prefix = keys_.MetaPrefix();
  TxnRequest txn;
  RequestOp op = RangeOp(prefix, PrefixEnd(prefix));
  op.mutable_request_range()->set_keys_only(true);
  *txn.add_success() = std::move(op);
  FERRY_ASSIGN_OR_RETURN(const TxnResponse resp,
                         Txn(txn, clock_->Now() + options_.rpc_timeout));
  std::vector<std::string> names;
  for (const auto& kv : resp.responses(0).response_range().kvs()) {
    names.push_back(keys_.NameOfMetaKey(kv.key()));
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace ferry::metadata
