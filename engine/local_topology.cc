// TransferEngine::LocalTopology: the NIC priority matrix from sysfs, for
// users who write rdma.topology_json by hand or check what Ferry sees
// (ferry_local_topology in the C API, ferry.local_topology in Python).
#include <infiniband/verbs.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "ferry/transfer_engine.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/topology.h"

namespace ferry {

absl::StatusOr<std::string> TransferEngine::LocalTopology(
    absl::string_view devices) {
  std::vector<std::string> filter;
  for (absl::string_view item :
       absl::StrSplit(devices, ',', absl::SkipWhitespace())) {
    filter.emplace_back(absl::StripAsciiWhitespace(item));
  }
  auto list = rdma::ListDevices(filter);
  if (!list.ok()) return list.status();
  std::vector<std::string> names;
  for (ibv_device* d : *list) names.push_back(ibv_get_device_name(d));
  if (names.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no RDMA NIC named in '", devices, "'"));
  }
  std::string matrix = rdma::Topology::FromSysfs("/sys", names).ToJson(names);
  if (matrix == "{}") {
    // Sysfs places none of them: every NIC is as good as any other, for
    // any location.
    std::vector<std::string> quoted;
    for (const std::string& n : names) quoted.push_back("\"" + n + "\"");
    matrix = absl::StrCat("{\"*\": [[", absl::StrJoin(quoted, ", "), "]]}");
  }
  return matrix;
}

}  // namespace ferry
