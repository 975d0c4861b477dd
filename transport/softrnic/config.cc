// Device configuration and limits from the environment, and threads.
#include <arpa/inet.h>
#include <pthread.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

bool Valid(const DeviceConfig& d) {
  in_addr a;
  if (d.name.empty() || d.name.size() >= IBV_SYSFS_NAME_MAX) return false;
  return inet_pton(AF_INET, d.ip.c_str(), &a) == 1;
}

void Add(std::vector<DeviceConfig>* out, DeviceConfig d) {
  if (!Valid(d)) {
    std::fprintf(stderr, "softrnic: ignoring bad device entry '%s=%s'\n",
                 d.name.c_str(), d.ip.c_str());
    return;
  }
  for (const auto& e : *out) {
    if (e.name == d.name) {
      std::fprintf(stderr, "softrnic: duplicate device '%s' ignored\n",
                   d.name.c_str());
      return;
    }
  }
  out->push_back(std::move(d));
}

// A positive integer from the environment variable `name`, or `fallback`.
int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || n <= 0 || n > (1 << 30)) {
    std::fprintf(stderr, "softrnic: ignoring %s=%s (not a positive integer)\n",
                 name, v);
    return fallback;
  }
  return static_cast<int>(n);
}

Limits LoadLimits() {
  Limits l;
  l.handshake_timeout_ms =
      EnvInt("FERRY_SOFTRNIC_HANDSHAKE_TIMEOUT_MS", l.handshake_timeout_ms);
  // Accepted connections may hold at most half the process's descriptors,
  // so a flood of them cannot starve the application of its own.
  rlimit nofile{};
  int by_fds = 4096;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 &&
      nofile.rlim_cur != RLIM_INFINITY) {
    by_fds = static_cast<int>(std::min<rlim_t>(nofile.rlim_cur / 2, 4096));
  }
  l.max_connections =
      EnvInt("FERRY_SOFTRNIC_MAX_CONNECTIONS", std::max(16, by_fds));
  l.max_connections_per_address =
      EnvInt("FERRY_SOFTRNIC_MAX_CONNECTIONS_PER_ADDRESS",
             std::max(4, l.max_connections / 4));
  return l;
}

struct ThreadArg {
  char name[16];
  std::function<void()> fn;
};

void* ThreadMain(void* p) {
  std::unique_ptr<ThreadArg> arg(static_cast<ThreadArg*>(p));
  pthread_setname_np(pthread_self(), arg->name);
  arg->fn();
  return nullptr;
}

}  // namespace

namespace {

// "softrnic": what the emulation can do. "roce-1500": a RoCE port on a
// netdev with the Ethernet default MTU of 1500 bytes, whose active_mtu is
// therefore 1024 (the largest IB MTU that fits a frame with its headers),
// with device limits below the values Ferry once hard-coded (send queue
// 512, 16 READs in flight, inline 64): a device that refuses every one of
// those constants, so tests show that nothing depends on them. Its GID
// table holds link-local and RoCE v1 entries before the one to use, as a
// RoCE NIC's does, so picking the first routable-looking entry fails.
constexpr uint8_t kEth = IBV_LINK_LAYER_ETHERNET;
constexpr uint8_t kIb = IBV_LINK_LAYER_INFINIBAND;
constexpr Profile kProfiles[] = {
    {"softrnic", IBV_MTU_4096, IBV_MTU_4096, 16384, 16, 1 << 20, kMaxInline, 16,
     16, 1, kEth},
    // ConnectX-5 (mlx5, vendor_part_id 4119) as `ibv_devinfo -v` prints it
    // in open-mpi/ompi#6137 (the same limits appear for Connect-IB in
    // ofiwg/libfabric#9940 and another mlx5 in #8256): max_qp_wr 32768,
    // max_sge 30, max_cqe 4194303, max_qp_rd_atom and max_qp_init_rd_atom
    // 16; on a 1500-byte netdev (active_mtu 1024, max_mtu 4096) with a RoCE
    // GID table. ibv_devinfo does not print the inline limit: softrnic's.
    {"cx5-roce", IBV_MTU_1024, IBV_MTU_4096, 32768, 30, 4194303, kMaxInline, 16,
     16, 4, kEth},
    // ConnectX-6 (vendor_part_id 4123 in openucx/ucx#8229; ConnectX-6 Lx,
    // 4127, in openucx/ucx#10317) prints the same max_qp_wr, max_cqe and
    // READ depths as the ConnectX-5 above; max_sge is taken as the other
    // mlx5 generations' 30. The RoCE set-up is cx5-roce's.
    {"cx6-roce", IBV_MTU_1024, IBV_MTU_4096, 32768, 30, 4194303, kMaxInline, 16,
     16, 4, kEth},
    // A RoCE port whose GIDs are RoCE v1 only (an old kernel or a port set
    // to v1 mode): nothing a routed fabric can use.
    {"roce-v1-only", IBV_MTU_1024, IBV_MTU_4096, 32768, 30, 4194303, kMaxInline,
     16, 16, 2, kEth},
    {"roce-1500", IBV_MTU_1024, IBV_MTU_4096, 256, 4, 1 << 16, 32, 8, 4, 4,
     kEth},
    // An mlx5 InfiniBand port (ConnectX-4, vendor_part_id 4115, in
    // open-mpi/ompi#9087 and openucx/ucx#7613; ConnectX-5 4119 in
    // open-mpi/ompi#6184): the device limits of cx5-roce, the IB link
    // layer's native 4096-byte MTU, a LID from the subnet manager and one
    // GID, fe80::<port GUID> (the default subnet prefix), that nothing
    // needs within a subnet.
    {"mlx5-ib", IBV_MTU_4096, IBV_MTU_4096, 32768, 30, 4194303, kMaxInline, 16,
     16, 1, kIb},
};

const Profile& LoadProfile() {
  const char* want = std::getenv("FERRY_SOFTRNIC_PROFILE");
  if (want == nullptr || *want == '\0') return kProfiles[0];
  for (const Profile& p : kProfiles) {
    if (std::strcmp(p.name, want) == 0) return p;
  }
  std::fprintf(stderr,
               "softrnic: unknown FERRY_SOFTRNIC_PROFILE=%s; using softrnic\n",
               want);
  return kProfiles[0];
}

}  // namespace

const Profile& GetProfile() {
  static const Profile& profile = LoadProfile();
  return profile;
}

const Limits& GetLimits() {
  static const Limits* limits = new Limits(LoadLimits());
  return *limits;
}

bool StartThread(const char* name, std::function<void()> fn) {
  auto* arg = new ThreadArg();
  std::snprintf(arg->name, sizeof(arg->name), "%s", name);
  arg->fn = std::move(fn);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  const int err = pthread_create(&t, &attr, ThreadMain, arg);
  pthread_attr_destroy(&attr);
  if (err != 0) {
    delete arg;
    // Rate-limited: under a thread limit this may repeat for every
    // connection attempt.
    static std::atomic<int> reported{0};
    if (reported.fetch_add(1, std::memory_order_relaxed) < 10) {
      std::fprintf(stderr, "softrnic: cannot start thread %s: %s\n", name,
                   std::strerror(err));
    }
    errno = err;
    return false;
  }
  return true;
}

std::vector<DeviceConfig> LoadDeviceConfig() {
  std::vector<DeviceConfig> out;
  if (const char* env = std::getenv("FERRY_SOFTRNIC_DEVICES");
      env != nullptr && *env != '\0') {
    std::stringstream ss(env);
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t eq = item.find('=');
      if (eq == std::string::npos) {
        Add(&out, {item, ""});
        continue;
      }
      Add(&out, {item.substr(0, eq), item.substr(eq + 1)});
    }
  } else if (const char* file = std::getenv("FERRY_SOFTRNIC_CONFIG");
             file != nullptr && *file != '\0') {
    std::ifstream in(file);
    if (!in) std::fprintf(stderr, "softrnic: cannot read %s\n", file);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::stringstream ls(line);
      DeviceConfig d;
      ls >> d.name >> d.ip;
      Add(&out, d);
    }
  }
  if (out.empty()) out.push_back({"softrnic0", "127.0.0.1"});
  return out;
}

}  // namespace softrnic
