#include "transport/rdma/topology.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace ferry::rdma {

absl::StatusOr<Topology> Topology::FromJson(
    const std::string& json, const std::vector<std::string>& nics) {
  google::protobuf::Struct root;
  auto st = google::protobuf::util::JsonStringToMessage(json, &root);
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("topology JSON: ", std::string(st.message())));
  }
  Topology t;
  t.nic_count_ = nics.size();
  for (const auto& [location, value] : root.fields()) {
    if (!value.has_list_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "topology: '", location, "' must map to a list of NIC lists"));
    }
    // Unlisted NICs rank after every listed tier.
    const int unlisted = value.list_value().values_size();
    std::vector<int> tiers(nics.size(), unlisted);
    int tier = 0;
    for (const auto& level : value.list_value().values()) {
      if (!level.has_list_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "topology: each tier of '", location, "' must be a list"));
      }
      for (const auto& name : level.list_value().values()) {
        if (!name.has_string_value()) {
          return absl::InvalidArgumentError("topology: NIC names are strings");
        }
        size_t i = 0;
        while (i < nics.size() && nics[i] != name.string_value()) ++i;
        if (i == nics.size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("topology: unknown NIC '", name.string_value(),
                           "' for '", location, "'"));
        }
        tiers[i] = std::min(tiers[i], tier);
      }
      ++tier;
    }
    t.tiers_[location] = std::move(tiers);
  }
  return t;
}

Topology Topology::FromNumaNodes(const std::vector<std::string>& nics,
                                 const std::vector<int>& numa_nodes) {
  Topology t;
  t.nic_count_ = nics.size();
  std::map<int, bool> nodes;
  for (int n : numa_nodes) {
    if (n >= 0) nodes[n] = true;
  }
  for (const auto& [node, unused] : nodes) {
    std::vector<int> tiers(nics.size(), 1);
    for (size_t i = 0; i < nics.size(); ++i) {
      if (numa_nodes[i] == node) tiers[i] = 0;
    }
    t.tiers_[absl::StrCat("cpu:", node)] = std::move(tiers);
  }
  return t;
}

std::vector<int> Topology::ReadNumaNodes(const std::vector<std::string>& nics) {
  std::vector<int> out;
  for (const std::string& nic : nics) {
    std::ifstream f("/sys/class/infiniband/" + nic + "/device/numa_node");
    int node = -1;
    if (!(f >> node)) node = -1;
    out.push_back(node);
  }
  return out;
}

int Topology::Tier(const std::string& location, size_t nic) const {
  auto it = tiers_.find(location);
  if (it == tiers_.end() || nic >= it->second.size()) return 0;
  return it->second[nic];
}

}  // namespace ferry::rdma
