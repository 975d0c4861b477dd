// The RDMA transport's registered local memory: every buffer registered
// on every NIC at once, as one LocalMr (local_mr.h) whose handle rides
// with each slice, so the data path looks nothing up. Also where a
// buffer's NIC preference (tiers) is resolved, once, and where GPU memory
// that no NIC can register falls back to staging through host memory.
//
// Thread-safe: registrations come from any application thread, each
// under mu_ only to insert or remove (ibv_reg_mr runs outside it, and for
// a large buffer on all NICs in parallel). Nothing is called under mu_.
#ifndef FERRY_TRANSPORT_RDMA_MR_TABLE_H_
#define FERRY_TRANSPORT_RDMA_MR_TABLE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "descriptor/descriptor.pb.h"
#include "ferry/options.h"
#include "transport/rdma/local_mr.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/topology.h"
#include "transport/transport.h"

namespace ferry::rdma {

class MrTable {
 public:
  // Readies GPU staging for a device (GpuStaging::Prepare).
  using PrepareStaging = std::function<absl::Status(int cuda_device)>;

  // `nics` and `topology` are the transport's: filled before the first
  // Register and unchanged until DeregisterAll; all outlive the table.
  MrTable(const std::vector<std::unique_ptr<Nic>>& nics,
          const Topology& topology, const RdmaOptions& options,
          PrepareStaging prepare_staging);
  MrTable(const MrTable&) = delete;
  MrTable& operator=(const MrTable&) = delete;

  // Registers `region` on every NIC that is not dead; publishes its remote
  // keys in `published` if it is remotely accessible. GPU memory that no
  // NIC can register is staged through host memory when
  // rdma.gpu_staging allows. Errors: InvalidArgument for memory no NIC
  // can pin (not mapped, or read-only), ResourceExhausted when pinning
  // failed (with memlock advice), or why GPU memory could not be used.
  absl::StatusOr<MemoryHandle> Register(const MemoryRegion& region,
                                        descriptor::Buffer* published);
  // NotFound if `addr` is not registered. Peers still accessing it get a
  // remote access error, never stale memory.
  absl::Status Unregister(uintptr_t addr);
  // Whether some registration is staged GPU memory: until there is one,
  // Submit does not look for staged slices.
  bool any_staged() const {
    return staged_.load(std::memory_order_relaxed) > 0;
  }
  // Shutdown: deregisters everything (handles become invalid).
  void DeregisterAll();

 private:
  // Logs, once per GPU, which NICs its memory goes through.
  void LogGpuPreference(const MemoryRegion& region);
  absl::StatusOr<MemoryHandle> RegisterStaged(const MemoryRegion& region,
                                              std::vector<int> tiers,
                                              const absl::Status& why);

  const std::vector<std::unique_ptr<Nic>>& nics_;
  const Topology& topology_;
  const RdmaOptions& options_;
  const PrepareStaging prepare_staging_;

  Mutex mu_;
  std::map<uintptr_t, std::unique_ptr<LocalMr>> mrs_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> staged_{0};
  Mutex gpu_logged_mu_;
  uint64_t gpu_logged_ ABSL_GUARDED_BY(gpu_logged_mu_) = 0;  // By device.
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_MR_TABLE_H_
