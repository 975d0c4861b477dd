#include "engine/capi/stats_json.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ferry::capi {
namespace {

// Appends "name":value pairs to an object under construction.
class Object {
 public:
  Object& Add(const char* name, uint64_t v) {
    return Raw(name, absl::StrCat(v));
  }
  Object& Add(const char* name, bool v) {
    return Raw(name, v ? "true" : "false");
  }
  Object& Add(const char* name, const std::string& v) {
    return Raw(name, Quote(v));
  }
  Object& Raw(const char* name, const std::string& json) {
    absl::StrAppend(&out_, out_.empty() ? "{" : ",", "\"", name, "\":", json);
    return *this;
  }
  std::string Done() { return out_.empty() ? "{}" : out_ + "}"; }

 private:
  // NIC and transport names are printable ASCII; anything else escaped.
  static std::string Quote(const std::string& s) {
    std::string q = "\"";
    for (unsigned char c : s) {
      if (c == '"' || c == '\\') {
        q += '\\';
        q += static_cast<char>(c);
      } else if (c < 0x20 || c >= 0x7f) {
        absl::StrAppendFormat(&q, "\\u%04x", c);
      } else {
        q += static_cast<char>(c);
      }
    }
    return q + "\"";
  }

  std::string out_;
};

std::string Nic(const NicStats& n) {
  return Object()
      .Add("name", n.name)
      .Add("port_active", n.port_active)
      .Add("slices", n.slices)
      .Add("bytes", n.bytes)
      .Add("errors", n.errors)
      .Add("work_requests", n.work_requests)
      .Add("completions", n.completions)
      .Add("outstanding_wrs", n.outstanding_wrs)
      .Add("fatal", n.fatal)
      .Done();
}

std::string Transport(const TransportStats& t) {
  std::string nics = "[";
  for (size_t i = 0; i < t.nics.size(); ++i) {
    absl::StrAppend(&nics, i == 0 ? "" : ",", Nic(t.nics[i]));
  }
  nics += "]";
  return Object()
      .Add("transport", t.transport)
      .Raw("nics", nics)
      .Add("endpoints", t.endpoints)
      .Add("connects_started", t.connects_started)
      .Add("connects_accepted", t.connects_accepted)
      .Add("qps_created", t.qps_created)
      .Add("evictions", t.evictions)
      .Add("connect_failures", t.connect_failures)
      .Add("connect_races", t.connect_races)
      .Add("retries", t.retries)
      .Add("fast_failures", t.fast_failures)
      .Add("peers", t.peers)
      .Add("threads", t.threads)
      .Add("refused_connections", t.refused_connections)
      .Add("timed_out_connections", t.timed_out_connections)
      .Add("bad_frames", t.bad_frames)
      .Add("denied_frames", t.denied_frames)
      .Add("staged_slices", t.staged_slices)
      .Add("staging_waits", t.staging_waits)
      .Add("staging_copies", t.staging_copies)
      .Add("staging_copy_bytes", t.staging_copy_bytes)
      .Done();
}

}  // namespace

std::string StatsJson(const EngineStats& e,
                      const std::vector<TransportStats>& transports) {
  std::string list = "[";
  for (size_t i = 0; i < transports.size(); ++i) {
    absl::StrAppend(&list, i == 0 ? "" : ",", Transport(transports[i]));
  }
  list += "]";
  return Object()
      .Add("segments_open", e.segments_open)
      .Add("descriptor_refreshes", e.descriptor_refreshes)
      .Add("descriptor_pushes", e.descriptor_pushes)
      .Add("descriptor_refresh_failures", e.descriptor_refresh_failures)
      .Add("requests_waiting_for_descriptor", e.requests_waiting_for_descriptor)
      .Add("requests_waited_for_descriptor", e.requests_waited_for_descriptor)
      .Add("notifications_queued", e.notifications_queued)
      .Add("notification_bytes_queued", e.notification_bytes_queued)
      .Add("notifications_refused", e.notifications_refused)
      .Add("peer_channels", e.peer_channels)
      .Add("mr_cache_registrations", e.mr_cache_registrations)
      .Add("mr_cache_bytes", e.mr_cache_bytes)
      .Add("mr_cache_invalidations", e.mr_cache_invalidations)
      .Add("mr_cache_evictions", e.mr_cache_evictions)
      .Raw("transports", list)
      .Done();
}

}  // namespace ferry::capi
