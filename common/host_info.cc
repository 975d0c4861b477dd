#include "common/host_info.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/socket_util.h"

namespace ferry {
namespace {

struct IfAddr {
  std::string ifname;
  std::string host;
  int family;
  bool loopback;
  bool global;  // Not IPv4 169.254/16 or IPv6 link-local.
};

std::vector<IfAddr> ListAddresses() {
  std::vector<IfAddr> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(list, freeifaddrs);
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || (a->ifa_flags & IFF_UP) == 0) continue;
    const int family = a->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    SockAddr sa;
    sa.len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memcpy(&sa.storage, a->ifa_addr, sa.len);
    IfAddr e{a->ifa_name, sa.Host(), family,
             (a->ifa_flags & IFF_LOOPBACK) != 0 || sa.IsLoopback(), true};
    if (family == AF_INET) {
      const uint32_t ip = ntohl(
          reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr);
      e.global = (ip >> 16) != 0xa9fe;  // 169.254/16
    } else {
      const in6_addr& ip6 =
          reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr;
      e.global = !IN6_IS_ADDR_LINKLOCAL(&ip6);
    }
    out.push_back(std::move(e));
  }
  return out;
}

// The interface of the IPv4 default route, from /proc/net/route.
std::string DefaultRouteInterface() {
  std::ifstream in("/proc/net/route");
  std::string line;
  std::getline(in, line);  // Header.
  while (std::getline(in, line)) {
    std::vector<std::string> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() >= 2 && f[1] == "00000000") return f[0];
  }
  return "";
}

}  // namespace

absl::StatusOr<std::string> PrimaryHostAddress() {
  const std::vector<IfAddr> addrs = ListAddresses();
  const std::string def = DefaultRouteInterface();
  if (!def.empty()) {
    for (const IfAddr& a : addrs) {
      if (a.ifname == def && a.family == AF_INET && !a.loopback) return a.host;
    }
  }
  for (int family : {AF_INET, AF_INET6}) {
    for (const IfAddr& a : addrs) {
      if (a.family == family && !a.loopback && a.global) return a.host;
    }
  }
  return absl::NotFoundError(
      "this host has no address but loopback: peers on other hosts cannot "
      "reach it");
}

bool IsLocalAddress(absl::string_view host) {
  auto want = ParseNumericEndpoint(JoinHostPort(host, 1));
  if (!want.ok() || want->IsWildcard()) return false;
  for (const IfAddr& a : ListAddresses()) {
    auto have = ParseNumericEndpoint(JoinHostPort(a.host, 1));
    if (have.ok() && have->IpKey() == want->IpKey()) return true;
  }
  return false;
}

const std::string& BootId() {
  static const std::string* id = [] {
    std::string boot;
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::getline(in, boot);
    return new std::string(absl::StripAsciiWhitespace(boot));
  }();
  return *id;
}

uint64_t NamespaceInode(const char* kind) {
  struct stat st {};
  return ::stat(absl::StrCat("/proc/self/ns/", kind).c_str(), &st) == 0
             ? st.st_ino
             : 0;
}

const std::string& NetworkIdentity() {
  static const std::string* id =
      new std::string(absl::StrCat(BootId(), "/net:", NamespaceInode("net")));
  return *id;
}

}  // namespace ferry
