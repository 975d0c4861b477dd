// doctor: checks whether Ferry's RDMA transport will work on this host,
// and if not, what to change. Every check prints OK, WARN or FAIL with
// what it saw; every WARN and FAIL comes with its fix. Exit status 1 if
// any check failed.
//   doctor [--json] [--device_name=mlx5_0,mlx5_1] [--register_bytes=N]
//   doctor --metadata=HOST:PORT --peer=SEGMENT  (the NIC pair matrix
//   against a running engine), or doctor --serve=PORT on the other host and
//   doctor --peer=HOST:PORT here
// Covers: the verbs library (rdma-core or softrnic), devices, port state,
// link layer, active MTU, the GID table with types and the GID Ferry
// would pick (and why), device limits, the locked-memory limit against
// what will be registered, hugepages, fork safety, and the NIC priority
// matrix Ferry derives from the NUMA and PCI topology; and GPUs: the CUDA
// driver, its GPUs, GPUDirect RDMA readiness (dma-buf, nvidia-peermem)
// and the GPU-NIC affinity matrix.
#include <dirent.h>
#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <limits.h>
#include <link.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/capabilities.h"
#include "ferry/options.h"
#include "tools/doctor_gpu.h"
#include "tools/doctor_peer.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/topology.h"
#include "transport/rdma/verbs_compat.h"

ABSL_FLAG(bool, json, false, "print one JSON object instead of a table");
ABSL_FLAG(std::string, sysfs_root, "/sys",
          "the sysfs tree GPU and NIC placement is read from (tests pass a "
          "fake one)");
ABSL_FLAG(std::string, device_name, "",
          "devices to check, comma-separated (empty: every one)");
ABSL_FLAG(std::string, peer, "",
          "what to probe every local x remote NIC pair of (handshake, "
          "verified WRITE and READ, latency): the segment name of a running "
          "engine (with --metadata), or host:port of a 'doctor --serve'");
ABSL_FLAG(std::string, metadata, "",
          "host:port of the metadata service (a metadata_server, or the "
          "engine that embeds it): --peer is then a segment name");
ABSL_FLAG(int, serve, -1,
          "serve probes from other hosts' doctor --peer on this port (0: "
          "any); runs until killed or --serve_seconds");
ABSL_FLAG(double, serve_seconds, 0, "with --serve: stop after this long");
ABSL_FLAG(uint64_t, register_bytes, 1ull << 30,
          "bytes the application will register (transfer_bench's "
          "--buffer_size): the locked-memory limit must hold them once per "
          "NIC");

namespace ferry {
namespace {

using doctor::Check;
using doctor::Level;

const char* LevelName(Level l) {
  return l == Level::kOk ? "OK" : l == Level::kWarn ? "WARN" : "FAIL";
}

// Which libibverbs this process loaded: softrnic exports softrnic_version.
// The rdma-core release behind a libibverbs path: the library's real name
// is libibverbs.so.1.<ABI minor>.<release> (rdma-core 44.0 ships
// libibverbs.so.1.14.44.0). Empty if the name does not say.
std::string RdmaCoreRelease(const std::string& path) {
  char real[PATH_MAX];
  if (::realpath(path.c_str(), real) == nullptr) return "";
  const std::string name = real;
  const std::string key = "libibverbs.so.1.";
  const size_t at = name.rfind(key);
  if (at == std::string::npos) return "";
  std::vector<std::string> parts =
      absl::StrSplit(name.substr(at + key.size()), '.');
  if (parts.size() < 2) return "";
  parts.erase(parts.begin());  // The ABI minor.
  return absl::StrJoin(parts, ".");
}

// rdma-core 32 added ibv_query_gid_ex, which Ferry uses to skip RoCE v1
// GIDs by type.
constexpr int kMinRdmaCore = 32;

// The verbs library loaded: softrnic, or rdma-core with its release and
// the providers (hardware drivers' user-space halves) installed with it.
Check VerbsLibrary() {
  using VersionFn = const char* (*)();
  if (auto fn = reinterpret_cast<VersionFn>(
          dlsym(RTLD_DEFAULT, "softrnic_version"))) {
    return {"verbs library", Level::kOk, absl::StrCat(fn(), " (emulated NICs)"),
            ""};
  }
  std::string path;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const std::string name = info->dlpi_name;
        if (name.find("libibverbs.so") != std::string::npos) {
          *static_cast<std::string*>(out) = name;
        }
        return 0;
      },
      &path);
  const std::string release = path.empty() ? "" : RdmaCoreRelease(path);
  std::vector<std::string> providers;
  if (const size_t slash = path.rfind('/'); slash != std::string::npos) {
    const std::string dir = path.substr(0, slash) + "/libibverbs";
    if (DIR* d = ::opendir(dir.c_str())) {
      while (dirent* e = ::readdir(d)) {
        const std::string f = e->d_name;
        const size_t dash = f.find("-rdmav");
        if (f.rfind("lib", 0) == 0 && dash != std::string::npos) {
          providers.push_back(f.substr(3, dash - 3));
        }
      }
      ::closedir(d);
    }
  }
  std::sort(providers.begin(), providers.end());
  const std::string detail = absl::StrCat(
      "rdma-core ", release.empty() ? "(release unknown)" : release, ", ",
      path.empty() ? "?" : path, "; providers: ",
      providers.empty() ? "none" : absl::StrJoin(providers, " "));
  int major = 0;
  // A library without ibv_query_gid_ex is older than 32 whatever its name
  // says (the binaries find it at run time: transport/rdma/verbs_compat.h).
  const bool old =
      !rdma::HasQueryGidEx() ||
      (!release.empty() &&
       absl::SimpleAtoi(release.substr(0, release.find('.')), &major) &&
       major < kMinRdmaCore);
  if (old) {
    return {"verbs library", Level::kFail, detail,
            absl::StrCat("Ferry needs rdma-core ", kMinRdmaCore,
                         " or later (ibv_query_gid_ex): upgrade rdma-core "
                         "(libibverbs1 ibverbs-providers)")};
  }
  if (providers.empty()) {
    return {"verbs library", Level::kWarn, detail,
            "no provider libraries: install ibverbs-providers (the NIC "
            "driver's user-space half)"};
  }
  return {"verbs library", Level::kOk, detail, ""};
}

std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

void CheckMemlock(size_t nics, std::vector<Check>* out) {
  const uint64_t want =
      absl::GetFlag(FLAGS_register_bytes) * std::max<size_t>(nics, 1);
  rlimit rl{};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  if (rl.rlim_cur == RLIM_INFINITY || ferry::HasCapability(CAP_IPC_LOCK)) {
    out->push_back({"memlock", Level::kOk,
                    rl.rlim_cur == RLIM_INFINITY
                        ? "unlimited"
                        : "limited, but the process has CAP_IPC_LOCK",
                    ""});
    return;
  }
  const bool enough = rl.rlim_cur >= want;
  out->push_back({"memlock", enough ? Level::kOk : Level::kFail,
                  absl::StrCat("RLIMIT_MEMLOCK ", rl.rlim_cur, " bytes; ",
                               absl::GetFlag(FLAGS_register_bytes),
                               " bytes on ", nics, " NIC(s) pin ", want),
                  enough ? "" : rdma::kRaiseMemlock});
}

void CheckHost(std::vector<Check>* out) {
  std::ifstream meminfo("/proc/meminfo");
  std::string line, total = "0", size = "?";
  while (std::getline(meminfo, line)) {
    std::vector<std::string> f =
        absl::StrSplit(line, absl::ByAnyChar(" :"), absl::SkipEmpty());
    if (f.size() >= 2 && f[0] == "HugePages_Total") total = f[1];
    if (f.size() >= 2 && f[0] == "Hugepagesize") size = f[1] + " kB";
  }
  const std::string thp =
      ReadLine("/sys/kernel/mm/transparent_hugepage/enabled");
  out->push_back(
      {"hugepages", Level::kOk,
       absl::StrCat(total, " reserved of ", size,
                    "; transparent hugepages: ", thp.empty() ? "?" : thp),
       ""});
  const std::optional<ibv_fork_status> known = rdma::IsForkInitialized();
  if (!known.has_value()) {
    out->push_back(
        {"fork safety", Level::kWarn,
         "unknown: this rdma-core (before 35) cannot say whether the kernel "
         "keeps registered pages across fork",
         "an application that forks with memory registered must set "
         "RdmaOptions::fork_safe (or RDMAV_FORK_SAFE=1); rdma-core 35 or "
         "later can tell when it need not"});
    return;
  }
  const ibv_fork_status fork = *known;
  out->push_back(
      {"fork safety", fork == IBV_FORK_DISABLED ? Level::kWarn : Level::kOk,
       fork == IBV_FORK_UNNEEDED  ? "not needed (the kernel keeps registered "
                                    "pages across fork)"
       : fork == IBV_FORK_ENABLED ? "ibv_fork_init is on"
                                  : "off, and this kernel needs it",
       fork == IBV_FORK_DISABLED
           ? "an application that forks with memory registered must set "
             "RdmaOptions::fork_safe (or RDMAV_FORK_SAFE=1)"
           : ""});
}

// One device: port, link layer, MTU, GIDs, the pick, limits.
void CheckDevice(ibv_device* dev, std::vector<Check>* out,
                 std::vector<std::string>* usable) {
  const std::string name = ibv_get_device_name(dev);
  ibv_context* ctx = ibv_open_device(dev);
  if (ctx == nullptr) {
    out->push_back({name, Level::kFail, "ibv_open_device failed",
                    "check /dev/infiniband permissions and the driver "
                    "(dmesg)"});
    return;
  }
  ibv_port_attr port{};
  ibv_device_attr attr{};
  if (ibv_query_port(ctx, 1, &port) != 0 || ibv_query_device(ctx, &attr) != 0) {
    out->push_back({name, Level::kFail, "cannot query port 1 or the device",
                    "check the driver (dmesg, ibv_devinfo)"});
    ibv_close_device(ctx);
    return;
  }
  const bool roce = port.link_layer == IBV_LINK_LAYER_ETHERNET;
  const std::string where = absl::StrCat(name, " port 1");
  if (port.state != IBV_PORT_ACTIVE) {
    out->push_back({where, Level::kFail,
                    absl::StrCat("state ", ibv_port_state_str(port.state),
                                 "; Ferry uses ACTIVE ports only"),
                    roce ? "bring the netdev up with a carrier (ip link; "
                           "cable, switch port)"
                         : "check the cable and that a subnet manager runs "
                           "(ibstat, opensm)"});
    ibv_close_device(ctx);
    return;
  }
  out->push_back(
      {where, Level::kOk,
       absl::StrCat("ACTIVE, ", roce ? "Ethernet (RoCE)" : "InfiniBand",
                    roce ? "" : absl::StrCat(", LID ", port.lid)),
       ""});
  const bool small_mtu = port.active_mtu < IBV_MTU_4096;
  out->push_back(
      {absl::StrCat(name, " MTU"), small_mtu ? Level::kWarn : Level::kOk,
       absl::StrCat("active ", rdma::MtuBytes(port.active_mtu), ", max ",
                    rdma::MtuBytes(port.max_mtu),
                    "; QPs use the smaller of both sides' active MTU"),
       small_mtu && roce
           ? "for full speed set jumbo frames end to end (ip link set dev "
             "<netdev> mtu 9000 on every host and switch port)"
       : small_mtu ? "raise the subnet's MTU in the subnet manager"
                   : ""});
  // The GID table with types.
  std::vector<std::string> entries;
  for (int i = 0; i < port.gid_tbl_len && i < 16; ++i) {
    ibv_gid_entry e{};
    if (rdma::QueryGidEx(ctx, 1, i, &e) != 0) continue;
    const std::string ip = rdma::GidAddress(e.gid);
    entries.push_back(absl::StrCat(
        "[", i, "] ",
        e.gid_type == IBV_GID_TYPE_ROCE_V1   ? "RoCE v1"
        : e.gid_type == IBV_GID_TYPE_ROCE_V2 ? "RoCE v2"
                                             : "IB",
        " ",
        ip.empty() ? absl::BytesToHexString(absl::string_view(
                         reinterpret_cast<const char*>(e.gid.raw), 16))
                   : ip));
  }
  out->push_back({absl::StrCat(name, " GID table"), Level::kOk,
                  entries.empty() ? "empty" : absl::StrJoin(entries, "; "),
                  ""});
  RdmaOptions opts;
  const int requested = rdma::EffectiveGidIndex(opts);
  ibv_gid gid{};
  int index = 0;
  std::string why;
  absl::Status pick = rdma::PickGid(ctx, requested, &gid, &index, &why);
  ibv_gid_entry pinned{};
  if (!pick.ok() && requested >= 0) {
    // Ferry's Init fails the same way on any link layer.
    out->push_back({absl::StrCat(name, " GID"), Level::kFail,
                    std::string(pick.message()),
                    "unset MC_GID_INDEX (or rdma.gid_index) to let Ferry "
                    "pick, or pin an entry of the GID table above"});
  } else if (!pick.ok() && roce) {
    out->push_back({absl::StrCat(name, " GID"), Level::kFail,
                    std::string(pick.message()),
                    "configure a RoCE v2 address on the netdev (an IPv4 "
                    "address gives an IPv4-mapped v2 GID), or pin one with "
                    "MC_GID_INDEX / rdma.gid_index"});
  } else if (roce && requested >= 0 &&
             rdma::QueryGidEx(ctx, 1, requested, &pinned) == 0 &&
             pinned.gid_type == IBV_GID_TYPE_ROCE_V1) {
    out->push_back({absl::StrCat(name, " GID"), Level::kWarn,
                    absl::StrCat("index ", index, " (", why, ")"),
                    "unset MC_GID_INDEX (or rdma.gid_index) so that Ferry "
                    "picks RoCE v2, unless every host runs RoCE v1"});
  } else if (!roce) {
    out->push_back(
        {absl::StrCat(name, " GID"), Level::kOk,
         absl::StrCat("not needed: InfiniBand routes by LID ", port.lid,
                      " within the subnet, and Ferry sends no GRH there"),
         ""});
  } else {
    const std::string ip = rdma::GidAddress(gid);
    out->push_back(
        {absl::StrCat(name, " GID"), Level::kOk,
         absl::StrCat("index ", index, " (", why, ")",
                      ip.empty() ? "" : absl::StrCat(", address ", ip)),
         ""});
  }
  out->push_back(
      {absl::StrCat(name, " limits"), Level::kOk,
       absl::StrCat("max_qp_wr ", attr.max_qp_wr, ", max_sge ", attr.max_sge,
                    ", max_cqe ", attr.max_cqe, ", READ depth ",
                    attr.max_qp_rd_atom, "/", attr.max_qp_init_rd_atom,
                    ", max_mr_size ", attr.max_mr_size),
       ""});
  usable->push_back(name);
  ibv_close_device(ctx);
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      absl::StrAppend(&out, "\\u00", absl::Hex(c, absl::kZeroPad2));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

int Main() {
  if (const int port = absl::GetFlag(FLAGS_serve); port >= 0) {
    std::vector<std::string> devices;
    if (const std::string d = absl::GetFlag(FLAGS_device_name); !d.empty()) {
      devices = absl::StrSplit(d, ',', absl::SkipEmpty());
    }
    absl::Status s = port > 65535
                         ? absl::InvalidArgumentError("--serve: not a port")
                         : doctor::Serve(static_cast<uint16_t>(port), devices,
                                         absl::GetFlag(FLAGS_serve_seconds));
    if (!s.ok()) std::fprintf(stderr, "doctor: %s\n", s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  std::vector<Check> checks;
  checks.push_back(VerbsLibrary());
  std::vector<std::string> filter;
  if (const std::string d = absl::GetFlag(FLAGS_device_name); !d.empty()) {
    filter = absl::StrSplit(d, ',', absl::SkipEmpty());
  }
  auto devices = rdma::ListDevices(filter);
  std::vector<std::string> usable;
  if (!devices.ok()) {
    checks.push_back({"devices", Level::kFail,
                      std::string(devices.status().message()),
                      "install rdma-core and your NIC's driver (ibv_devices "
                      "must list it), or run on softrnic: tools/softrnic-run"});
  } else {
    checks.push_back(
        {"devices", Level::kOk, absl::StrCat(devices->size(), " found"), ""});
    for (ibv_device* dev : *devices) CheckDevice(dev, &checks, &usable);
    if (usable.empty()) {
      checks.push_back({"usable NICs", Level::kFail, "none",
                        "fix the FAILs above: Ferry needs an ACTIVE port"});
    } else {
      // cuda:N by the driver's numbering, as the engine does.
      const rdma::Topology topo = rdma::Topology::FromSysfs(
          absl::GetFlag(FLAGS_sysfs_root), usable, doctor::GpuBusIds());
      checks.push_back(
          {"NIC priority matrix", Level::kOk, topo.ToJson(usable), ""});
    }
  }
  CheckMemlock(usable.size(), &checks);
  CheckHost(&checks);
  doctor::CheckGpus(usable, absl::GetFlag(FLAGS_sysfs_root), &checks);
  if (const std::string peer = absl::GetFlag(FLAGS_peer); !peer.empty()) {
    if (const std::string md = absl::GetFlag(FLAGS_metadata); !md.empty()) {
      doctor::ProbeSegment(md, peer, filter, &checks);
    } else {
      doctor::ProbePeer(peer, filter, &checks);
    }
  }

  int fails = 0, warns = 0;
  for (const Check& c : checks) {
    fails += c.level == Level::kFail;
    warns += c.level == Level::kWarn;
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::string out = "{\"checks\":[";
    for (size_t i = 0; i < checks.size(); ++i) {
      const Check& c = checks[i];
      absl::StrAppend(&out, i ? "," : "", "{\"name\":\"", JsonEscape(c.name),
                      "\",\"level\":\"", LevelName(c.level), "\",\"detail\":\"",
                      JsonEscape(c.detail), "\",\"fix\":\"", JsonEscape(c.fix),
                      "\"}");
    }
    absl::StrAppend(&out, "],\"fails\":", fails, ",\"warnings\":", warns, "}");
    std::printf("%s\n", out.c_str());
  } else {
    for (const Check& c : checks) {
      std::printf("%-4s  %-22s %s\n", LevelName(c.level), c.name.c_str(),
                  c.detail.c_str());
      if (!c.fix.empty())
        std::printf("      %-22s fix: %s\n", "", c.fix.c_str());
    }
    std::printf("%d failed, %d warnings\n", fails, warns);
  }
  return fails > 0 ? 1 : 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Checks whether Ferry's RDMA transport will work on this host.\n"
      "  doctor [--json] [--device_name=...] [--register_bytes=N]\n"
      "  doctor --metadata=HOST:PORT --peer=SEGMENT\n"
      "                                      (every NIC pair to an engine)\n"
      "  doctor --serve=PORT                 (on the peer host)\n"
      "  doctor --peer=HOST:PORT             (every NIC pair to it)");
  absl::ParseCommandLine(argc, argv);
  return ferry::Main();
}
