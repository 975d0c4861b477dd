// Run-time control of softrnic devices from tests (fault injection). The
// functions live in softrnic's libibverbs.so.1; programs link against
// rdma-core's libibverbs, which lacks them, so they are looked up with
// dlsym at run time. Each returns 0 on success, -1 with errno set (ENODEV
// for an unknown device; ENOSYS if the loaded libibverbs is not softrnic).
#ifndef FERRY_TRANSPORT_SOFTRNIC_SOFTRNIC_CONTROL_H_
#define FERRY_TRANSPORT_SOFTRNIC_SOFTRNIC_CONTROL_H_

#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>

extern "C" {
// Exported by softrnic under these names (version node SOFTRNIC_1.0).
typedef const char* (*softrnic_version_fn)(void);
typedef int (*softrnic_set_link_fn)(const char* dev, int up);
typedef int (*softrnic_cut_connections_fn)(const char* dev);
typedef int (*softrnic_set_delay_us_fn)(const char* dev, uint32_t us);
}

namespace softrnic {

// The version string of the loaded softrnic, or nullptr if the process
// runs on another libibverbs (e.g. rdma-core's, on real hardware).
inline const char* LoadedVersion() {
  auto fn = reinterpret_cast<softrnic_version_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_version"));
  return fn != nullptr ? fn() : nullptr;
}

// Takes the device's port down (up = 0) or up (1): IBV_EVENT_PORT_ERR /
// IBV_EVENT_PORT_ACTIVE on every context of the device; while down, the
// port is IBV_PORT_DOWN, its connections are closed and no traffic flows,
// so requests on its QPs end in IBV_WC_RETRY_EXC_ERR.
inline int SetLink(const char* dev, bool up) {
  auto fn = reinterpret_cast<softrnic_set_link_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_set_link"));
  if (fn == nullptr) return errno = ENOSYS, -1;
  return fn(dev, up ? 1 : 0);
}

// Closes every TCP connection of the device's QPs once, as a cable pull
// would; QPs reconnect when they retransmit.
inline int CutConnections(const char* dev) {
  auto fn = reinterpret_cast<softrnic_cut_connections_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_cut_connections"));
  if (fn == nullptr) return errno = ENOSYS, -1;
  return fn(dev);
}

// Delays every frame the device sends by `us` microseconds (0 to stop).
inline int SetDelayUs(const char* dev, uint32_t us) {
  auto fn = reinterpret_cast<softrnic_set_delay_us_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_set_delay_us"));
  if (fn == nullptr) return errno = ENOSYS, -1;
  return fn(dev, us);
}

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_SOFTRNIC_CONTROL_H_
