#include "metadata/address/metadata_address.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/socket_util.h"
#ifndef FERRY_WITHOUT_ETCD
#include "metadata/etcd/etcd_store.h"
#endif
#include "metadata/metadata_client.h"
#include "metadata/validation.h"

namespace ferry::metadata {
namespace {

constexpr char kForms[] =
    "metadata address forms: \"embedded\", \"host:port\" or "
    "\"ferry://host:port\" (a Ferry metadata service), "
    "\"etcd://host:port[,host:port...]\", \"P2PHANDSHAKE\"";

}  // namespace

absl::StatusOr<MetadataAddress> ParseMetadataAddress(absl::string_view text) {
  MetadataAddress a;
  if (text == "embedded") return a;
  if (text == "P2PHANDSHAKE") {
    a.kind = MetadataAddress::Kind::kP2p;
    return a;
  }
  if (absl::StartsWith(text, "etcd://")) {
    a.kind = MetadataAddress::Kind::kEtcd;
    absl::string_view rest = text.substr(7);
    for (absl::string_view ep : absl::StrSplit(rest, ',')) {
      auto hp = ParseHostPort(ep);
      if (!hp.ok() || hp->port == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata address '", text, "': '", ep,
                         "' is not host:port; ", kForms));
      }
      a.endpoints.emplace_back(ep);
    }
    return a;
  }
  absl::string_view hostport = text;
  if (absl::StartsWith(text, "ferry://")) hostport = text.substr(8);
  if (absl::StrContains(hostport, "://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata address '", text,
        "': this scheme is not supported (Mooncake's http:// and redis:// "
        "metadata are not); ",
        kForms));
  }
  auto hp = ParseHostPort(hostport);
  if (!hp.ok() || hp->port == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata address '", text, "' is not one of the ", kForms));
  }
  a.kind = MetadataAddress::Kind::kFerry;
  a.endpoints.emplace_back(hostport);
  return a;
}

absl::StatusOr<std::unique_ptr<Store>> ConnectStore(
    const MetadataAddress& address, absl::Duration rpc_timeout,
    const std::string& auth_token, std::shared_ptr<const Tls> tls, Clock* clock,
    const EtcdLimits& etcd_limits) {
  if (address.kind == MetadataAddress::Kind::kEtcd) {
#ifdef FERRY_WITHOUT_ETCD
    (void)etcd_limits;
    return absl::UnimplementedError(
        "metadata address 'etcd://...': this build leaves out the etcd back "
        "end (bazel --define=ferry_etcd=0, as tools/dev.sh demo builds); "
        "build without that flag to use etcd");
#else
    EtcdOptions o;
    static_cast<EtcdLimits&>(o) = etcd_limits;
    o.endpoints = address.endpoints;
    o.rpc_timeout = rpc_timeout;
    o.clock = clock;
    auto s = EtcdStore::Create(std::move(o));
    if (!s.ok()) return s.status();
    return std::unique_ptr<Store>(std::move(*s));
#endif
  }
  if (address.kind != MetadataAddress::Kind::kFerry) {
    return absl::InvalidArgumentError(
        "no store to connect to for this address");
  }
  // Resolved once: the client then dials an address, with no DNS later.
  auto hp = ParseHostPort(address.endpoints[0]);
  auto host = hp.ok() ? ResolveHost(hp->host) : hp.status();
  if (!host.ok()) return host.status();
  return std::unique_ptr<Store>(std::make_unique<MetadataClient>(
      JoinHostPort(*host, hp->port), rpc_timeout, auth_token, std::move(tls)));
}

absl::StatusOr<std::unique_ptr<NamespacedStore>> NamespacedStore::Create(
    std::unique_ptr<Store> inner, std::string ns) {
  if (absl::Status s = descriptor::ValidateSegmentName(ns); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata namespace: ", s.message()));
  }
  return std::unique_ptr<NamespacedStore>(
      new NamespacedStore(std::move(inner), std::move(ns)));
}

absl::StatusOr<uint64_t> NamespacedStore::Put(
    const PutSegmentRequest& request) {
  PutSegmentRequest r = request;
  r.mutable_segment()->set_name(Full(request.segment().name()));
  return inner_->Put(r);
}

absl::StatusOr<absl::Duration> NamespacedStore::KeepAlive(
    const KeepAliveRequest& request) {
  KeepAliveRequest r = request;
  r.set_name(Full(request.name()));
  return inner_->KeepAlive(r);
}

absl::StatusOr<uint64_t> NamespacedStore::UpdateBuffers(
    const UpdateBuffersRequest& request) {
  UpdateBuffersRequest r = request;
  r.set_name(Full(request.name()));
  return inner_->UpdateBuffers(r);
}

absl::StatusOr<descriptor::SegmentDescriptor> NamespacedStore::Get(
    const std::string& name) {
  auto d = inner_->Get(Full(name));
  if (d.ok()) d->set_name(name);
  return d;
}

absl::Status NamespacedStore::Remove(const RemoveSegmentRequest& request) {
  RemoveSegmentRequest r = request;
  r.set_name(Full(request.name()));
  return inner_->Remove(r);
}

absl::StatusOr<std::vector<std::string>> NamespacedStore::List() {
  auto all = inner_->List();
  if (!all.ok()) return all.status();
  std::vector<std::string> mine;
  for (const std::string& n : *all) {
    if (absl::StartsWith(n, prefix_)) mine.push_back(n.substr(prefix_.size()));
  }
  return mine;
}

absl::StatusOr<std::unique_ptr<Watch>> NamespacedStore::WatchSegment(
    const std::string& name, uint64_t after_version, EventFn fn) {
  return inner_->WatchSegment(
      Full(name), after_version,
      [name, fn = std::move(fn)](const SegmentEvent& ev) {
        if (!ev.has_full()) return fn(ev);
        SegmentEvent renamed = ev;
        renamed.mutable_full()->set_name(name);
        fn(renamed);
      });
}

std::string NamespacedStore::Describe() const {
  return absl::StrCat(inner_->Describe(), " namespace ",
                      prefix_.substr(0, prefix_.size() - 1));
}

}  // namespace ferry::metadata
