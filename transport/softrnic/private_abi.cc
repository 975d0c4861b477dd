// rdma-core's private provider ABI (version IBVERBS_PRIVATE_34): what the
// hardware providers' direct-verbs libraries (libmlx5, libefa) import from
// libibverbs. Tools such as perftest link those libraries and are bound
// immediately (BIND_NOW), so without these names they do not even start on
// softrnic. softrnic has no kernel driver and no provider: a provider
// registering itself at load is ignored, and every command entry point
// fails with EOPNOTSUPP, reported once on stderr. None is reached for a
// softrnic device: the direct-verbs libraries act only on their own
// hardware's devices.
#include <errno.h>

#include <atomic>
#include <cstdio>

#include "transport/softrnic/softrnic.h"

namespace {

int Unsupported(const char* name) {
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    std::fprintf(stderr,
                 "softrnic: %s (a hardware provider's private entry point) is "
                 "not supported\n",
                 name);
  }
  return EOPNOTSUPP;
}

}  // namespace

extern "C" {

// Read by providers when a device is disassociated.
__attribute__((visibility("default"))) bool verbs_allow_disassociate_destroy =
    false;

// Providers call this from their load-time constructors: nothing to do.
SOFTRNIC_EXPORT void verbs_register_driver_34(const void*) {}

// Provider logging: softrnic reports its own errors.
SOFTRNIC_EXPORT void __verbs_log(const void*, int, const char*, ...) {}

}  // extern "C"

#define SOFTRNIC_UNSUPPORTED(name) \
  SOFTRNIC_EXPORT int name() { return Unsupported(#name); }

SOFTRNIC_UNSUPPORTED(_verbs_init_and_alloc_context)
SOFTRNIC_UNSUPPORTED(execute_ioctl)
SOFTRNIC_UNSUPPORTED(ibv_cmd_advise_mr)
SOFTRNIC_UNSUPPORTED(ibv_cmd_alloc_dm)
SOFTRNIC_UNSUPPORTED(ibv_cmd_alloc_mw)
SOFTRNIC_UNSUPPORTED(ibv_cmd_alloc_pd)
SOFTRNIC_UNSUPPORTED(ibv_cmd_attach_mcast)
SOFTRNIC_UNSUPPORTED(ibv_cmd_close_xrcd)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_ah)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_counters)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_cq_ex)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_flow)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_flow_action_esp)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_qp_ex)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_qp_ex2)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_rwq_ind_table)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_srq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_srq_ex)
SOFTRNIC_UNSUPPORTED(ibv_cmd_create_wq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_dealloc_mw)
SOFTRNIC_UNSUPPORTED(ibv_cmd_dealloc_pd)
SOFTRNIC_UNSUPPORTED(ibv_cmd_dereg_mr)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_ah)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_counters)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_cq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_flow)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_flow_action)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_qp)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_rwq_ind_table)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_srq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_destroy_wq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_detach_mcast)
SOFTRNIC_UNSUPPORTED(ibv_cmd_free_dm)
SOFTRNIC_UNSUPPORTED(ibv_cmd_get_context)
SOFTRNIC_UNSUPPORTED(ibv_cmd_modify_cq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_modify_flow_action_esp)
SOFTRNIC_UNSUPPORTED(ibv_cmd_modify_qp)
SOFTRNIC_UNSUPPORTED(ibv_cmd_modify_qp_ex)
SOFTRNIC_UNSUPPORTED(ibv_cmd_modify_srq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_modify_wq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_open_qp)
SOFTRNIC_UNSUPPORTED(ibv_cmd_open_xrcd)
SOFTRNIC_UNSUPPORTED(ibv_cmd_query_context)
SOFTRNIC_UNSUPPORTED(ibv_cmd_query_device_any)
SOFTRNIC_UNSUPPORTED(ibv_cmd_query_mr)
SOFTRNIC_UNSUPPORTED(ibv_cmd_query_port)
SOFTRNIC_UNSUPPORTED(ibv_cmd_query_qp)
SOFTRNIC_UNSUPPORTED(ibv_cmd_query_srq)
SOFTRNIC_UNSUPPORTED(ibv_cmd_read_counters)
SOFTRNIC_UNSUPPORTED(ibv_cmd_reg_dm_mr)
SOFTRNIC_UNSUPPORTED(ibv_cmd_reg_dmabuf_mr)
SOFTRNIC_UNSUPPORTED(ibv_cmd_reg_mr)
SOFTRNIC_UNSUPPORTED(ibv_cmd_rereg_mr)
SOFTRNIC_UNSUPPORTED(ibv_cmd_resize_cq)
SOFTRNIC_UNSUPPORTED(verbs_init_cq)
SOFTRNIC_UNSUPPORTED(verbs_open_device)
SOFTRNIC_UNSUPPORTED(verbs_set_ops)
SOFTRNIC_UNSUPPORTED(verbs_uninit_context)
