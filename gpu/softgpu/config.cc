// The emulated machine's configuration, from FERRY_SOFTGPU_* (softgpu.h).
// A malformed value fails cuInit rather than being ignored: a CI job that
// asked for a machine it did not get should fail where the cause is named.
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "gpu/softgpu/softgpu.h"

namespace softgpu {
namespace {

constexpr uint64_t kMaxMemoryMib = uint64_t{1} << 20;  // 1 TiB per device
constexpr uint64_t kMaxCopyDelayUs = 60'000'000;       // a minute

// `s` as a decimal number no greater than `max`: digits only, no sign.
bool ParseDecimal(const std::string& s, uint64_t max, uint64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  uint64_t n = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    n = n * 10 + static_cast<uint64_t>(c - '0');
  }
  if (n > max) return false;
  *out = n;
  return true;
}

// `s` as exactly `digits` hex digits.
bool ParseHex(const std::string& s, size_t digits, int* out) {
  if (s.size() != digits) return false;
  int n = 0;
  for (char c : s) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
    n = n * 16 + (std::isdigit(static_cast<unsigned char>(c))
                      ? c - '0'
                      : std::tolower(static_cast<unsigned char>(c)) - 'a' + 10);
  }
  *out = n;
  return true;
}

// A PCI address as Linux and NVIDIA write it, "dddd:bb:dd.f" (domain, bus,
// device, function; hex, either case).
bool ParseBusId(const std::string& s, DeviceConfig* out) {
  int function = 0;
  if (s.size() != 12 || s[4] != ':' || s[7] != ':' || s[10] != '.' ||
      !ParseHex(s.substr(0, 4), 4, &out->domain) ||
      !ParseHex(s.substr(5, 2), 2, &out->bus) ||
      !ParseHex(s.substr(8, 2), 2, &out->device) ||
      !ParseHex(s.substr(11, 1), 1, &function) || out->device > 0x1f ||
      function > 7) {
    return false;
  }
  char id[16];
  std::snprintf(id, sizeof(id), "%04X:%02X:%02X.%X", out->domain, out->bus,
                out->device, function);
  out->bus_id = id;
  return true;
}

bool ParseDevices(const std::string& value, std::vector<DeviceConfig>* out,
                  std::string* why) {
  uint64_t count = 0;
  if (!value.empty() && std::isdigit(static_cast<unsigned char>(value[0])) &&
      value.find_first_not_of("0123456789") == std::string::npos) {
    if (!ParseDecimal(value, kMaxDevices, &count)) {
      *why = "more than " + std::to_string(kMaxDevices) + " devices";
      return false;
    }
    for (uint64_t i = 0; i < count; ++i) {
      DeviceConfig d;
      char id[16];
      std::snprintf(id, sizeof(id), "0000:%02X:00.0", static_cast<int>(i + 1));
      ParseBusId(id, &d);
      out->push_back(d);
    }
    return true;
  }
  std::set<std::string> seen;
  size_t start = 0;
  while (true) {
    const size_t comma = value.find(',', start);
    const std::string item = value.substr(
        start, comma == std::string::npos ? std::string::npos : comma - start);
    DeviceConfig d;
    if (!ParseBusId(item, &d)) {
      *why = "'" + item +
             "' is neither a device count nor a PCI address dddd:bb:dd.f";
      return false;
    }
    if (!seen.insert(d.bus_id).second) {
      *why = "PCI address " + item + " is listed twice";
      return false;
    }
    out->push_back(d);
    if (out->size() > static_cast<size_t>(kMaxDevices)) {
      *why = "more than " + std::to_string(kMaxDevices) + " devices";
      return false;
    }
    if (comma == std::string::npos) return true;
    start = comma + 1;
  }
}

}  // namespace

bool LoadConfig(Config* config, std::string* error) {
  auto get = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v == nullptr ? "" : v);
  };
  auto fail = [error](const char* name, const std::string& value,
                      const std::string& why) {
    *error = std::string(name) + "='" + value + "': " + why;
    return false;
  };

  const std::string devices = get("FERRY_SOFTGPU_DEVICES");
  std::string why;
  if (!ParseDevices(devices.empty() ? "1" : devices, &config->devices, &why)) {
    return fail("FERRY_SOFTGPU_DEVICES", devices, why);
  }

  const std::string memory = get("FERRY_SOFTGPU_MEMORY_MIB");
  uint64_t mib = 0;
  if (!memory.empty()) {
    if (!ParseDecimal(memory, kMaxMemoryMib, &mib) || mib == 0) {
      return fail(
          "FERRY_SOFTGPU_MEMORY_MIB", memory,
          "not a number of MiB from 1 to " + std::to_string(kMaxMemoryMib));
    }
    config->memory_bytes = mib << 20;
  }

  const std::string dmabuf = get("FERRY_SOFTGPU_DMABUF");
  if (!dmabuf.empty()) {
    if (dmabuf != "0" && dmabuf != "1") {
      return fail("FERRY_SOFTGPU_DMABUF", dmabuf, "must be 0 or 1");
    }
    config->dmabuf = dmabuf == "1";
  }

  const std::string delay = get("FERRY_SOFTGPU_COPY_DELAY_US");
  if (!delay.empty() &&
      !ParseDecimal(delay, kMaxCopyDelayUs, &config->copy_delay_us)) {
    return fail("FERRY_SOFTGPU_COPY_DELAY_US", delay,
                "not a number of microseconds from 0 to " +
                    std::to_string(kMaxCopyDelayUs));
  }
  return true;
}

}  // namespace softgpu
