// The verbs calls Ferry makes that rdma-core added after the oldest
// release it runs on (rdma-core 28: IBVERBS_1.8, which ibv_reg_mr binds
// through ibv_reg_mr_iova2), found when first used instead of linked. A binary
// that names one of them directly carries that symbol's version node
// (IBVERBS_1.11, 1.12, 1.13), and the dynamic loader refuses to start it on an
// older libibverbs before main runs -- the doctor included, whose job is to say
// the library is too old. Through these, Ferry's binaries start on any
// release from 28 on and say what is missing where it is needed.
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_RDMA_VERBS_COMPAT_H_
#define FERRY_TRANSPORT_RDMA_VERBS_COMPAT_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace ferry::rdma {

// ibv_query_gid_ex (rdma-core 32): 0, or an errno value; EOPNOTSUPP where
// the loaded library lacks it (a GID's type is then unknown).
int QueryGidEx(ibv_context* ctx, uint32_t port, uint32_t index,
               ibv_gid_entry* entry);
bool HasQueryGidEx();

// ibv_reg_dmabuf_mr (rdma-core 34): the MR, or nullptr with errno set;
// EOPNOTSUPP where the loaded library lacks it.
ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova,
                    int fd, int access);

// ibv_is_fork_initialized (rdma-core 35); nullopt where the loaded library
// lacks it.
std::optional<ibv_fork_status> IsForkInitialized();

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_VERBS_COMPAT_H_
