// ShmTransport's record of one attached target (shm_transport.cc attaches,
// shm_cuda_ipc.cc opens its GPU memory). Internal to the shm package.
#ifndef FERRY_TRANSPORT_SHM_SHM_PEER_H_
#define FERRY_TRANSPORT_SHM_SHM_PEER_H_

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"
#include "gpu/cuda_abi.h"
#include "transport/shm/shm_table.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {

struct ShmTransport::Peer {
  ShmTransport* transport = nullptr;
  std::string name;
  uint64_t incarnation = 0;
  pid_t pid = 0;
  bool same_process = false;  // The target is an engine of this process.
  int pidfd = -1;
  std::unique_ptr<ShmTable> table;
  uint64_t owner = 0;
  // lanes[0]: copies on submitting threads (under inline_mu); lanes[1 + i]:
  // copy thread i's.
  std::vector<uint32_t> lanes;
  Mutex inline_mu;
  std::atomic<bool> gone{false};
  // The target's GPU allocations opened here (cuIpcOpenMemHandle), by the
  // shm key of the buffer that published the handle. Used and changed by
  // copy threads only, which close them (CUDA calls stay on them): when
  // found withdrawn and no copy thread uses them any more, when the
  // target exits, or after this record goes (handed to the transport).
  Mutex ipc_mu;
  absl::flat_hash_map<uint64_t, OpenedGpuMemory> opened ABSL_GUARDED_BY(ipc_mu);

  ~Peer();
  // Whether the target process has exited (its pidfd turns readable).
  bool Exited() const {
    if (pidfd < 0) return false;
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
};

}  // namespace ferry::shm

#endif  // FERRY_TRANSPORT_SHM_SHM_PEER_H_
