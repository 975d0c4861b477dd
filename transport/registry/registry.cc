#include "transport/registry/registry.h"

#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace ferry {
namespace {

struct Factory {
  const char* name;
  std::function<std::unique_ptr<Transport>(const TransportOptions&)> make;
  // Optional (TransportAdvertiseHint).
  std::function<std::string(const TransportOptions&)> advertise_hint;
};

// Adding a transport: implement Transport, add one line here.
const std::vector<Factory>& Factories() {
  static const auto* factories = new std::vector<Factory>{
      {"rdma",
       [](const TransportOptions& o) {
         return std::make_unique<rdma::RdmaTransport>(o);
       },
       [](const TransportOptions& o) {
         auto host = rdma::FirstNicAddress(o.rdma);
         return host.ok() ? *host : std::string();
       }},
      {"tcp",
       [](const TransportOptions& o) {
         return std::make_unique<tcp::TcpTransport>(o);
       },
       nullptr},
      {"shm",
       [](const TransportOptions& o) {
         return std::make_unique<shm::ShmTransport>(o);
       },
       nullptr},
  };
  return *factories;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(
    absl::string_view name, const TransportOptions& options) {
  std::vector<std::string> known;
  for (const Factory& f : Factories()) {
    if (name == f.name) return f.make(options);
    known.push_back(f.name);
  }
  return absl::NotFoundError(absl::StrCat(
      "unknown transport '", name, "'; known: ", absl::StrJoin(known, ", ")));
}

std::string TransportAdvertiseHint(absl::string_view name,
                                   const TransportOptions& options) {
  for (const Factory& f : Factories()) {
    if (name == f.name && f.advertise_hint) return f.advertise_hint(options);
  }
  return "";
}

}  // namespace ferry
