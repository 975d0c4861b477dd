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
typedef int (*softrnic_inject_async_event_fn)(const char* dev, int event);
typedef int (*softrnic_ack_timeouts_fn)(const char* dev, uint64_t* out);
typedef int (*softrnic_set_strict_pages_fn)(int on);
typedef uint64_t (*softrnic_strict_page_violations_fn)(void);
typedef int (*softrnic_set_cluster_token_fn)(const char* token);
}

namespace softrnic {

// The version string of the loaded softrnic, or nullptr if the process
// runs on another libibverbs (e.g. rdma-core's, on real hardware).
inline const char* LoadedVersion() {
  auto fn = reinterpret_cast<softrnic_version_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_version"));
  return fn != nullptr ? fn() : nullptr;
}

// Gives softrnic the cluster token (docs/softrnic.md) when the environment
// gave it none: softrnic is the process's libibverbs and sees no engine
// options. -1 with EEXIST if another token is in force already, EINVAL
// for an unusable one, ENOSYS where the libibverbs is not softrnic.
inline int SetClusterToken(const char* token) {
  auto fn = reinterpret_cast<softrnic_set_cluster_token_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_set_cluster_token"));
  if (fn == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  return fn(token);
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

// How often an ACK timeout of the device's QPs expired and resent (go back
// N) or ended a request in IBV_WC_RETRY_EXC_ERR, as the
// local_ack_timeout_err counter of a hardware NIC counts them. Expiries
// that found the frame still queued in its TCP connection are not counted:
// softrnic resends nothing then.
inline int AckTimeouts(const char* dev, uint64_t* out) {
  auto fn = reinterpret_cast<softrnic_ack_timeouts_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_ack_timeouts"));
  if (fn == nullptr) return errno = ENOSYS, -1;
  return fn(dev, out);
}

// Raises the async event `event` (an enum ibv_event_type) on every
// context of the device, with what hardware does around it:
// IBV_EVENT_DEVICE_FATAL also kills the device (its ports go down, its
// QPs to ERR with their WRs flushed, and verbs on it fail with EIO until
// every context is closed); IBV_EVENT_GID_CHANGE re-reads the GID table.
// EINVAL for other events.
inline int InjectAsyncEvent(const char* dev, int event) {
  auto fn = reinterpret_cast<softrnic_inject_async_event_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_inject_async_event"));
  if (fn == nullptr) return errno = ENOSYS, -1;
  return fn(dev, event);
}

// Strict page identity (also FERRY_SOFTRNIC_STRICT_PAGES=1): MRs
// registered from now on record which physical page backs each of their
// pages (registration faults the pages in, as ibv_reg_mr pins them, and
// fails with EFAULT on unmapped memory), and an access through an MR whose
// page has since been replaced (the memory was unmapped and mapped again,
// as after free() and reuse) fails with a protection error --
// IBV_WC_LOC_PROT_ERR for a local SGE, IBV_WC_REM_ACCESS_ERR at the
// requester for the remote side -- where a real NIC would silently move
// the old page's bytes. Needs /proc/self/pagemap with physical frame
// numbers (root outside a user namespace); EPERM otherwise. MRs registered
// while it was off are not checked.
inline int SetStrictPages(bool on) {
  auto fn = reinterpret_cast<softrnic_set_strict_pages_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_set_strict_pages"));
  if (fn == nullptr) return errno = ENOSYS, -1;
  return fn(on ? 1 : 0);
}

// Accesses refused by strict page identity so far (0 if the loaded
// libibverbs is not softrnic).
inline uint64_t StrictPageViolations() {
  auto fn = reinterpret_cast<softrnic_strict_page_violations_fn>(
      dlsym(RTLD_DEFAULT, "softrnic_strict_page_violations"));
  return fn != nullptr ? fn() : 0;
}

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_SOFTRNIC_CONTROL_H_
