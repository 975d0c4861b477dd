// Whether this process holds a Linux capability in its effective set.
// Header-only and libc-only: shared with softrnic.
#ifndef FERRY_COMMON_CAPABILITIES_H_
#define FERRY_COMMON_CAPABILITIES_H_

#include <linux/capability.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace ferry {

// E.g. HasCapability(CAP_IPC_LOCK): locked memory is not limited by
// RLIMIT_MEMLOCK then. False if it cannot be asked.
inline bool HasCapability(int cap) {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  return (data[cap / 32].effective & (1u << (cap % 32))) != 0;
}

}  // namespace ferry

#endif  // FERRY_COMMON_CAPABILITIES_H_
