// Port state that follows the network: a device's port is up only while
// the interface holding its address is up and has carrier, as a real NIC's
// port follows its physical link. A netlink listener (blocked in the
// kernel when nothing changes, so it costs no CPU) re-reads the interfaces
// on every link or address change; a change of port state raises
// IBV_EVENT_PORT_ERR / IBV_EVENT_PORT_ACTIVE like the fault-injection
// switch does.
#include <errno.h>
#include <ifaddrs.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <mutex>
#include <thread>

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

void Refresh() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return;
  for (Device* d : Devices()) SetCarrier(d, CarrierOf(d->ip, list));
  freeifaddrs(list);
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

void StartCarrierMonitor() {
  static std::once_flag once;
  std::call_once(once, [] {
    const int fd = ::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (fd < 0) return;  // Then ports follow only the fault switch.
    sockaddr_nl sa{};
    sa.nl_family = AF_NETLINK;
    sa.nl_groups = RTMGRP_LINK | RTMGRP_IPV4_IFADDR;
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
