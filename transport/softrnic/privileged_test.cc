// softrnic tests that need root in the initial user namespace, so they run
// outside Bazel's sandbox (tag no-sandbox): a pids cgroup around a target
// process, physical frame numbers from /proc/self/pagemap (strict page
// identity) and network namespaces (GID changes). Like the rest of the
// suite they run on softrnic through softrnic_test_main; verbs_peer is the
// other process.
#include <arpa/inet.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"
#include "transport/softrnic/softrnic_control.h"
#include "transport/softrnic/verbs_test_util.h"

namespace softrnic_test {
namespace {

using ferry::testing::RunfilePath;
using ferry::testing::Subprocess;

// verbs_peer, and its answers to commands (the words after "ok").
class Peer {
 public:
  static std::unique_ptr<Peer> Start(const std::vector<std::string>& prefix,
                                     const std::vector<std::string>& flags) {
    std::vector<std::string> argv = prefix;
    argv.push_back(RunfilePath("transport/softrnic/verbs_peer"));
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto p = Subprocess::Start(argv);
    if (!p.ok()) {
      ADD_FAILURE() << p.status();
      return nullptr;
    }
    std::unique_ptr<Peer> peer(new Peer());
    peer->proc_ = std::move(*p);
    auto ready = peer->proc_->ReadLine(absl::Seconds(30));
    if (!ready.ok() || ready->rfind("ready", 0) != 0) {
      ADD_FAILURE() << "peer did not start: "
                    << (ready.ok() ? *ready : ready.status().ToString());
      return nullptr;
    }
    return peer;
  }

  // The answer's words after "ok"; fails the test on "err" or no answer.
  std::vector<std::string> Ask(const std::string& cmd) {
    auto answer = proc_->Ask(cmd, absl::Seconds(30));
    if (!answer.ok()) {
      ADD_FAILURE() << cmd << ": " << answer.status();
      return {};
    }
    std::vector<std::string> words =
        absl::StrSplit(*answer, ' ', absl::SkipEmpty());
    if (words.empty() || words[0] != "ok") {
      ADD_FAILURE() << cmd << " -> " << *answer;
      return {};
    }
    words.erase(words.begin());
    return words;
  }

  Subprocess* proc() { return proc_.get(); }

 private:
  std::unique_ptr<Subprocess> proc_;
};

// A pids cgroup (v1 hierarchy at /sys/fs/cgroup/pids) limiting the number
// of tasks (threads) of the processes moved into it; removed on
// destruction.
class PidsCgroup {
 public:
  static std::unique_ptr<PidsCgroup> Create(int max_tasks, std::string* error) {
    const std::string root = "/sys/fs/cgroup/pids";
    struct stat st;
    if (stat((root + "/cgroup.procs").c_str(), &st) != 0) {
      *error = "no pids cgroup hierarchy at " + root;
      return nullptr;
    }
    std::unique_ptr<PidsCgroup> cg(new PidsCgroup());
    cg->dir_ = absl::StrCat(root, "/ferry-softrnic-test-", getpid());
    rmdir(cg->dir_.c_str());
    if (mkdir(cg->dir_.c_str(), 0755) != 0) {
      *error = "mkdir " + cg->dir_ + ": " + strerror(errno);
      cg->dir_.clear();
      return nullptr;
    }
    if (!cg->Write("pids.max", std::to_string(max_tasks))) {
      *error = "cannot write pids.max";
      return nullptr;
    }
    return cg;
  }
  ~PidsCgroup() {
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  bool Move(pid_t pid) { return Write("cgroup.procs", std::to_string(pid)); }
  // Tasks refused because of the limit so far.
  std::string Events() {
    std::ifstream in(dir_ + "/pids.events");
    std::string s;
    std::getline(in, s);
    return s;
  }

 private:
  bool Write(const std::string& file, const std::string& value) {
    std::ofstream out(dir_ + "/" + file);
    out << value;
    out.flush();
    return static_cast<bool>(out);
  }
  std::string dir_;
};

// ===========================================================================
// A thread limit (a container's pids limit) and many idle connections.

// A target whose process may have only a few tasks must survive hundreds
// of idle connections to its softrnic listener (thread creation fails
// there long before), and keep serving its QPs.
TEST(PidsLimit, IdleConnectionsDoNotAbortTheTarget) {
  signal(SIGPIPE, SIG_IGN);
  std::string err;
  auto cg = PidsCgroup::Create(24, &err);
  ASSERT_NE(cg, nullptr) << err << " (this test needs root outside a sandbox)";
  auto peer = Peer::Start({}, {});
  ASSERT_NE(peer, nullptr);
  ASSERT_TRUE(cg->Move(peer->proc()->pid()));
  std::vector<std::string> w = peer->Ask("open softrnic0 65536");
  ASSERT_EQ(w.size(), 4u);
  const uint32_t peer_qpn = static_cast<uint32_t>(std::stoul(w[0]));
  ibv_gid peer_gid = {};
  ASSERT_TRUE(HexToGid(w[1], &peer_gid));
  const uint64_t peer_addr = std::stoull(w[2]);
  const uint32_t peer_rkey = static_cast<uint32_t>(std::stoul(w[3]));

  ibv_context* ctx = OpenDeviceByName("softrnic0", &err);
  ASSERT_NE(ctx, nullptr) << err;
  {
    auto local = Endpoint::Create(ctx, EndpointOptions(), &err);
    ASSERT_NE(local, nullptr) << err;
    Buffer* buf = local->Reg(65536);
    ASSERT_NE(buf, nullptr);
    ConnectOptions co;
    ASSERT_EQ(ConnectQp(local->qp(), peer_qpn, peer_gid, co, &err), 0) << err;
    ASSERT_EQ(peer->Ask(absl::StrCat("connect ", local->qpn(), " ",
                                     GidToHex(local->gid()), " 14 7 7 12"))
                  .size(),
              0u);
    auto write_and_check = [&](uint32_t seed) {
      FillPattern(buf->data(), 65536, seed);
      ASSERT_EQ(PostRdma(local->qp(), IBV_WR_RDMA_WRITE, seed, buf, 0, 65536,
                         peer_addr, peer_rkey),
                0);
      ibv_wc wc = {};
      ASSERT_TRUE(PollOne(local->cq(), &wc));
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
      std::vector<std::string> sum = peer->Ask("sum 0 65536");
      ASSERT_EQ(sum.size(), 1u);
      char hex[32];
      std::snprintf(hex, sizeof(hex), "%016llx",
                    static_cast<unsigned long long>(Fnv1a(buf->data(), 65536)));
      EXPECT_EQ(sum[0], hex);
    };
    ASSERT_NO_FATAL_FAILURE(write_and_check(1));

    // 300 idle connections from several addresses (under any per-address
    // cap), far more than the 24 tasks the target may have.
    const std::string ip = GidIpv4(peer_gid);
    const uint16_t port = GidPort(peer_gid);
    std::vector<int> fds;
    for (int i = 0; i < 300; ++i) {
      int fd =
          ConnectFrom("127.0.0." + std::to_string(30 + i % 10), ip, port, &err);
      if (fd < 0) break;  // The listener's backlog may fill: that is fine.
      fds.push_back(fd);
    }
    EXPECT_GE(fds.size(), 200u);
    // The target is alive and its QP works, while the connections stay
    // and after they are gone.
    std::vector<std::string> state = peer->Ask("state");
    ASSERT_EQ(state.size(), 1u)
        << "the target died; pids.events: " << cg->Events();
    EXPECT_EQ(state[0], std::to_string(IBV_QPS_RTS));
    ASSERT_NO_FATAL_FAILURE(write_and_check(2));
    for (int fd : fds) close(fd);
    ASSERT_NO_FATAL_FAILURE(write_and_check(3));
  }
  EXPECT_EQ(peer->Ask("quit").size(), 0u);
  auto rc = peer->proc()->Finish(absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
  ibv_close_device(ctx);
}

// ===========================================================================
// GID changes that follow the network (network namespaces).

// The device follows the addresses of the interface it is bound to, as a
// RoCE NIC's GID table follows its netdev: a change raises
// IBV_EVENT_GID_CHANGE, a change on another interface does not, and the
// entry reads as zeros while the device's address is gone.
TEST(GidChange, AddressChangesOfTheBoundInterfaceRaiseGidChange) {
  signal(SIGPIPE, SIG_IGN);
  // The peer runs in a network namespace of its own, on a veth pair.
  auto peer =
      Peer::Start({"/usr/bin/unshare", "--net", "--"},
                  {"--setenv=FERRY_SOFTRNIC_DEVICES=softrnic0=10.77.0.1"});
  ASSERT_NE(peer, nullptr) << "this test needs root and unshare";
  // No IPv6 link-local addresses: they would arrive (and change the
  // interface's addresses) at a moment of the kernel's choosing.
  ASSERT_EQ(peer->Ask("run ip link add v0 type veth peer name v1 && "
                      "ip link set v0 addrgenmode none && "
                      "ip link set v1 addrgenmode none && "
                      "ip addr add 10.77.0.1/24 dev v0 && "
                      "ip link set v1 up && ip link set v0 up")
                .size(),
            0u);
  std::vector<std::string> w = peer->Ask("open softrnic0 4096");
  ASSERT_EQ(w.size(), 4u);
  ibv_gid gid = {};
  ASSERT_TRUE(HexToGid(w[1], &gid));
  EXPECT_EQ(GidIpv4(gid), "10.77.0.1");
  const std::string gid_change = std::to_string(IBV_EVENT_GID_CHANGE);
  const std::string zeros(32, '0');
  EXPECT_EQ(peer->Ask("no_event 300").size(), 0u) << "events while idle";

  // Another address on the bound interface.
  ASSERT_EQ(peer->Ask("run ip addr add 10.77.1.9/24 dev v0").size(), 0u);
  EXPECT_EQ(peer->Ask("await_event " + gid_change + " 5000").size(), 0u);
  // An address on another interface is not the device's business.
  ASSERT_EQ(peer->Ask("run ip addr add 10.88.0.1/24 dev v1").size(), 0u);
  EXPECT_EQ(peer->Ask("no_event 500").size(), 0u);
  // The device's own address goes: the entry empties.
  ASSERT_EQ(peer->Ask("run ip addr del 10.77.0.1/24 dev v0").size(), 0u);
  EXPECT_EQ(peer->Ask("await_event " + gid_change + " 5000").size(), 0u);
  EXPECT_EQ(peer->Ask("gid"), std::vector<std::string>{zeros});
  // And comes back.
  ASSERT_EQ(peer->Ask("run ip addr add 10.77.0.1/24 dev v0").size(), 0u);
  EXPECT_EQ(peer->Ask("await_event " + gid_change + " 5000").size(), 0u);
  EXPECT_EQ(peer->Ask("gid"), std::vector<std::string>{w[1]});

  EXPECT_EQ(peer->Ask("quit").size(), 0u);
  auto rc = peer->proc()->Finish(absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
}

}  // namespace
}  // namespace softrnic_test
