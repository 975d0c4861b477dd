// softrnic tests that need root in the initial user namespace, so they run
// outside Bazel's sandbox (tag no-sandbox): a pids cgroup around a target
// process, physical frame numbers from /proc/self/pagemap (strict page
// identity) and network namespaces (GID changes). Like the rest of the
// suite they run on softrnic through softrnic_test_main; verbs_peer is the
// other process.
#include <arpa/inet.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"
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
    auto words = proc_->AskOk(cmd);
    if (!words.ok()) ADD_FAILURE() << words.status();
    return words.ok() ? *std::move(words) : std::vector<std::string>{};
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
// Strict page identity.

constexpr size_t kRegion = 4 * 4096;

// An anonymous mapping of kRegion bytes filled with FillPattern(seed), at
// `at` if given (replacing what is mapped there).
uint8_t* MapPattern(uint32_t seed, void* at = nullptr) {
  void* p = mmap(at, kRegion, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | (at != nullptr ? MAP_FIXED : 0),
                 -1, 0);
  if (p == MAP_FAILED) return nullptr;
  FillPattern(static_cast<uint8_t*>(p), kRegion, seed);
  return static_cast<uint8_t*>(p);
}

// What a free() and a malloc() that reuses the address look like to a
// NIC: the pages go, new ones with new contents come at the same address.
bool Remap(uint8_t* p, uint32_t seed) {
  return munmap(p, kRegion) == 0 && MapPattern(seed, p) == p;
}

enum class Stale {
  kRemoteWriteTarget,
  kLocalWriteSource,
  kRemoteReadSource,
  kLocalReadTarget,
  kReceiveBuffer
};

std::string Name(Stale s) {
  switch (s) {
    case Stale::kRemoteWriteTarget:
      return "stale WRITE target";
    case Stale::kLocalWriteSource:
      return "stale WRITE source";
    case Stale::kRemoteReadSource:
      return "stale READ source";
    case Stale::kLocalReadTarget:
      return "stale READ target";
    case Stale::kReceiveBuffer:
      return "stale receive buffer";
  }
  return "";
}

class StrictPagesTest : public ::testing::TestWithParam<Stale> {
 protected:
  void SetUp() override {
    signal(SIGPIPE, SIG_IGN);
    std::string err;
    for (int i = 0; i < 2; ++i) {
      ctx_[i] = OpenDeviceByName(i == 0 ? "softrnic0" : "softrnic1", &err);
      ASSERT_NE(ctx_[i], nullptr) << err;
    }
  }
  void TearDown() override {
    softrnic::SetStrictPages(false);
    for (ibv_context* c : ctx_) {
      if (c != nullptr) ibv_close_device(c);
    }
  }

  // One operation between a fresh QP pair (a on softrnic0 requests, b on
  // softrnic1 responds) whose `stale` side's memory was replaced after
  // registration. Returns the requester's (and for a SEND the
  // responder's) completion status.
  void Run(bool strict, Stale stale, ibv_wc_status* req_status,
           ibv_wc_status* resp_status, bool* hazard) {
    ASSERT_EQ(softrnic::SetStrictPages(strict), 0) << strerror(errno);
    std::string err;
    auto a = Endpoint::Create(ctx_[0], {}, &err);
    auto b = Endpoint::Create(ctx_[1], {}, &err);
    ASSERT_NE(a, nullptr) << err;
    ASSERT_NE(b, nullptr) << err;
    ASSERT_EQ(ConnectQp(a->qp(), b->qpn(), b->gid(), {}, &err), 0) << err;
    ASSERT_EQ(ConnectQp(b->qp(), a->qpn(), a->gid(), {}, &err), 0) << err;
    uint8_t* local = MapPattern(1);
    uint8_t* remote = MapPattern(2);
    ASSERT_NE(local, nullptr);
    ASSERT_NE(remote, nullptr);
    ibv_mr* lmr = ibv_reg_mr(a->pd(), local, kRegion, kFullAccess);
    ibv_mr* rmr = ibv_reg_mr(b->pd(), remote, kRegion, kFullAccess);
    ASSERT_NE(lmr, nullptr) << strerror(errno);
    ASSERT_NE(rmr, nullptr) << strerror(errno);
    const bool local_stale =
        stale == Stale::kLocalWriteSource || stale == Stale::kLocalReadTarget;
    ASSERT_TRUE(Remap(local_stale ? local : remote, 3));
    const uint64_t before = softrnic::StrictPageViolations();
    ibv_sge sge = {reinterpret_cast<uintptr_t>(local),
                   static_cast<uint32_t>(kRegion), lmr->lkey};
    ibv_send_wr wr = {};
    wr.wr_id = 1;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(remote);
    wr.wr.rdma.rkey = rmr->rkey;
    switch (stale) {
      case Stale::kRemoteWriteTarget:
      case Stale::kLocalWriteSource:
        wr.opcode = IBV_WR_RDMA_WRITE;
        break;
      case Stale::kRemoteReadSource:
      case Stale::kLocalReadTarget:
        wr.opcode = IBV_WR_RDMA_READ;
        break;
      case Stale::kReceiveBuffer: {
        wr.opcode = IBV_WR_SEND;
        ibv_sge rsge = {reinterpret_cast<uintptr_t>(remote),
                        static_cast<uint32_t>(kRegion), rmr->lkey};
        ibv_recv_wr rwr = {};
        rwr.wr_id = 2;
        rwr.sg_list = &rsge;
        rwr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        ASSERT_EQ(ibv_post_recv(b->qp(), &rwr, &bad), 0);
        break;
      }
    }
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(a->qp(), &wr, &bad), 0);
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(a->cq(), &wc)) << "no completion";
    EXPECT_EQ(wc.wr_id, 1u);
    *req_status = wc.status;
    *resp_status = IBV_WC_SUCCESS;
    if (stale == Stale::kReceiveBuffer) {
      ASSERT_TRUE(PollOne(b->cq(), &wc)) << "no receive completion";
      *resp_status = wc.status;
    }
    // Where the data went. A NIC would have used the registered (old)
    // pages; success here means softrnic used the new ones instead.
    switch (stale) {
      case Stale::kRemoteWriteTarget:
      case Stale::kReceiveBuffer:
        *hazard = FirstPatternMismatch(remote, kRegion, 1) == -1;
        break;
      case Stale::kLocalWriteSource:
        *hazard = FirstPatternMismatch(remote, kRegion, 3) == -1;
        break;
      case Stale::kRemoteReadSource:
        *hazard = FirstPatternMismatch(local, kRegion, 3) == -1;
        break;
      case Stale::kLocalReadTarget:
        *hazard = FirstPatternMismatch(local, kRegion, 2) == -1;
        break;
    }
    EXPECT_EQ(softrnic::StrictPageViolations() > before, strict);
    ibv_dereg_mr(lmr);
    ibv_dereg_mr(rmr);
    munmap(local, kRegion);
    munmap(remote, kRegion);
  }

  ibv_context* ctx_[2] = {nullptr, nullptr};
};

// Without strict mode the stale registration "works" and moves the new
// memory's bytes (the hazard: a NIC would move the old pages' bytes);
// with it, the access fails as a protection error, on the same-process
// batch path (WRITE, READ) and the frame-by-frame path (SEND).
TEST_P(StrictPagesTest, StaleRegistrationFailsOnlyInStrictMode) {
  const Stale stale = GetParam();
  SCOPED_TRACE(Name(stale));
  ibv_wc_status req, resp;
  bool hazard = false;
  ASSERT_NO_FATAL_FAILURE(Run(false, stale, &req, &resp, &hazard));
  EXPECT_EQ(req, IBV_WC_SUCCESS) << ibv_wc_status_str(req);
  EXPECT_TRUE(hazard) << "without strict mode the new memory was not used";

  ASSERT_NO_FATAL_FAILURE(Run(true, stale, &req, &resp, &hazard));
  EXPECT_FALSE(hazard) << "strict mode let the access through";
  switch (stale) {
    case Stale::kRemoteWriteTarget:
    case Stale::kRemoteReadSource:
      EXPECT_EQ(req, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(req);
      break;
    case Stale::kLocalWriteSource:
    case Stale::kLocalReadTarget:
      EXPECT_EQ(req, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(req);
      break;
    case Stale::kReceiveBuffer:
      EXPECT_EQ(resp, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(resp);
      EXPECT_EQ(req, IBV_WC_REM_OP_ERR) << ibv_wc_status_str(req);
      break;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, StrictPagesTest,
                         ::testing::Values(Stale::kRemoteWriteTarget,
                                           Stale::kLocalWriteSource,
                                           Stale::kRemoteReadSource,
                                           Stale::kLocalReadTarget,
                                           Stale::kReceiveBuffer));

// Registration in strict mode faults the pages in and refuses memory that
// is not mapped (EFAULT), as ibv_reg_mr's pinning does; MRs registered
// before strict mode was switched on are not checked.
TEST(StrictPages, RegistrationPinsAndRefusesUnmappedMemory) {
  std::string err;
  ibv_context* ctx = OpenDeviceByName("softrnic0", &err);
  ASSERT_NE(ctx, nullptr) << err;
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ASSERT_NE(pd, nullptr);
  uint8_t* p = MapPattern(5);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(munmap(p + 4096, 4096), 0);  // A hole in the middle.
  ASSERT_EQ(softrnic::SetStrictPages(true), 0) << strerror(errno);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd, p, kRegion, kFullAccess), nullptr);
  EXPECT_EQ(errno, EFAULT);
  ibv_mr* mr = ibv_reg_mr(pd, p + 8192, 8192, kFullAccess);
  EXPECT_NE(mr, nullptr) << strerror(errno);
  if (mr != nullptr) ibv_dereg_mr(mr);
  ASSERT_EQ(softrnic::SetStrictPages(false), 0);
  munmap(p, kRegion);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
}

// Strict mode checks access before it faults pages in: PROT_NONE memory
// (a GPU address) and read-only memory under a writable access are EFAULT,
// and nothing is touched (touching PROT_NONE memory would kill the test).
TEST(StrictPages, InaccessibleMemoryIsEfaultWithoutBeingTouched) {
  std::string err;
  ibv_context* ctx = OpenDeviceByName("softrnic0", &err);
  ASSERT_NE(ctx, nullptr) << err;
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ASSERT_NE(pd, nullptr);
  constexpr size_t kLen = 1 << 16;
  void* none = mmap(nullptr, kLen, PROT_NONE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* ro = mmap(nullptr, kLen, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(none, MAP_FAILED);
  ASSERT_NE(ro, MAP_FAILED);
  ASSERT_EQ(softrnic::SetStrictPages(true), 0) << strerror(errno);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd, none, kLen, 0), nullptr);
  EXPECT_EQ(errno, EFAULT);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd, ro, kLen, kFullAccess), nullptr);
  EXPECT_EQ(errno, EFAULT);
  ibv_mr* mr = ibv_reg_mr(pd, ro, kLen, IBV_ACCESS_REMOTE_READ);
  EXPECT_NE(mr, nullptr) << strerror(errno);
  if (mr != nullptr) ibv_dereg_mr(mr);
  ASSERT_EQ(softrnic::SetStrictPages(false), 0);
  munmap(none, kLen);
  munmap(ro, kLen);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
}

// Across processes (the TCP path), strict mode from the environment: the
// peer's MR is replaced under it; this process's WRITE into it fails with
// a remote access error, and the new memory is untouched.
TEST(StrictPages, StaleRemoteMrAcrossProcessesIsARemoteAccessError) {
  signal(SIGPIPE, SIG_IGN);
  auto peer = Peer::Start({}, {"--setenv=FERRY_SOFTRNIC_STRICT_PAGES=1"});
  ASSERT_NE(peer, nullptr);
  std::vector<std::string> w = peer->Ask("open softrnic0 1048576");
  ASSERT_EQ(w.size(), 4u);
  const uint32_t peer_qpn = static_cast<uint32_t>(std::stoul(w[0]));
  ibv_gid peer_gid = {};
  ASSERT_TRUE(HexToGid(w[1], &peer_gid));
  const uint64_t peer_addr = std::stoull(w[2]);
  const uint32_t peer_rkey = static_cast<uint32_t>(std::stoul(w[3]));
  std::string err;
  ibv_context* ctx = OpenDeviceByName("softrnic0", &err);
  ASSERT_NE(ctx, nullptr) << err;
  {
    auto local = Endpoint::Create(ctx, EndpointOptions(), &err);
    ASSERT_NE(local, nullptr) << err;
    Buffer* buf = local->Reg(65536);
    ASSERT_NE(buf, nullptr);
    ASSERT_EQ(ConnectQp(local->qp(), peer_qpn, peer_gid, {}, &err), 0) << err;
    ASSERT_EQ(peer->Ask(absl::StrCat("connect ", local->qpn(), " ",
                                     GidToHex(local->gid()), " 14 7 7 12"))
                  .size(),
              0u);
    // Fresh pages: the WRITE works.
    FillPattern(buf->data(), 65536, 7);
    ASSERT_EQ(PostRdma(local->qp(), IBV_WR_RDMA_WRITE, 1, buf, 0, 65536,
                       peer_addr, peer_rkey),
              0);
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(local->cq(), &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    // The peer's first 64 KiB are replaced.
    ASSERT_EQ(peer->Ask("remap 0 65536 8").size(), 0u);
    std::vector<std::string> before = peer->Ask("sum 0 65536");
    ASSERT_EQ(PostRdma(local->qp(), IBV_WR_RDMA_WRITE, 2, buf, 0, 4096,
                       peer_addr + 4096, peer_rkey),
              0);
    ASSERT_TRUE(PollOne(local->cq(), &wc));
    EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(wc.status);
    EXPECT_EQ(peer->Ask("sum 0 65536"), before) << "the new memory changed";
    std::vector<std::string> v = peer->Ask("violations");
    ASSERT_EQ(v.size(), 1u);
    EXPECT_GE(std::stoull(v[0]), 1u);
  }
  EXPECT_EQ(peer->Ask("quit").size(), 0u);
  EXPECT_OK(peer->proc()->Finish(absl::Seconds(10)));
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
