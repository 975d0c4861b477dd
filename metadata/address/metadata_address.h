// Metadata addresses, written as in Mooncake TE wherever one is given
// (EngineOptions::metadata_endpoint, transfer_bench --metadata_server,
// tools):
//   "embedded"                    run a Ferry metadata service inside this
//                                 engine (Ferry's default)
//   "host:port", "ferry://host:port"
//                                 a Ferry metadata service (tools/
//                                 metadata_server, or an engine's embedded
//                                 one)
//   "etcd://host:port[,host:port...]"
//                                 an etcd v3 cluster, directly
//   "P2PHANDSHAKE"                no metadata service: each engine serves
//                                 its own descriptor, and a segment's name
//                                 is its engine's host:port
// Mooncake's "http://" and "redis://" metadata are not supported; a bare
// "host:port" means etcd in Mooncake but Ferry's own service here (a
// Ferry client that reaches etcd there says so).
#ifndef FERRY_METADATA_ADDRESS_METADATA_ADDRESS_H_
#define FERRY_METADATA_ADDRESS_METADATA_ADDRESS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "ferry/etcd_limits.h"
#include "metadata/store.h"
#include "metadata/tls.h"

namespace ferry::metadata {

struct MetadataAddress {
  enum class Kind { kEmbedded, kFerry, kEtcd, kP2p };
  Kind kind = Kind::kEmbedded;
  // kFerry: "host:port"; kEtcd: the members' "host:port"s.
  std::vector<std::string> endpoints;
};

// InvalidArgument naming the forms above for anything else.
absl::StatusOr<MetadataAddress> ParseMetadataAddress(absl::string_view text);

// A Store for a kFerry or kEtcd address: a MetadataClient or an EtcdStore,
// each call bounded by `rpc_timeout`. Host names are resolved here, once.
// A Ferry service gets `auth_token` on every call (auth.h), over TLS if
// `tls` is not null (tls.h); etcd has its own authentication and TLS,
// which the etcd store does not use yet. The etcd store's deadlines,
// retry pauses and watch back-off run on `clock` (null: the system
// clock; it must outlive the store); a Ferry service's calls have only
// gRPC deadlines, which stay on real time. In a build without the etcd
// back end (--define=ferry_etcd=0) a kEtcd address gets Unimplemented.
// An etcd store keeps `etcd_limits`.
absl::StatusOr<std::unique_ptr<Store>> ConnectStore(
    const MetadataAddress& address, absl::Duration rpc_timeout,
    const std::string& auth_token = "",
    std::shared_ptr<const Tls> tls = nullptr, Clock* clock = nullptr,
    const EtcdLimits& etcd_limits = {});

// NamespacedStore: `inner` seen through a namespace: segment "x" is stored
// as "<ns>/x", List shows only this namespace's, and descriptors come back
// under their short names. Several clusters share one metadata service or
// etcd this way without seeing each other's segments.
class NamespacedStore final : public Store {
 public:
  // `ns`: a valid segment name itself (printable, no spaces).
  static absl::StatusOr<std::unique_ptr<NamespacedStore>> Create(
      std::unique_ptr<Store> inner, std::string ns);

  absl::StatusOr<uint64_t> Put(const PutSegmentRequest& request) override;
  absl::StatusOr<absl::Duration> KeepAlive(
      const KeepAliveRequest& request) override;
  absl::StatusOr<uint64_t> UpdateBuffers(
      const UpdateBuffersRequest& request) override;
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override;
  absl::Status Remove(const RemoveSegmentRequest& request) override;
  absl::StatusOr<std::vector<std::string>> List() override;
  std::string Describe() const override;
  absl::StatusOr<std::unique_ptr<Watch>> WatchSegment(const std::string& name,
                                                      uint64_t after_version,
                                                      EventFn fn) override;

 private:
  NamespacedStore(std::unique_ptr<Store> inner, std::string ns)
      : inner_(std::move(inner)), prefix_(std::move(ns) + "/") {}
  std::string Full(const std::string& name) const { return prefix_ + name; }

  const std::unique_ptr<Store> inner_;
  const std::string prefix_;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_ADDRESS_METADATA_ADDRESS_H_
