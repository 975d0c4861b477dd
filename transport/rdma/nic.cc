#include "transport/rdma/nic.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transport/rdma/verbs_compat.h"

namespace ferry::rdma {

int GidScore(const ibv_gid& gid) {
  const uint8_t* g = gid.raw;
  bool zero = true;
  for (int i = 0; i < 16; ++i) zero = zero && g[i] == 0;
  if (zero) return 0;
  // IPv4-mapped (::ffff:a.b.c.d). Bytes 8..9 are ignored: softrnic keeps
  // its listener port there.
  bool v4 = g[10] == 0xff && g[11] == 0xff;
  for (int i = 0; i < 8; ++i) v4 = v4 && g[i] == 0;
  if (v4) return (g[12] == 169 && g[13] == 254) ? 2 : 4;
  if (g[0] == 0xfe && (g[1] & 0xc0) == 0x80) return 1;  // fe80::/10
  return 3;
}

absl::StatusOr<std::vector<ibv_device*>> ListDevices(
    const std::vector<std::string>& filter) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "no RDMA devices (ibv_get_device_list: ", std::strerror(errno),
        "); on a machine without RDMA hardware run on softrnic "
        "(tools/softrnic-run)"));
  }
  std::vector<ibv_device*> out;
  std::vector<std::string> seen;
  for (int i = 0; i < n; ++i) {
    std::string name = ibv_get_device_name(list[i]);
    seen.push_back(name);
    if (filter.empty() ||
        std::find(filter.begin(), filter.end(), name) != filter.end()) {
      out.push_back(list[i]);
    }
  }
  // The ibv_device objects stay valid after freeing the array.
  ibv_free_device_list(list);
  if (out.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no RDMA device matches [", absl::StrJoin(filter, ","),
                     "]; found [", absl::StrJoin(seen, ","), "]"));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Nic>> Nic::Open(ibv_device* dev, int gid_index) {
  std::unique_ptr<Nic> nic(new Nic());
  nic->name_ = ibv_get_device_name(dev);
  nic->ctx_ = ibv_open_device(dev);
  if (nic->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("ibv_open_device(", nic->name_,
                                               "): ", std::strerror(errno)));
  }
  ibv_port_attr port{};
  if (ibv_query_port(nic->ctx_, 1, &port) != 0) {
    return absl::UnavailableError(
        absl::StrCat("ibv_query_port(", nic->name_, ")"));
  }
  if (port.state != IBV_PORT_ACTIVE) {
    return absl::UnavailableError(
        absl::StrCat(nic->name_, " port 1 is not ACTIVE (",
                     ibv_port_state_str(port.state), ")"));
  }
  nic->lid_ = port.lid;
  nic->active_mtu_ = port.active_mtu;
  nic->link_layer_ = port.link_layer;
  nic->requested_gid_index_ = gid_index;
  {
    ibv_gid g{};
    int index = 0;
    std::string why;
    absl::Status s = PickGid(nic->ctx_, gid_index, &g, &index, &why);
    if (!s.ok() &&
        (gid_index >= 0 || port.link_layer == IBV_LINK_LAYER_ETHERNET)) {
      return absl::Status(s.code(),
                          absl::StrCat(nic->name_, ": ", s.message()));
    }
    MutexLock lock(&nic->gid_mu_);
    nic->gid_ = g;
    nic->gid_index_ = index;
    nic->gid_reason_ = std::move(why);
  }
  ibv_device_attr& attr = nic->attr_;
  if (ibv_query_device(nic->ctx_, &attr) != 0) {
    return absl::UnavailableError(
        absl::StrCat("ibv_query_device(", nic->name_, ")"));
  }
  nic->pd_ = ibv_alloc_pd(nic->ctx_);
  nic->channel_ = ibv_create_comp_channel(nic->ctx_);
  if (nic->pd_ == nullptr || nic->channel_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat(nic->name_, ": cannot allocate PD/channel"));
  }
  nic->cq_depth_ = std::min(kCqDepth, attr.max_cqe);
  nic->cq_ =
      ibv_create_cq(nic->ctx_, nic->cq_depth_, nic.get(), nic->channel_, 0);
  if (nic->cq_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat(nic->name_, ": cannot create CQ"));
  }
  return nic;
}

absl::Status PickGid(ibv_context* ctx, int requested, ibv_gid* gid, int* index,
                     std::string* why) {
  std::string ignored;
  if (why == nullptr) why = &ignored;
  ibv_port_attr port{};
  if (ibv_query_port(ctx, 1, &port) != 0) {
    return absl::UnavailableError("ibv_query_port failed");
  }
  const bool roce = port.link_layer == IBV_LINK_LAYER_ETHERNET;
  if (requested >= 0) {
    // A pin (MC_GID_INDEX, rdma.gid_index) is checked here: a wrong one
    // would otherwise show only as connections that never come up.
    if (requested >= port.gid_tbl_len ||
        ibv_query_gid(ctx, 1, requested, gid) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "no GID index ", requested, " (port 1 has ", port.gid_tbl_len,
          " entries; unset MC_GID_INDEX / "
          "rdma.gid_index to let Ferry pick)"));
    }
    static constexpr uint8_t kZero[16] = {};
    if (std::memcmp(gid->raw, kZero, sizeof(kZero)) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("GID index ", requested,
                       " is empty (its netdev has no address for it); unset "
                       "MC_GID_INDEX / rdma.gid_index to let Ferry pick"));
    }
    *index = requested;
    *why = absl::StrCat("index ", requested, " as configured");
    ibv_gid_entry e{};
    if (roce && QueryGidEx(ctx, 1, requested, &e) == 0 &&
        e.gid_type == IBV_GID_TYPE_ROCE_V1) {
      // Allowed (an all-v1 fabric works) but rarely meant: a v1 QP
      // cannot talk to a v2 one, and v1 is not routed over IP.
      absl::StrAppend(why,
                      ", a RoCE v1 entry: it reaches only peers that also "
                      "use RoCE v1, on the same L2 network");
    }
    return absl::OkStatus();
  }
  // RoCE: a RoCE v2 entry (routable over IP; v1 is not, and a v1 QP cannot
  // talk to a v2 one), the best-ranked by GidScore, link-local last. A
  // device that cannot say an entry's type (no ibv_query_gid_ex) is taken
  // at its word for every entry.
  int best = -1, best_score = 0;
  int skipped_v1 = 0;
  for (int i = 0; i < port.gid_tbl_len; ++i) {
    ibv_gid g;
    if (ibv_query_gid(ctx, 1, i, &g) != 0) continue;
    if (roce) {
      ibv_gid_entry e{};
      if (QueryGidEx(ctx, 1, i, &e) == 0 &&
          e.gid_type == IBV_GID_TYPE_ROCE_V1) {
        if (GidScore(g) > 0) ++skipped_v1;
        continue;
      }
    }
    const int score = GidScore(g);
    if (score > best_score) {
      best = i;
      best_score = score;
      *gid = g;
    }
  }
  *index = std::max(best, 0);
  if (best < 0) {
    return absl::NotFoundError(absl::StrCat(
        "no usable GID", skipped_v1 > 0 ? " (only RoCE v1 entries; set "
                                          "rdma.gid_index to use one)"
                                        : ""));
  }
  static constexpr const char* kKinds[] = {"", "link-local IPv6",
                                           "link-local IPv4-mapped",
                                           "global IPv6", "IPv4-mapped"};
  *why = absl::StrCat(roce ? "RoCE v2 " : "", kKinds[best_score],
                      ", the best of ", port.gid_tbl_len, " entries",
                      skipped_v1 > 0
                          ? absl::StrCat(" (", skipped_v1, " RoCE v1 skipped)")
                          : "");
  return absl::OkStatus();
}

bool Nic::RefreshGid() {
  ibv_gid g{};
  int index = 0;
  std::string why;
  if (!PickGid(ctx_, requested_gid_index_, &g, &index, &why).ok()) {
    return false;
  }
  MutexLock lock(&gid_mu_);
  gid_reason_ = std::move(why);
  const bool changed =
      index != gid_index_ || std::memcmp(g.raw, gid_.raw, sizeof(g.raw)) != 0;
  gid_ = g;
  gid_index_ = index;
  return changed;
}

absl::Status Nic::RegisterProbePage() {
  if (probe_mr_ != nullptr) return absl::OkStatus();
  if (probe_ == nullptr) {
    probe_ = std::aligned_alloc(kProbePageBytes, kProbePageBytes);
    if (probe_ == nullptr) {
      return absl::ResourceExhaustedError("no memory for the probe page");
    }
    std::memset(probe_, 0, kProbePageBytes);
  }
  probe_mr_ = ibv_reg_mr(pd_, probe_, kProbePageBytes,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                             IBV_ACCESS_REMOTE_READ);
  if (probe_mr_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        name_, ": cannot register the probe page: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

Nic::~Nic() {
  if (probe_mr_ != nullptr) ibv_dereg_mr(probe_mr_);
  std::free(probe_);
  if (cq_ != nullptr) ibv_destroy_cq(cq_);
  if (channel_ != nullptr) ibv_destroy_comp_channel(channel_);
  if (pd_ != nullptr) ibv_dealloc_pd(pd_);
  if (ctx_ != nullptr) ibv_close_device(ctx_);
}

int MtuBytes(ibv_mtu mtu) { return 128 << static_cast<int>(mtu); }

std::string GidAddress(const ibv_gid& gid) {
  const int score = GidScore(gid);
  const uint8_t* g = gid.raw;
  char buf[INET6_ADDRSTRLEN] = "";
  if (score == 4) {
    inet_ntop(AF_INET, g + 12, buf, sizeof(buf));
  } else if (score == 3) {
    inet_ntop(AF_INET6, g, buf, sizeof(buf));
  }
  return buf;
}

std::string MemlockAdvice(size_t nics) {
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) {
    return "";
  }
  return absl::StrCat(
      "; registered memory is pinned and counts against the locked-memory "
      "limit (RLIMIT_MEMLOCK, now ",
      rl.rlim_cur, " bytes, once per NIC: ", nics,
      " here) unless the process has CAP_IPC_LOCK. ", kRaiseMemlock,
      "; or register less");
}

int EffectiveGidIndex(const RdmaOptions& options) {
  if (options.gid_index >= 0) return options.gid_index;
  const char* env = std::getenv("MC_GID_INDEX");
  int index = -1;
  if (env != nullptr && absl::SimpleAtoi(env, &index) && index >= 0) {
    return index;
  }
  return -1;
}

absl::StatusOr<std::string> FirstNicAddress(const RdmaOptions& options) {
  auto devices = ListDevices(options.devices);
  if (!devices.ok()) return devices.status();
  for (ibv_device* dev : *devices) {
    ibv_context* ctx = ibv_open_device(dev);
    if (ctx == nullptr) continue;
    ibv_port_attr port{};
    ibv_gid gid{};
    int index = 0;
    std::string host;
    if (ibv_query_port(ctx, 1, &port) == 0 && port.state == IBV_PORT_ACTIVE &&
        PickGid(ctx, EffectiveGidIndex(options), &gid, &index).ok()) {
      host = GidAddress(gid);
    }
    ibv_close_device(ctx);
    if (!host.empty()) return host;
  }
  return absl::NotFoundError("no ACTIVE RDMA device has an IP address");
}

}  // namespace ferry::rdma
