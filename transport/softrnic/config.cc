// Device configuration from the environment.
#include <arpa/inet.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

bool Valid(const DeviceConfig& d) {
  in_addr a;
  if (d.name.empty() || d.name.size() >= IBV_SYSFS_NAME_MAX) return false;
  return inet_pton(AF_INET, d.ip.c_str(), &a) == 1;
}

void Add(std::vector<DeviceConfig>* out, DeviceConfig d) {
  if (!Valid(d)) {
    std::fprintf(stderr, "softrnic: ignoring bad device entry '%s=%s'\n",
                 d.name.c_str(), d.ip.c_str());
    return;
  }
  for (const auto& e : *out) {
    if (e.name == d.name) {
      std::fprintf(stderr, "softrnic: duplicate device '%s' ignored\n",
                   d.name.c_str());
      return;
    }
  }
  out->push_back(std::move(d));
}

}  // namespace

std::vector<DeviceConfig> LoadDeviceConfig() {
  std::vector<DeviceConfig> out;
  if (const char* env = std::getenv("FERRY_SOFTRNIC_DEVICES");
      env != nullptr && *env != '\0') {
    std::stringstream ss(env);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t eq = item.find('=');
      if (eq == std::string::npos) {
        Add(&out, {item, ""});
        continue;
      }
      Add(&out, {item.substr(0, eq), item.substr(eq + 1)});
    }
  } else if (const char* file = std::getenv("FERRY_SOFTRNIC_CONFIG");
             file != nullptr && *file != '\0') {
    std::ifstream in(file);
    if (!in) std::fprintf(stderr, "softrnic: cannot read %s\n", file);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::stringstream ls(line);
      DeviceConfig d;
      ls >> d.name >> d.ip;
      Add(&out, d);
    }
  }
  if (out.empty()) out.push_back({"softrnic0", "127.0.0.1"});
  return out;
}

}  // namespace softrnic
