#include "transport/rdma/verbs_compat.h"

#include <dlfcn.h>

#include <cerrno>

namespace ferry::rdma {
namespace {

// A libibverbs function by its default version node (the one rdma-core
// and softrnic give it), or null. Looked up once: the library is loaded
// with the program and never replaced.
template <typename Fn>
Fn Lookup(const char* name, const char* version) {
  return reinterpret_cast<Fn>(dlvsym(RTLD_DEFAULT, name, version));
}

using QueryGidExFn = int (*)(ibv_context*, uint32_t, uint32_t, ibv_gid_entry*,
                             uint32_t, size_t);
using RegDmabufMrFn = ibv_mr* (*)(ibv_pd*, uint64_t, size_t, uint64_t, int,
                                  int);
using IsForkInitializedFn = ibv_fork_status (*)();

QueryGidExFn QueryGidExImpl() {
  // ibv_query_gid_ex is verbs.h's inline wrapper of this one.
  static const QueryGidExFn fn =
      Lookup<QueryGidExFn>("_ibv_query_gid_ex", "IBVERBS_1.11");
  return fn;
}

}  // namespace

int QueryGidEx(ibv_context* ctx, uint32_t port, uint32_t index,
               ibv_gid_entry* entry) {
  const QueryGidExFn fn = QueryGidExImpl();
  if (fn == nullptr) return EOPNOTSUPP;
  return fn(ctx, port, index, entry, 0, sizeof(*entry));
}

bool HasQueryGidEx() { return QueryGidExImpl() != nullptr; }

ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova,
                    int fd, int access) {
  static const RegDmabufMrFn fn =
      Lookup<RegDmabufMrFn>("ibv_reg_dmabuf_mr", "IBVERBS_1.12");
  if (fn == nullptr) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  return fn(pd, offset, length, iova, fd, access);
}

std::optional<ibv_fork_status> IsForkInitialized() {
  static const IsForkInitializedFn fn =
      Lookup<IsForkInitializedFn>("ibv_is_fork_initialized", "IBVERBS_1.13");
  if (fn == nullptr) return std::nullopt;
  return fn();
}

}  // namespace ferry::rdma
