// The rest of the public libibverbs API: string helpers, rate conversions,
// and verbs softrnic does not emulate (UD address handles, SRQs, multicast,
// object import), which fail with EOPNOTSUPP as on hardware without them.
#include <errno.h>

#include "transport/softrnic/softrnic.h"

SOFTRNIC_EXPORT const char* ibv_wc_status_str(enum ibv_wc_status status) {
  static const char* const kNames[] = {
      "success",
      "local length error",
      "local QP operation error",
      "local EE context operation error",
      "local protection error",
      "Work Request Flushed Error",
      "memory management operation error",
      "bad response error",
      "local access error",
      "remote invalid request error",
      "remote access error",
      "remote operation error",
      "transport retry counter exceeded",
      "RNR retry counter exceeded",
      "local RDD violation error",
      "remote invalid RD request",
      "aborted error",
      "invalid EE context number",
      "invalid EE context state",
      "fatal error",
      "response timeout error",
      "general error",
      "TM error",
      "TM software rendezvous",
  };
  if (status < 0 ||
      static_cast<size_t>(status) >= sizeof(kNames) / sizeof(kNames[0])) {
    return "unknown";
  }
  return kNames[status];
}

SOFTRNIC_EXPORT const char* ibv_event_type_str(enum ibv_event_type event) {
  static const char* const kNames[] = {
      "CQ error",
      "local work queue catastrophic error",
      "invalid request local work queue error",
      "local access violation work queue error",
      "communication established",
      "send queue drained",
      "path migrated",
      "path migration request error",
      "local catastrophic error",
      "port active",
      "port error",
      "LID change",
      "P_Key change",
      "SM change",
      "SRQ catastrophic error",
      "SRQ limit reached",
      "last WQE reached",
      "client reregistration",
      "GID table change",
      "WQ fatal",
  };
  if (event < 0 ||
      static_cast<size_t>(event) >= sizeof(kNames) / sizeof(kNames[0])) {
    return "unknown";
  }
  return kNames[event];
}

SOFTRNIC_EXPORT const char* ibv_node_type_str(enum ibv_node_type node_type) {
  switch (node_type) {
    case IBV_NODE_CA:
      return "InfiniBand channel adapter";
    case IBV_NODE_SWITCH:
      return "InfiniBand switch";
    case IBV_NODE_ROUTER:
      return "InfiniBand router";
    case IBV_NODE_RNIC:
      return "iWARP NIC";
    case IBV_NODE_USNIC:
      return "usNIC";
    case IBV_NODE_USNIC_UDP:
      return "usNIC UDP";
    case IBV_NODE_UNSPECIFIED:
      return "unspecified";
    default:
      return "unknown";
  }
}

SOFTRNIC_EXPORT const char* ibv_port_state_str(enum ibv_port_state state) {
  switch (state) {
    case IBV_PORT_NOP:
      return "PORT_NOP";
    case IBV_PORT_DOWN:
      return "PORT_DOWN";
    case IBV_PORT_INIT:
      return "PORT_INIT";
    case IBV_PORT_ARMED:
      return "PORT_ARMED";
    case IBV_PORT_ACTIVE:
      return "PORT_ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
      return "PORT_ACTIVE_DEFER";
    default:
      return "invalid state";
  }
}

namespace {
struct RateRow {
  ibv_rate rate;
  int mult;
  int mbps;
};
const RateRow kRates[] = {
    {IBV_RATE_2_5_GBPS, 1, 2500},    {IBV_RATE_5_GBPS, 2, 5000},
    {IBV_RATE_10_GBPS, 4, 10000},    {IBV_RATE_20_GBPS, 8, 20000},
    {IBV_RATE_30_GBPS, 12, 30000},   {IBV_RATE_40_GBPS, 16, 40000},
    {IBV_RATE_60_GBPS, 24, 60000},   {IBV_RATE_80_GBPS, 32, 80000},
    {IBV_RATE_120_GBPS, 48, 120000}, {IBV_RATE_25_GBPS, 10, 25000},
    {IBV_RATE_50_GBPS, 20, 50000},   {IBV_RATE_100_GBPS, 40, 100000},
    {IBV_RATE_200_GBPS, 80, 200000}, {IBV_RATE_400_GBPS, 160, 400000},
};
}  // namespace

SOFTRNIC_EXPORT int ibv_rate_to_mult(enum ibv_rate rate) {
  for (const RateRow& r : kRates) {
    if (r.rate == rate) return r.mult;
  }
  return -1;
}

SOFTRNIC_EXPORT enum ibv_rate mult_to_ibv_rate(int mult) {
  for (const RateRow& r : kRates) {
    if (r.mult == mult) return r.rate;
  }
  return IBV_RATE_MAX;
}

SOFTRNIC_EXPORT int ibv_rate_to_mbps(enum ibv_rate rate) {
  for (const RateRow& r : kRates) {
    if (r.rate == rate) return r.mbps;
  }
  return -1;
}

SOFTRNIC_EXPORT enum ibv_rate mbps_to_ibv_rate(int mbps) {
  for (const RateRow& r : kRates) {
    if (r.mbps == mbps) return r.rate;
  }
  return IBV_RATE_MAX;
}

SOFTRNIC_EXPORT struct ibv_qp_ex* ibv_qp_to_qp_ex(struct ibv_qp*) {
  errno = EOPNOTSUPP;  // No extended (ibv_wr_*) send API.
  return nullptr;
}

SOFTRNIC_EXPORT struct ibv_ah* ibv_create_ah(struct ibv_pd*,
                                             struct ibv_ah_attr*) {
  errno = EOPNOTSUPP;  // Address handles are for UD, which is not emulated.
  return nullptr;
}
SOFTRNIC_EXPORT int ibv_destroy_ah(struct ibv_ah*) { return EOPNOTSUPP; }
SOFTRNIC_EXPORT int ibv_init_ah_from_wc(struct ibv_context*, uint8_t,
                                        struct ibv_wc*, struct ibv_grh*,
                                        struct ibv_ah_attr*) {
  errno = EOPNOTSUPP;
  return -1;
}
SOFTRNIC_EXPORT struct ibv_ah* ibv_create_ah_from_wc(struct ibv_pd*,
                                                     struct ibv_wc*,
                                                     struct ibv_grh*, uint8_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
SOFTRNIC_EXPORT int ibv_attach_mcast(struct ibv_qp*, const union ibv_gid*,
                                     uint16_t) {
  return EOPNOTSUPP;
}
SOFTRNIC_EXPORT int ibv_detach_mcast(struct ibv_qp*, const union ibv_gid*,
                                     uint16_t) {
  return EOPNOTSUPP;
}
SOFTRNIC_EXPORT struct ibv_srq* ibv_create_srq(struct ibv_pd*,
                                               struct ibv_srq_init_attr*) {
  errno = EOPNOTSUPP;
  return nullptr;
}
SOFTRNIC_EXPORT int ibv_modify_srq(struct ibv_srq*, struct ibv_srq_attr*, int) {
  return EOPNOTSUPP;
}
SOFTRNIC_EXPORT int ibv_query_srq(struct ibv_srq*, struct ibv_srq_attr*) {
  return EOPNOTSUPP;
}
SOFTRNIC_EXPORT int ibv_destroy_srq(struct ibv_srq*) { return EOPNOTSUPP; }
SOFTRNIC_EXPORT int ibv_resolve_eth_l2_from_gid(struct ibv_context*,
                                                struct ibv_ah_attr*, uint8_t[6],
                                                uint16_t*) {
  return EOPNOTSUPP;
}
SOFTRNIC_EXPORT int ibv_dontfork_range(void*, size_t) { return 0; }
SOFTRNIC_EXPORT int ibv_dofork_range(void*, size_t) { return 0; }
SOFTRNIC_EXPORT const char* ibv_get_sysfs_path(void) { return "/sys"; }
SOFTRNIC_EXPORT struct ibv_context* ibv_import_device(int) {
  errno = EOPNOTSUPP;
  return nullptr;
}
SOFTRNIC_EXPORT struct ibv_pd* ibv_import_pd(struct ibv_context*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
SOFTRNIC_EXPORT void ibv_unimport_pd(struct ibv_pd*) {}
SOFTRNIC_EXPORT struct ibv_mr* ibv_import_mr(struct ibv_pd*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
SOFTRNIC_EXPORT void ibv_unimport_mr(struct ibv_mr*) {}
SOFTRNIC_EXPORT struct ibv_dm* ibv_import_dm(struct ibv_context*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
SOFTRNIC_EXPORT void ibv_unimport_dm(struct ibv_dm*) {}
SOFTRNIC_EXPORT int ibv_query_ece(struct ibv_qp*, struct ibv_ece*) {
  return EOPNOTSUPP;
}
SOFTRNIC_EXPORT int ibv_set_ece(struct ibv_qp*, struct ibv_ece*) {
  return EOPNOTSUPP;
}
SOFTRNIC_EXPORT int ibv_query_qp_data_in_order(struct ibv_qp*,
                                               enum ibv_wr_opcode, uint32_t) {
  return 0;  // Data may be placed out of order (it is not, but promise less).
}
