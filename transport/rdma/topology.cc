#include "transport/rdma/topology.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

namespace {

int ReadInt(const std::string& path, int base, int fallback) {
  std::ifstream f(path);
  std::string text;
  if (!(f >> text)) return fallback;
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, base);
  return end == text.c_str() ? fallback : static_cast<int>(v);
}

// The device's place in the PCI tree: its resolved sysfs path split into
// components (".../pci0000:00/0000:00:01.0/0000:01:00.0"), or empty.
std::vector<std::string> PciPath(const std::string& link) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::canonical(link, ec);
  if (ec) return {};
  std::vector<std::string> out;
  for (const auto& c : p) out.push_back(c.string());
  return out;
}

// Hops between two devices through their nearest common bridge; a large
// value when they share nothing but the root.
int PciDistance(const std::vector<std::string>& a,
                const std::vector<std::string>& b) {
  size_t common = 0;
  while (common < a.size() && common < b.size() && a[common] == b[common]) {
    ++common;
  }
  return static_cast<int>((a.size() - common) + (b.size() - common));
}

struct Gpu {
  std::string bus_id;
  std::vector<std::string> path;
  int numa = -1;
};

std::vector<Gpu> ReadNvidiaGpus(const std::string& root) {
  constexpr int kNvidia = 0x10de;
  std::vector<Gpu> gpus;
  std::error_code ec;
  const std::string dir = root + "/bus/pci/devices";
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string dev = e.path().string();
    const int cls = ReadInt(dev + "/class", 16, 0);
    // Display controllers: VGA (0x0300xx) and 3D (0x0302xx).
    if ((cls >> 16) != 0x03 || ReadInt(dev + "/vendor", 16, 0) != kNvidia) {
      continue;
    }
    Gpu g;
    g.bus_id = e.path().filename().string();
    g.path = PciPath(dev);
    g.numa = ReadInt(dev + "/numa_node", 10, -1);
    if (!g.path.empty()) gpus.push_back(std::move(g));
  }
  std::sort(gpus.begin(), gpus.end(),
            [](const Gpu& a, const Gpu& b) { return a.bus_id < b.bus_id; });
  return gpus;
}

}  // namespace

Topology Topology::FromSysfs(const std::string& root,
                             const std::vector<std::string>& nics,
                             const std::vector<std::string>& gpu_bus_ids) {
  std::vector<int> numa;
  std::vector<std::vector<std::string>> paths;
  for (const std::string& nic : nics) {
    const std::string dev = root + "/class/infiniband/" + nic + "/device";
    numa.push_back(ReadInt(dev + "/numa_node", 10, -1));
    paths.push_back(PciPath(dev));
  }
  Topology t = FromNumaNodes(nics, numa);
  std::vector<Gpu> gpus = ReadNvidiaGpus(root);
  if (!gpu_bus_ids.empty()) {
    // The driver's ordinals: GPU g is the one at its address.
    std::vector<Gpu> by_ordinal(gpu_bus_ids.size());
    for (size_t g = 0; g < gpu_bus_ids.size(); ++g) {
      for (const Gpu& gpu : gpus) {
        if (absl::AsciiStrToLower(gpu_bus_ids[g]) == gpu.bus_id) {
          by_ordinal[g] = gpu;
        }
      }
    }
    gpus = std::move(by_ordinal);
  }
  for (size_t g = 0; g < gpus.size(); ++g) {
    if (gpus[g].path.empty()) continue;  // Not in sysfs.
    int nearest = -1;
    for (size_t i = 0; i < nics.size(); ++i) {
      if (paths[i].empty()) continue;
      const int d = PciDistance(gpus[g].path, paths[i]);
      if (nearest < 0 || d < nearest) nearest = d;
    }
    if (nearest < 0) continue;  // No NIC has a PCI position.
    std::vector<int> tiers(nics.size(), 2);
    for (size_t i = 0; i < nics.size(); ++i) {
      // Tier 2 is only a NIC known to be on another NUMA node (the RDMA
      // transport keeps GPU memory off those), however near it is in the
      // PCI tree: its traffic crosses the CPU interconnect. Where a node
      // is unknown (a single-node host, a VM, a soft NIC), the NIC may be
      // as near.
      const bool same_node =
          gpus[g].numa < 0 || numa[i] < 0 || numa[i] == gpus[g].numa;
      if (!same_node) continue;
      tiers[i] =
          !paths[i].empty() && PciDistance(gpus[g].path, paths[i]) == nearest
              ? 0
              : 1;
    }
    t.tiers_[absl::StrCat("cuda:", g)] = std::move(tiers);
  }
  return t;
}

std::string Topology::ToJson(const std::vector<std::string>& nics) const {
  std::string out = "{";
  bool first_location = true;
  for (const auto& [location, tiers] : tiers_) {
    int max_tier = 0;
    for (int tier : tiers) max_tier = std::max(max_tier, tier);
    absl::StrAppend(&out, first_location ? "" : ", ", "\"", location, "\": [");
    first_location = false;
    bool first_tier = true;
    for (int tier = 0; tier <= max_tier; ++tier) {
      std::vector<std::string> names;
      for (size_t i = 0; i < tiers.size() && i < nics.size(); ++i) {
        if (tiers[i] == tier)
          names.push_back(absl::StrCat("\"", nics[i], "\""));
      }
      if (names.empty()) continue;
      absl::StrAppend(&out, first_tier ? "" : ", ", "[",
                      absl::StrJoin(names, ", "), "]");
      first_tier = false;
    }
    absl::StrAppend(&out, "]");
  }
  return out + "}";
}

std::string Topology::Describe(const std::string& location,
                               const std::vector<std::string>& nics) const {
  auto it = tiers_.find(location);
  if (it == tiers_.end()) return "every NIC alike";
  std::vector<std::pair<int, std::string>> ranked;
  for (size_t i = 0; i < nics.size() && i < it->second.size(); ++i) {
    ranked.emplace_back(it->second[i], nics[i]);
  }
  std::stable_sort(
      ranked.begin(), ranked.end(),
      [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> parts;
  for (const auto& [tier, name] : ranked) {
    parts.push_back(absl::StrCat(name, " (tier ", tier, ")"));
  }
  return absl::StrJoin(parts, ", ");
}

int Topology::Tier(const std::string& location, size_t nic) const {
  auto it = tiers_.find(location);
  if (it == tiers_.end() || nic >= it->second.size()) return 0;
  return it->second[nic];
}

}  // namespace ferry::rdma
