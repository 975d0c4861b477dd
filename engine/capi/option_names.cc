#include "engine/capi/option_names.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <type_traits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"

namespace ferry::capi {
namespace {

using O = EngineOptions;

struct Option {
  std::function<absl::Status(O&, absl::string_view)> set;
  std::function<std::string(const O&)> get;
};

absl::Status Parse(absl::string_view v, std::string* out) {
  *out = std::string(v);
  return absl::OkStatus();
}

absl::Status Parse(absl::string_view v, bool* out) {
  const std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(v));
  if (s == "1" || s == "true") {
    *out = true;
  } else if (s == "0" || s == "false") {
    *out = false;
  } else {
    return absl::InvalidArgumentError("not 0, 1, false or true");
  }
  return absl::OkStatus();
}

template <typename T>
std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>,
                 absl::Status>
Parse(absl::string_view v, T* out) {
  v = absl::StripAsciiWhitespace(v);
  if constexpr (std::is_signed_v<T>) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(v, &n) || n < std::numeric_limits<T>::min() ||
        n > std::numeric_limits<T>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("not an integer in ", std::numeric_limits<T>::min(),
                       "..", std::numeric_limits<T>::max()));
    }
    *out = static_cast<T>(n);
  } else {
    uint64_t n = 0;
    if (v.empty() || v[0] == '-' || !absl::SimpleAtoi(v, &n) ||
        n > std::numeric_limits<T>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("not an integer in 0..", std::numeric_limits<T>::max()));
    }
    *out = static_cast<T>(n);
  }
  return absl::OkStatus();
}

absl::Status Parse(absl::string_view v, std::vector<std::string>* out) {
  out->clear();
  for (absl::string_view item :
       absl::StrSplit(v, ',', absl::SkipWhitespace())) {
    out->emplace_back(absl::StripAsciiWhitespace(item));
  }
  return absl::OkStatus();
}

absl::Status Parse(absl::string_view v, std::vector<int>* out) {
  std::vector<int> parsed;
  for (absl::string_view item :
       absl::StrSplit(v, ',', absl::SkipWhitespace())) {
    int n = 0;
    if (absl::Status s = Parse(item, &n); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", item, "' in the list: ", s.message()));
    }
    parsed.push_back(n);
  }
  *out = std::move(parsed);
  return absl::OkStatus();
}

std::string Format(const std::string& v) { return v; }
std::string Format(bool v) { return v ? "1" : "0"; }
template <typename T>
std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, std::string>
Format(T v) {
  return absl::StrCat(v);
}
std::string Format(const std::vector<std::string>& v) {
  return absl::StrJoin(v, ",");
}
std::string Format(const std::vector<int>& v) { return absl::StrJoin(v, ","); }

// The field `get` names, parsed as its type says.
template <typename Get>
Option Field(Get get) {
  return Option{[get](O& o, absl::string_view v) { return Parse(v, &get(o)); },
                [get](const O& o) { return Format(get(const_cast<O&>(o))); }};
}

// A duration field, as a count of `unit`.
template <typename Get>
Option Duration(Get get, absl::Duration unit) {
  return Option{[get, unit](O& o, absl::string_view v) {
                  int64_t n = 0;
                  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &n)) {
                    return absl::InvalidArgumentError(absl::StrCat(
                        "not a whole number of ", absl::FormatDuration(unit)));
                  }
                  get(o) = n * unit;
                  return absl::OkStatus();
                },
                [get, unit](const O& o) {
                  absl::Duration rest;
                  return absl::StrCat(
                      absl::IDivDuration(get(const_cast<O&>(o)), unit, &rest));
                }};
}

#define FERRY_FIELD(path) Field([](O & o) -> auto& { return o.path; })
#define FERRY_MS(path) \
  Duration(            \
      [](O & o) -> auto& { return o.path; }, absl::Milliseconds(1))
#define FERRY_US(path) \
  Duration(            \
      [](O & o) -> auto& { return o.path; }, absl::Microseconds(1))

const absl::flat_hash_map<std::string, Option>& Table() {
  static const auto* table = new absl::flat_hash_map<std::string, Option>{
      {"local_segment_name", FERRY_FIELD(local_segment_name)},
      {"metadata_endpoint", FERRY_FIELD(metadata_endpoint)},
      {"metadata_namespace", FERRY_FIELD(metadata_namespace)},
      {"auth_token", FERRY_FIELD(auth_token)},
      {"tls_ca_file", FERRY_FIELD(tls_ca_file)},
      {"tls_cert_file", FERRY_FIELD(tls_cert_file)},
      {"tls_key_file", FERRY_FIELD(tls_key_file)},
      {"tls_server_name", FERRY_FIELD(tls_server_name)},
      {"listen_host", FERRY_FIELD(listen_host)},
      {"advertise_host", FERRY_FIELD(advertise_host)},
      {"log_level", FERRY_FIELD(log_level)},
      {"rpc_port", FERRY_FIELD(rpc_port)},
      {"transports", FERRY_FIELD(transports)},
      {"rpc_timeout_ms", FERRY_MS(rpc_timeout)},
      {"metadata_lease_ttl_ms", FERRY_MS(metadata_lease_ttl)},
      {"segment_name_wait_ms", FERRY_MS(segment_name_wait)},
      {"transfer_timeout_ms", FERRY_MS(transfer_timeout)},
      {"wait_spin_us", FERRY_US(wait_spin)},
      {"mr_cache_bytes", FERRY_FIELD(mr_cache_bytes)},
      {"max_batch_capacity", FERRY_FIELD(max_batch_capacity)},
      {"max_queued_notifications", FERRY_FIELD(max_queued_notifications)},
      {"max_queued_notification_bytes",
       FERRY_FIELD(max_queued_notification_bytes)},
      {"max_queued_notifications_per_sender",
       FERRY_FIELD(max_queued_notifications_per_sender)},
      {"max_queued_notification_bytes_per_sender",
       FERRY_FIELD(max_queued_notification_bytes_per_sender)},
      {"refuse_unverified_notifications",
       FERRY_FIELD(refuse_unverified_notifications)},

      {"tcp.connections_per_peer", FERRY_FIELD(tcp.connections_per_peer)},
      {"tcp.max_slice_bytes", FERRY_FIELD(tcp.max_slice_bytes)},
      {"tcp.io_threads", FERRY_FIELD(tcp.io_threads)},
      {"tcp.staging_buffers", FERRY_FIELD(tcp.staging_buffers)},
      {"tcp.port", FERRY_FIELD(tcp.port)},
      {"tcp.max_connections", FERRY_FIELD(tcp.max_connections)},
      {"tcp.max_connections_per_address",
       FERRY_FIELD(tcp.max_connections_per_address)},
      {"tcp.handshake_timeout_ms", FERRY_MS(tcp.handshake_timeout)},
      {"tcp.idle_timeout_ms", FERRY_MS(tcp.idle_timeout)},
      {"tcp.frame_timeout_ms", FERRY_MS(tcp.frame_timeout)},
      {"tcp.max_peers", FERRY_FIELD(tcp.max_peers)},
      {"tcp.backoff_min_ms", FERRY_MS(tcp.backoff_min)},
      {"tcp.backoff_max_ms", FERRY_MS(tcp.backoff_max)},

      {"rdma.devices", FERRY_FIELD(rdma.devices)},
      {"rdma.slice_bytes", FERRY_FIELD(rdma.slice_bytes)},
      {"rdma.stripe_bytes", FERRY_FIELD(rdma.stripe_bytes)},
      {"rdma.gid_index", FERRY_FIELD(rdma.gid_index)},
      {"rdma.qps_per_endpoint", FERRY_FIELD(rdma.qps_per_endpoint)},
      {"rdma.signal_every", FERRY_FIELD(rdma.signal_every)},
      {"rdma.inline_bytes", FERRY_FIELD(rdma.inline_bytes)},
      {"rdma.max_endpoints", FERRY_FIELD(rdma.max_endpoints)},
      {"rdma.max_peers", FERRY_FIELD(rdma.max_peers)},
      {"rdma.keepalive_interval_ms", FERRY_MS(rdma.keepalive_interval)},
      {"rdma.max_attempts", FERRY_FIELD(rdma.max_attempts)},
      {"rdma.pause_after_errors", FERRY_FIELD(rdma.pause_after_errors)},
      {"rdma.pause_duration_ms", FERRY_MS(rdma.pause_duration)},
      {"rdma.qp_timeout", FERRY_FIELD(rdma.qp_timeout)},
      {"rdma.qp_retry_count", FERRY_FIELD(rdma.qp_retry_count)},
      {"rdma.fork_safe", FERRY_FIELD(rdma.fork_safe)},
      {"rdma.traffic_class", FERRY_FIELD(rdma.traffic_class)},
      {"rdma.service_level", FERRY_FIELD(rdma.service_level)},
      {"rdma.hop_limit", FERRY_FIELD(rdma.hop_limit)},
      {"rdma.flow_label", FERRY_FIELD(rdma.flow_label)},
      {"rdma.worker_threads", FERRY_FIELD(rdma.worker_threads)},
      {"rdma.spin_polls", FERRY_FIELD(rdma.spin_polls)},
      {"rdma.worker_cpus", FERRY_FIELD(rdma.worker_cpus)},
      {"rdma.topology_json", FERRY_FIELD(rdma.topology_json)},
      {"rdma.sysfs_root", FERRY_FIELD(rdma.sysfs_root)},
      {"rdma.gpu_staging", FERRY_FIELD(rdma.gpu_staging)},
      {"rdma.staging_buffers", FERRY_FIELD(rdma.staging_buffers)},

      {"shm.slice_bytes", FERRY_FIELD(shm.slice_bytes)},
      {"shm.copy_threads", FERRY_FIELD(shm.copy_threads)},
      {"shm.inline_bytes", FERRY_FIELD(shm.inline_bytes)},
      {"shm.max_buffers", FERRY_FIELD(shm.max_buffers)},
      {"shm.max_lanes", FERRY_FIELD(shm.max_lanes)},
      {"shm.unregister_wait_ms", FERRY_MS(shm.unregister_wait)},
      {"shm.max_peers", FERRY_FIELD(shm.max_peers)},
      {"shm.staging_buffers", FERRY_FIELD(shm.staging_buffers)},
      {"etcd.max_bytes", FERRY_FIELD(etcd_limits.max_bytes)},
      {"etcd.max_client_bytes", FERRY_FIELD(etcd_limits.max_client_bytes)},
      {"etcd.max_client_segments",
       FERRY_FIELD(etcd_limits.max_client_segments)},
      {"etcd.usage_refresh_ms", FERRY_MS(etcd_limits.usage_refresh)},
      {"etcd.compact_after_ms", FERRY_MS(etcd_limits.compact_after)},
  };
  return *table;
}

#undef FERRY_FIELD
#undef FERRY_MS
#undef FERRY_US

// Earlier names, kept for programs that use them.
absl::string_view Canonical(absl::string_view name) {
  if (name == "rdma_devices") return "rdma.devices";
  return name;
}

}  // namespace

absl::Status SetOption(EngineOptions& options, absl::string_view name,
                       absl::string_view value) {
  auto it = Table().find(Canonical(name));
  if (it == Table().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown engine option '", name, "'"));
  }
  if (absl::Status s = it->second.set(options, value); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine option ", name, "='", value, "': ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> GetOption(const EngineOptions& options,
                                      absl::string_view name) {
  auto it = Table().find(Canonical(name));
  if (it == Table().end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown engine option '", name, "'"));
  }
  return it->second.get(options);
}

std::vector<std::string> OptionNames() {
  std::vector<std::string> names;
  for (const auto& [name, option] : Table()) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace ferry::capi
