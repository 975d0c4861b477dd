// Port state and GID table that follow the network: a device's port is up
// only while the interface holding its address is up and has carrier, as a
// real NIC's port follows its physical link, and its GID table follows the
// addresses of that interface, as a RoCE NIC's follows its netdev. A
// netlink listener (blocked in the kernel when nothing changes, so it costs
// no CPU) re-reads the interfaces on every link or address change; a change
// of port state raises IBV_EVENT_PORT_ERR / IBV_EVENT_PORT_ACTIVE like the
// fault-injection switch does, and a change of the interface's addresses
// re-reads the GID table and raises IBV_EVENT_GID_CHANGE.
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

// Carrier as the driver reports it (<linux/if.h>, which clashes with
// <net/if.h>). IFF_RUNNING would follow operstate, which the kernel
// updates up to a second later.
constexpr unsigned kLowerUp = 0x10000;

bool Up(const ifaddrs* p) {
  return (p->ifa_flags & IFF_UP) && (p->ifa_flags & kLowerUp);
}

// Whether the interface holding `ip` (the exact address, else the first
// subnet containing it) is up with carrier; true when no interface
// matches, as there is nothing to judge by.
bool CarrierOf(in_addr ip, const ifaddrs* list) {
  const ifaddrs* subnet = nullptr;
  for (const ifaddrs* p = list; p != nullptr; p = p->ifa_next) {
    if (p->ifa_addr == nullptr || p->ifa_addr->sa_family != AF_INET) continue;
    const auto* a = reinterpret_cast<const sockaddr_in*>(p->ifa_addr);
    if (a->sin_addr.s_addr == ip.s_addr) return Up(p);
    const auto* m = reinterpret_cast<const sockaddr_in*>(p->ifa_netmask);
    if (subnet == nullptr && m != nullptr &&
        (a->sin_addr.s_addr & m->sin_addr.s_addr) ==
            (ip.s_addr & m->sin_addr.s_addr)) {
      subnet = p;
    }
  }
  return subnet == nullptr || Up(subnet);
}

// The interface a device's address is on: the one holding it exactly,
// else the first whose subnet contains it; nullptr if none.
const ifaddrs* InterfaceOf(in_addr ip, const ifaddrs* list) {
  const ifaddrs* subnet = nullptr;
  for (const ifaddrs* p = list; p != nullptr; p = p->ifa_next) {
    if (p->ifa_addr == nullptr || p->ifa_addr->sa_family != AF_INET) continue;
    const auto* a = reinterpret_cast<const sockaddr_in*>(p->ifa_addr);
    if (a->sin_addr.s_addr == ip.s_addr) return p;
    const auto* m = reinterpret_cast<const sockaddr_in*>(p->ifa_netmask);
    if (subnet == nullptr && m != nullptr &&
        (a->sin_addr.s_addr & m->sin_addr.s_addr) ==
            (ip.s_addr & m->sin_addr.s_addr)) {
      subnet = p;
    }
  }
  return subnet;
}

// Whether `ip` is a local address: assigned to an interface, or inside a
// loopback interface's subnet (127.0.0.2 on lo's 127.0.0.0/8). True when
// no interface has an IPv4 address (nothing to judge by).
bool IsLocal(in_addr ip, const ifaddrs* list) {
  bool any = false;
  for (const ifaddrs* p = list; p != nullptr; p = p->ifa_next) {
    if (p->ifa_addr == nullptr || p->ifa_addr->sa_family != AF_INET) continue;
    any = true;
    const auto* a = reinterpret_cast<const sockaddr_in*>(p->ifa_addr);
    if (a->sin_addr.s_addr == ip.s_addr) return true;
    const auto* m = reinterpret_cast<const sockaddr_in*>(p->ifa_netmask);
    if ((p->ifa_flags & IFF_LOOPBACK) && m != nullptr &&
        (a->sin_addr.s_addr & m->sin_addr.s_addr) ==
            (ip.s_addr & m->sin_addr.s_addr)) {
      return true;
    }
  }
  return !any;
}

// Every address of interface `name`, as text, sorted: a change of it is an
// address change of that interface.
std::string AddressesOf(const std::string& name, const ifaddrs* list) {
  std::vector<std::string> addrs;
  for (const ifaddrs* p = list; p != nullptr; p = p->ifa_next) {
    if (p->ifa_addr == nullptr || name != p->ifa_name) continue;
    const int family = p->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    const void* a =
        family == AF_INET
            ? static_cast<const void*>(
                  &reinterpret_cast<const sockaddr_in*>(p->ifa_addr)->sin_addr)
            : static_cast<const void*>(
                  &reinterpret_cast<const sockaddr_in6*>(p->ifa_addr)
                       ->sin6_addr);
    inet_ntop(family, a, buf, sizeof(buf));
    addrs.push_back(buf);
  }
  std::sort(addrs.begin(), addrs.end());
  std::string out;
  for (const std::string& a : addrs) out += a + " ";
  return out;
}

bool RereadGid(Device* dev, const ifaddrs* list) {
  const bool valid = IsLocal(dev->ip, list);
  return dev->gid_valid.exchange(valid) != valid;
}

// What the monitor last saw of each device's interface.
struct Seen {
  std::string interface;
  std::string addresses;
};

struct Monitor {
  ferry::Mutex mu;  // Refreshes come from the monitor thread and start-up.
  std::unordered_map<Device*, Seen> seen ABSL_GUARDED_BY(mu);
};

Monitor& TheMonitor() {
  static auto* m = new Monitor();
  return *m;
}

void Refresh() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return;
  std::vector<Device*> gid_changed;
  {
    Monitor& m = TheMonitor();
    ferry::MutexLock lock(&m.mu);
    for (Device* d : Devices()) {
      SetCarrier(d, CarrierOf(d->ip, list));
      // The device stays bound to the interface it was found on, also
      // after its own address left it.
      const ifaddrs* i = InterfaceOf(d->ip, list);
      auto it = m.seen.find(d);
      if (it == m.seen.end()) {
        Seen first;
        if (i != nullptr) first.interface = i->ifa_name;
        first.addresses = AddressesOf(first.interface, list);
        RereadGid(d, list);
        m.seen.emplace(d, std::move(first));
        continue;
      }
      Seen& s = it->second;
      if (i != nullptr && s.interface != i->ifa_name) {
        s.interface = i->ifa_name;
        s.addresses.clear();  // Another interface: a change.
      }
      std::string now = AddressesOf(s.interface, list);
      const bool gid = RereadGid(d, list);
      if (now != s.addresses || gid) {
        s.addresses = std::move(now);
        gid_changed.push_back(d);
      }
    }
  }
  freeifaddrs(list);
  for (Device* d : gid_changed) {
    ibv_async_event e{};
    e.event_type = IBV_EVENT_GID_CHANGE;
    PostAsyncEvent(d, e);
  }
}

void MonitorLoop(int fd) {
  Refresh();
  char buf[16384];
  while (true) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != ENOBUFS) return;  // No more notifications.
    // Any link or address change (or lost notifications): look again.
    Refresh();
  }
}

}  // namespace

bool RereadGidTable(Device* dev) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  const bool changed = RereadGid(dev, list);
  freeifaddrs(list);
  return changed;
}

void StartCarrierMonitor() {
  static std::once_flag once;
  std::call_once(once, [] {
    const int fd = ::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (fd < 0) return;  // Then ports follow only the fault switch.
    sockaddr_nl sa{};
    sa.nl_family = AF_NETLINK;
    sa.nl_groups = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      ::close(fd);
      return;
    }
    Refresh();  // Before any device answers a port query.
    // Process-lifetime thread: detached, blocked in recv when idle.
    if (!StartThread("srnic-carrier", [fd] { MonitorLoop(fd); })) {
      ::close(fd);  // Then ports follow only the fault switch.
    }
  });
}

}  // namespace softrnic
