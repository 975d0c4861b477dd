// Conformance tests for softrnic, run in one process: devices, memory
// regions, CQs and completion channels, the RC QP state machine, async
// events, every RC operation (on one device and across softrnic0 and
// softrnic1), RC error semantics, fault injection and wire robustness.
//
// Everything goes through the standard <infiniband/verbs.h> API plus the
// fault-injection calls of softrnic_control.h, so the expectations are those
// of a real RC-capable RoCE NIC. softrnic_test_main re-executes this binary
// on softrnic's libibverbs.so.1 with devices softrnic0 (127.0.0.1) and
// softrnic1 (127.0.0.2).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <initializer_list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "transport/softrnic/softrnic_control.h"
#include "transport/softrnic/verbs_test_util.h"

#define SOFTRNIC_TEST_CONCAT_INNER_(a, b) a##b
#define SOFTRNIC_TEST_CONCAT_(a, b) SOFTRNIC_TEST_CONCAT_INNER_(a, b)
// Binds `lhs`, a declaration such as `auto* src` (as in
// ASSERT_OK_AND_ASSIGN), to the buffer that `reg`, an Endpoint::Reg call,
// registers; ends the test, saying why, where the registration is refused.
// Nearly every test registers buffers, and a null one would only crash it.
#define ASSERT_REG(lhs, reg)                                            \
  Buffer* const SOFTRNIC_TEST_CONCAT_(softrnic_reg_, __LINE__) = (reg); \
  ASSERT_NE(SOFTRNIC_TEST_CONCAT_(softrnic_reg_, __LINE__), nullptr)    \
      << #reg ": " << strerror(errno);                                  \
  lhs = SOFTRNIC_TEST_CONCAT_(softrnic_reg_, __LINE__)

namespace softrnic_test {
namespace {

const char* const kDevName[2] = {"softrnic0", "softrnic1"};
const char* const kDevIp[2] = {"127.0.0.1", "127.0.0.2"};

std::string StatusName(int status) {
  return std::string(ibv_wc_status_str(static_cast<ibv_wc_status>(status))) +
         " (" + std::to_string(status) + ")";
}

// Polls one completion of `cq` and checks its wr_id and status.
::testing::AssertionResult PollExpect(ibv_cq* cq, uint64_t wr_id,
                                      ibv_wc_status status,
                                      ibv_wc* out = nullptr,
                                      int timeout_ms = kDefaultTimeoutMs) {
  ibv_wc wc = {};
  if (!PollOne(cq, &wc, timeout_ms)) {
    return ::testing::AssertionFailure()
           << "no completion within " << timeout_ms << " ms (wanted wr_id "
           << wr_id << " " << StatusName(status) << ")";
  }
  if (out != nullptr) *out = wc;
  if (wc.wr_id != wr_id || wc.status != status) {
    return ::testing::AssertionFailure()
           << "completion wr_id " << wc.wr_id << " status "
           << StatusName(wc.status) << " opcode " << wc.opcode
           << ", wanted wr_id " << wr_id << " " << StatusName(status);
  }
  return ::testing::AssertionSuccess();
}

// How long CqStaysEmpty watches a CQ by default. The completions its uses
// guard against (an extra flush, an unsignaled WR, a receive consumed by a
// WRITE) would be produced within microseconds of the work before them;
// this leaves room for a loaded machine.
constexpr int kQuietMs = 250;

// Succeeds if `cq` yields no completion for `ms` milliseconds; otherwise
// fails naming the completion that arrived (or the poll error).
::testing::AssertionResult CqStaysEmpty(ibv_cq* cq, int ms = kQuietMs) {
  std::vector<ibv_wc> v;
  const int n = PollCompletions(cq, 1, &v, ms);
  if (n == 0) return ::testing::AssertionSuccess();
  if (n < 0) return ::testing::AssertionFailure() << "ibv_poll_cq failed";
  const ibv_wc& wc = v[0];
  return ::testing::AssertionFailure()
         << "unexpected completion: wr_id " << wc.wr_id << " status "
         << StatusName(wc.status) << " opcode " << wc.opcode << " qp_num "
         << wc.qp_num << " byte_len " << wc.byte_len;
}

// A signaled send WR of `op` gathering the `num_sge` entries at `sges`.
ibv_send_wr SignaledWr(uint64_t wr_id, ibv_wr_opcode op, ibv_sge* sges,
                       int num_sge = 1) {
  ibv_send_wr wr = {};
  wr.wr_id = wr_id;
  wr.sg_list = sges;
  wr.num_sge = num_sge;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  return wr;
}

// SignaledWr for an RDMA `op` on `remote_addr` under `rkey`.
ibv_send_wr SignaledRdmaWr(uint64_t wr_id, ibv_wr_opcode op, ibv_sge* sges,
                           int num_sge, uint64_t remote_addr, uint32_t rkey) {
  ibv_send_wr wr = SignaledWr(wr_id, op, sges, num_sge);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  return wr;
}

// A receive WR scattering into the `num_sge` entries at `sges`.
ibv_recv_wr RecvWr(uint64_t wr_id, ibv_sge* sges, int num_sge = 1) {
  ibv_recv_wr wr = {};
  wr.wr_id = wr_id;
  wr.sg_list = sges;
  wr.num_sge = num_sge;
  return wr;
}

// Clears each bit of `missing` in turn from `mask`: every such
// ibv_modify_qp to `attr` must fail with EINVAL and leave `qp` in `stays`.
void ExpectEachMissingBitRefused(ibv_qp* qp, ibv_qp_attr attr, int mask,
                                 std::initializer_list<int> missing,
                                 ibv_qp_state stays) {
  for (int bit : missing) {
    SCOPED_TRACE("missing mask bit " + std::to_string(bit));
    EXPECT_EQ(ibv_modify_qp(qp, &attr, mask & ~bit), EINVAL);
    EXPECT_EQ(QpState(qp), stays);
  }
}

struct Pair {
  Endpoint* a = nullptr;  // Requester in most tests.
  Endpoint* b = nullptr;  // Responder in most tests.
};

// Posts one signaled RDMA `op` on p.a (`len` bytes from the start of
// `local`, to or from `remote_addr` under `rkey`) and polls its
// completion, which must have `status`; *wc receives it where given.
::testing::AssertionResult RdmaAndPoll(const Pair& p, ibv_wr_opcode op,
                                       uint64_t wr_id, const Buffer* local,
                                       uint32_t len, uint64_t remote_addr,
                                       uint32_t rkey,
                                       ibv_wc_status status = IBV_WC_SUCCESS,
                                       ibv_wc* wc = nullptr) {
  const int rc =
      PostRdma(p.a->qp(), op, wr_id, local, 0, len, remote_addr, rkey);
  if (rc != 0) {
    return ::testing::AssertionFailure()
           << "posting wr_id " << wr_id << " failed: " << strerror(rc);
  }
  return PollExpect(p.a->cq(), wr_id, status, wc);
}

// Opens softrnic0 and softrnic1 for every test and owns all endpoints and
// completion channels the test creates; restores link state and delays
// changed through softrnic_control.h.
class SoftrnicTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Fuzzing writes to sockets the emulator may close.
    signal(SIGPIPE, SIG_IGN);
    for (int i = 0; i < 2; ++i) {
      std::string err;
      ctx_[i] = OpenDeviceByName(kDevName[i], &err);
      ASSERT_NE(ctx_[i], nullptr) << err;
    }
  }

  void TearDown() override {
    for (int i = 0; i < 2; ++i) {
      if (link_changed_[i]) softrnic::SetLink(kDevName[i], true);
      if (delay_changed_[i]) softrnic::SetDelayUs(kDevName[i], 0);
    }
    if (leak_) {
      // A thread is still blocked inside a verb on these objects: leave
      // them alone rather than destroy them under it.
      for (auto& e : endpoints_) e.release();
      return;
    }
    endpoints_.clear();
    for (ibv_comp_channel* ch : channels_) ibv_destroy_comp_channel(ch);
    for (ibv_context* c : extra_contexts_) ibv_close_device(c);
    for (ibv_context*& c : ctx_) {
      if (c != nullptr) ibv_close_device(c);
      c = nullptr;
    }
  }

  ibv_context* ctx(int dev) { return ctx_[dev]; }

  Endpoint* NewEndpoint(int dev, const EndpointOptions& o = {}) {
    std::string err;
    auto e = Endpoint::Create(ctx_[dev], o, &err);
    if (e == nullptr) {
      ADD_FAILURE() << "Endpoint on " << kDevName[dev] << ": " << err;
      return nullptr;
    }
    endpoints_.push_back(std::move(e));
    return endpoints_.back().get();
  }

  ibv_comp_channel* NewChannel(int dev) {
    ibv_comp_channel* ch = ibv_create_comp_channel(ctx_[dev]);
    if (ch != nullptr) channels_.push_back(ch);
    return ch;
  }

  ibv_context* OpenExtraContext(int dev) {
    std::string err;
    ibv_context* c = OpenDeviceByName(kDevName[dev], &err);
    if (c != nullptr) extra_contexts_.push_back(c);
    return c;
  }

  // Connects a <-> b (both RESET) to RTS.
  void Connect(Endpoint* a, Endpoint* b, const ConnectOptions& o) {
    std::string err;
    ASSERT_EQ(ConnectQp(a->qp(), b->qpn(), b->gid(), o, &err), 0) << err;
    ASSERT_EQ(ConnectQp(b->qp(), a->qpn(), a->gid(), o, &err), 0) << err;
  }

  // Two endpoints left in RESET: requester on dev_a, responder on dev_b.
  void NewPair(int dev_a, int dev_b, Pair* p, const EndpointOptions& eo_a = {},
               const EndpointOptions& eo_b = {}) {
    p->a = NewEndpoint(dev_a, eo_a);
    p->b = NewEndpoint(dev_b, eo_b);
    ASSERT_NE(p->a, nullptr);
    ASSERT_NE(p->b, nullptr);
  }

  // Builds a connected RC pair: requester on dev_a, responder on dev_b.
  void MakePair(int dev_a, int dev_b, Pair* p, const EndpointOptions& eo = {},
                const ConnectOptions& co = {}) {
    ASSERT_NO_FATAL_FAILURE(NewPair(dev_a, dev_b, p, eo, eo));
    ASSERT_NO_FATAL_FAILURE(Connect(p->a, p->b, co));
  }

  // MakePair, with the requester's CQ on a new completion channel of
  // dev_a, returned in *ch.
  void MakePairWithChannel(int dev_a, int dev_b, Pair* p,
                           ibv_comp_channel** ch) {
    *ch = NewChannel(dev_a);
    ASSERT_NE(*ch, nullptr);
    EndpointOptions eo;
    eo.channel = *ch;
    ASSERT_NO_FATAL_FAILURE(NewPair(dev_a, dev_b, p, eo));
    ASSERT_NO_FATAL_FAILURE(Connect(p->a, p->b, {}));
  }

  void SetLink(int dev, bool up) {
    link_changed_[dev] = true;
    ASSERT_EQ(softrnic::SetLink(kDevName[dev], up), 0) << strerror(errno);
  }

  void SetDelay(int dev, uint32_t us) {
    delay_changed_[dev] = true;
    ASSERT_EQ(softrnic::SetDelayUs(kDevName[dev], us), 0) << strerror(errno);
  }

  // One signaled RDMA WRITE of `len` pattern bytes a -> b, checked at the
  // target right after the send completion.
  void WriteAndCheck(const Pair& p, uint32_t len, uint32_t seed) {
    ASSERT_REG(auto* src, p.a->Reg(len));
    ASSERT_REG(auto* dst, p.b->Reg(len));
    FillPattern(src->data(), len, seed);
    ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, seed, src, len, dst->addr(),
                            dst->rkey()));
    ASSERT_EQ(FirstPatternMismatch(dst->data(), len, seed), -1);
  }

  bool leak_ = false;

 private:
  ibv_context* ctx_[2] = {nullptr, nullptr};
  std::vector<ibv_context*> extra_contexts_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::vector<ibv_comp_channel*> channels_;
  bool link_changed_[2] = {false, false};
  bool delay_changed_[2] = {false, false};
};

// ===========================================================================
// Devices.

TEST(Devices, ListsSoftrnic0AndSoftrnic1WithDistinctGuids) {
  int num = -1;
  ibv_device** list = ibv_get_device_list(&num);
  ASSERT_NE(list, nullptr) << strerror(errno);
  std::set<std::string> names;
  std::set<uint64_t> guids;
  for (int i = 0; i < num; ++i) {
    ASSERT_NE(list[i], nullptr);
    names.insert(ibv_get_device_name(list[i]));
    uint64_t guid = ibv_get_device_guid(list[i]);
    EXPECT_NE(guid, 0u) << ibv_get_device_name(list[i]);
    guids.insert(guid);
    // RoCE devices are IB-transport channel adapters.
    EXPECT_EQ(list[i]->node_type, IBV_NODE_CA);
    EXPECT_EQ(list[i]->transport_type, IBV_TRANSPORT_IB);
  }
  // The list is NULL-terminated, as callers iterate it both ways.
  EXPECT_EQ(list[num], nullptr);
  ibv_free_device_list(list);
  EXPECT_EQ(num, 2);
  EXPECT_EQ(names, (std::set<std::string>{"softrnic0", "softrnic1"}));
  EXPECT_EQ(guids.size(), names.size());
}

TEST_F(SoftrnicTest, QueryDeviceReportsSaneLimits) {
  for (int d = 0; d < 2; ++d) {
    SCOPED_TRACE(kDevName[d]);
    ibv_device_attr a = {};
    ASSERT_EQ(ibv_query_device(ctx(d), &a), 0);
    EXPECT_EQ(a.phys_port_cnt, 1);
    EXPECT_GT(a.max_qp, 0);
    EXPECT_GE(a.max_qp_wr, 64);
    EXPECT_GE(a.max_sge, 4);
    EXPECT_GE(a.max_cqe, 256);
    EXPECT_GT(a.max_cq, 0);
    EXPECT_GT(a.max_pd, 0);
    EXPECT_GT(a.max_mr, 0);
    EXPECT_GE(a.max_mr_size, uint64_t{1} << 24);
    EXPECT_GE(a.max_qp_rd_atom, 1);
    EXPECT_GE(a.max_qp_init_rd_atom, 1);
    EXPECT_EQ(a.node_guid, ibv_get_device_guid(ctx(d)->device));
  }
}

TEST_F(SoftrnicTest, QueryPortIsActiveEthernet) {
  for (int d = 0; d < 2; ++d) {
    SCOPED_TRACE(kDevName[d]);
    ibv_port_attr pa = {};
    ASSERT_EQ(ibv_query_port(ctx(d), 1, &pa), 0);
    EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);
    EXPECT_EQ(pa.link_layer, IBV_LINK_LAYER_ETHERNET);
    EXPECT_GE(pa.max_mtu, IBV_MTU_1024);
    EXPECT_LE(pa.max_mtu, IBV_MTU_4096);
    EXPECT_GE(pa.active_mtu, IBV_MTU_256);
    EXPECT_LE(pa.active_mtu, pa.max_mtu);
    EXPECT_GE(pa.gid_tbl_len, 1);
    EXPECT_NE(pa.active_speed, 0);
    const std::set<int> widths = {1, 2, 4, 8, 16};
    EXPECT_TRUE(widths.count(pa.active_width)) << int{pa.active_width};
  }
}

TEST_F(SoftrnicTest, QueryPortRejectsNonexistentPorts) {
  // The devices have one port, numbered 1.
  ibv_port_attr pa = {};
  EXPECT_NE(ibv_query_port(ctx(0), 0, &pa), 0);
  EXPECT_NE(ibv_query_port(ctx(0), 2, &pa), 0);
}

TEST_F(SoftrnicTest, GidIsIpv4MappedDeviceAddress) {
  for (int d = 0; d < 2; ++d) {
    SCOPED_TRACE(kDevName[d]);
    ibv_gid gid = {};
    ASSERT_EQ(ibv_query_gid(ctx(d), 1, 0, &gid), 0);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(gid.raw[i], 0) << "byte " << i;
    EXPECT_EQ(gid.raw[10], 0xff);
    EXPECT_EQ(gid.raw[11], 0xff);
    EXPECT_EQ(GidIpv4(gid), kDevIp[d]) << GidToHex(gid);

    // A second context on the same device sees the same GID.
    ibv_context* again = OpenExtraContext(d);
    ASSERT_NE(again, nullptr);
    ibv_gid gid2 = {};
    ASSERT_EQ(ibv_query_gid(again, 1, 0, &gid2), 0);
    EXPECT_EQ(GidToHex(gid), GidToHex(gid2));

    ibv_port_attr pa = {};
    ASSERT_EQ(ibv_query_port(ctx(d), 1, &pa), 0);
    EXPECT_NE(ibv_query_gid(ctx(d), 1, pa.gid_tbl_len, &gid), 0)
        << "index past gid_tbl_len accepted";
  }
}

// ===========================================================================
// PDs and MRs.

TEST_F(SoftrnicTest, RegMrReportsRegionAndDistinctKeys) {
  ibv_pd* pd = ibv_alloc_pd(ctx(0));
  ASSERT_NE(pd, nullptr);
  std::vector<uint8_t> mem(1 << 16);
  std::vector<ibv_mr*> mrs;
  // A compile-time constant access binds to the exported ibv_reg_mr; a
  // variable one goes through ibv_reg_mr_iova2 (see verbs.h): test both.
  ibv_mr* first = ibv_reg_mr(pd, mem.data(), 4096, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(first, nullptr) << strerror(errno);
  mrs.push_back(first);
  const int accesses[] = {0, IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_READ,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
                          kFullAccess};
  size_t off = 4096;
  for (int access : accesses) {
    ibv_mr* mr = ibv_reg_mr(pd, mem.data() + off, 4096, access);
    ASSERT_NE(mr, nullptr) << "access " << access << ": " << strerror(errno);
    EXPECT_EQ(mr->addr, mem.data() + off);
    EXPECT_EQ(mr->length, 4096u);
    EXPECT_EQ(mr->pd, pd);
    EXPECT_EQ(mr->context, ctx(0));
    mrs.push_back(mr);
    off += 4096;
  }
  std::set<uint32_t> lkeys, rkeys;
  for (ibv_mr* mr : mrs) {
    lkeys.insert(mr->lkey);
    rkeys.insert(mr->rkey);
  }
  EXPECT_EQ(lkeys.size(), mrs.size());
  EXPECT_EQ(rkeys.size(), mrs.size());
  for (ibv_mr* mr : mrs) EXPECT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

TEST_F(SoftrnicTest, RegMrRemoteWriteWithoutLocalWriteIsEinval) {
  ibv_pd* pd = ibv_alloc_pd(ctx(0));
  ASSERT_NE(pd, nullptr);
  std::vector<uint8_t> mem(4096);
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(pd, mem.data(), mem.size(), IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(errno, EINVAL);
  if (mr != nullptr) ibv_dereg_mr(mr);
  // Same through the ibv_reg_mr_iova2 path.
  volatile int access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  errno = 0;
  mr = ibv_reg_mr(pd, mem.data(), mem.size(), access);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(errno, EINVAL);
  if (mr != nullptr) ibv_dereg_mr(mr);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

// ===========================================================================
// Access checks at the responder and the requester.

TEST_F(SoftrnicTest, RdmaWriteToMrWithoutRemoteWriteIsRemoteAccessError) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(4096));
  ASSERT_REG(auto* dst,
             p.b->Reg(4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
  FillPattern(src->data(), 4096, 1);
  memset(dst->data(), 0x5a, 4096);
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 1, src, 4096, dst->addr(),
                          dst->rkey(), IBV_WC_REM_ACCESS_ERR));
  EXPECT_EQ(FirstNotEqual(dst->data(), 4096, 0x5a), -1);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_ERR);
}

TEST_F(SoftrnicTest, RdmaReadFromMrWithoutRemoteReadIsRemoteAccessError) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* local, p.a->Reg(4096));
  ASSERT_REG(auto* remote,
             p.b->Reg(4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE));
  FillPattern(remote->data(), 4096, 2);
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_READ, 2, local, 4096, remote->addr(),
                          remote->rkey(), IBV_WC_REM_ACCESS_ERR));
  EXPECT_EQ(FirstNotEqual(local->data(), 4096, 0), -1);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_ERR);
}

TEST_F(SoftrnicTest, RdmaReadIntoMrWithoutLocalWriteFails) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  // Readable locally but not writable: a READ response may not land here.
  ASSERT_REG(auto* local, p.a->Reg(4096, 0));
  ASSERT_REG(auto* remote, p.b->Reg(4096));
  FillPattern(remote->data(), 4096, 3);
  memset(local->data(), 0x11, 4096);
  int rc = PostRdma(p.a->qp(), IBV_WR_RDMA_READ, 3, local, 0, 4096,
                    remote->addr(), remote->rkey());
  if (rc == 0) {
    // Rejected at execution: a local protection error (real NICs), or at
    // least some error completion.
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(p.a->cq(), &wc));
    EXPECT_EQ(wc.wr_id, 3u);
    EXPECT_NE(wc.status, IBV_WC_SUCCESS);
  }
  EXPECT_EQ(FirstNotEqual(local->data(), 4096, 0x11), -1);
}

TEST_F(SoftrnicTest, RecvIntoMrWithoutLocalWriteFails) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(256));
  ASSERT_REG(auto* rbuf, p.b->Reg(256, IBV_ACCESS_REMOTE_READ));
  memset(rbuf->data(), 0x22, 256);
  FillPattern(src->data(), 256, 4);
  if (PostRecvBuf(p.b->qp(), 40, rbuf, 0, 256) == 0) {
    ASSERT_EQ(PostSendMsg(p.a->qp(), 41, src, 0, 256), 0);
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(p.a->cq(), &wc));
    EXPECT_NE(wc.status, IBV_WC_SUCCESS) << "SEND landed in a read-only MR";
  }
  EXPECT_EQ(FirstNotEqual(rbuf->data(), 256, 0x22), -1);
}

TEST_F(SoftrnicTest, BadLkeyIsLocalError) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(256));
  ASSERT_REG(auto* dst, p.b->Reg(256));
  ibv_sge sge = src->Sge(0, 256);
  sge.lkey ^= 0x00abcd00;
  ibv_send_wr wr =
      SignaledRdmaWr(5, IBV_WR_RDMA_WRITE, &sge, 1, dst->addr(), dst->rkey());
  ibv_send_wr* bad = nullptr;
  memset(dst->data(), 0x33, 256);
  if (ibv_post_send(p.a->qp(), &wr, &bad) == 0) {
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(p.a->cq(), &wc));
    EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR) << StatusName(wc.status);
  } else {
    EXPECT_EQ(bad, &wr);
  }
  EXPECT_EQ(FirstNotEqual(dst->data(), 256, 0x33), -1);
}

TEST_F(SoftrnicTest, WrongRkeyIsRemoteAccessError) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(512));
  ASSERT_REG(auto* dst, p.b->Reg(512));
  memset(dst->data(), 0x44, 512);
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 6, src, 512, dst->addr(),
                          dst->rkey() ^ 0x00f0f000, IBV_WC_REM_ACCESS_ERR));
  EXPECT_EQ(FirstNotEqual(dst->data(), 512, 0x44), -1);
}

TEST_F(SoftrnicTest, DeregisteredRkeyIsRemoteAccessError) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(512));
  ASSERT_REG(auto* dst, p.b->Reg(512));
  const uint32_t stale_rkey = dst->rkey();
  ASSERT_EQ(dst->Deregister(), 0);
  memset(dst->data(), 0x45, 512);
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 7, src, 512, dst->addr(),
                          stale_rkey, IBV_WC_REM_ACCESS_ERR));
  EXPECT_EQ(FirstNotEqual(dst->data(), 512, 0x45), -1);
}

// Out-of-bounds requests against an MR that covers only the middle page of
// three: each fails with a remote access error and leaves the guard pages
// (and, for reads, the local buffer) untouched.
TEST_F(SoftrnicTest, OutOfBoundsAccessIsRejectedAndWritesNothingOutside) {
  struct Case {
    const char* name;
    ibv_wr_opcode op;
    int64_t offset;  // Relative to the MR start.
    uint32_t length;
  };
  const Case cases[] = {
      {"write crossing the end", IBV_WR_RDMA_WRITE, 2048, 4096},
      {"write starting before", IBV_WR_RDMA_WRITE, -16, 64},
      {"write past the end", IBV_WR_RDMA_WRITE, 4096, 16},
      {"write one byte too long", IBV_WR_RDMA_WRITE, 0, 4097},
      {"read crossing the end", IBV_WR_RDMA_READ, 4000, 200},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Pair p;
    ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
    // Three pages, the MR on the middle one.
    void* raw = nullptr;
    ASSERT_EQ(posix_memalign(&raw, 4096, 3 * 4096), 0);
    std::unique_ptr<uint8_t, decltype(&free)> mem(static_cast<uint8_t*>(raw),
                                                  &free);
    memset(mem.get(), 0x77, 3 * 4096);
    ibv_mr* mr = ibv_reg_mr(p.b->pd(), mem.get() + 4096, 4096, kFullAccess);
    ASSERT_NE(mr, nullptr);
    ASSERT_REG(auto* local, p.a->Reg(8192));
    FillPattern(local->data(), 8192, 8);
    const uint64_t raddr =
        reinterpret_cast<uintptr_t>(mem.get()) + 4096 + c.offset;
    EXPECT_TRUE(RdmaAndPoll(p, c.op, 8, local, c.length, raddr, mr->rkey,
                            IBV_WC_REM_ACCESS_ERR));
    EXPECT_EQ(FirstNotEqual(mem.get(), 4096, 0x77), -1) << "guard before";
    EXPECT_EQ(FirstNotEqual(mem.get() + 8192, 4096, 0x77), -1) << "guard after";
    if (c.op == IBV_WR_RDMA_READ) {
      EXPECT_EQ(FirstPatternMismatch(local->data(), 8192, 8), -1);
    }
    EXPECT_EQ(ibv_dereg_mr(mr), 0);
  }
}

// A wrapping address (remote_addr + length overflows 64 bits) must not pass
// a naive bounds check.
TEST_F(SoftrnicTest, WrappingRemoteAddressIsRemoteAccessError) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(4096));
  ASSERT_REG(auto* dst, p.b->Reg(4096));
  EXPECT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 9, src, 4096,
                          ~uint64_t{0} - 100, dst->rkey(),
                          IBV_WC_REM_ACCESS_ERR));
}

TEST_F(SoftrnicTest, AccessErrorMovesToErrAndFlushesLaterWork) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(4096));
  ASSERT_REG(auto* dst, p.b->Reg(4096));
  ASSERT_REG(auto* rbuf, p.a->Reg(4096));
  FillPattern(src->data(), 4096, 10);
  // Receives posted on the requester are flushed too.
  ASSERT_EQ(PostRecvBuf(p.a->qp(), 100, rbuf, 0, 1024), 0);
  ASSERT_EQ(PostRecvBuf(p.a->qp(), 101, rbuf, 1024, 1024), 0);
  ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, 1, src, 0, 64, dst->addr(),
                     dst->rkey() ^ 0x00101000),
            0);
  for (uint64_t id = 2; id <= 4; ++id) {
    ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, id, src, 0, 1024,
                       dst->addr((id - 2) * 1024), dst->rkey()),
              0);
  }
  std::vector<ibv_wc> wcs;
  ASSERT_EQ(PollCompletions(p.a->cq(), 6, &wcs), 6);
  std::map<uint64_t, int> status;
  std::vector<uint64_t> send_order;
  for (const ibv_wc& wc : wcs) {
    status[wc.wr_id] = wc.status;
    EXPECT_EQ(wc.qp_num, p.a->qpn());
    if (wc.wr_id < 100) send_order.push_back(wc.wr_id);
  }
  EXPECT_EQ(send_order, (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(status[1], IBV_WC_REM_ACCESS_ERR) << StatusName(status[1]);
  for (uint64_t id : {2, 3, 4, 100, 101}) {
    EXPECT_EQ(status[id], IBV_WC_WR_FLUSH_ERR)
        << "wr_id " << id << ": " << StatusName(status[id]);
  }
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_ERR);
  // Flushed writes were not executed.
  EXPECT_EQ(FirstNotEqual(dst->data(), 4096, 0), -1);
  EXPECT_TRUE(CqStaysEmpty(p.a->cq()));
}

// ===========================================================================
// CQs and completion channels.

TEST_F(SoftrnicTest, CompletionChannelSignalsOnlyWhenArmed) {
  Pair p;
  ibv_comp_channel* ch = nullptr;
  ASSERT_NO_FATAL_FAILURE(MakePairWithChannel(0, 1, &p, &ch));
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* dst, p.b->Reg(64));

  pollfd pfd = {ch->fd, POLLIN, 0};
  ASSERT_EQ(ibv_req_notify_cq(p.a->cq(), 0), 0);
  EXPECT_EQ(poll(&pfd, 1, 0), 0) << "event before any completion";

  ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, 1, src, 0, 64, dst->addr(),
                     dst->rkey()),
            0);
  ASSERT_EQ(poll(&pfd, 1, kDefaultTimeoutMs), 1) << "channel fd not readable";
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  ASSERT_EQ(ibv_get_cq_event(ch, &ev_cq, &ev_ctx), 0);
  EXPECT_EQ(ev_cq, p.a->cq());
  EXPECT_EQ(ev_ctx, p.a);  // The cq_context given to ibv_create_cq.
  ibv_ack_cq_events(ev_cq, 1);
  ASSERT_TRUE(PollExpect(p.a->cq(), 1, IBV_WC_SUCCESS));

  // Not re-armed: a further completion raises no event.
  ASSERT_TRUE(
      RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 2, src, 64, dst->addr(), dst->rkey()));
  EXPECT_EQ(poll(&pfd, 1, 200), 0) << "event without ibv_req_notify_cq";

  // Re-armed: the next completion raises one.
  ASSERT_EQ(ibv_req_notify_cq(p.a->cq(), 0), 0);
  ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, 3, src, 0, 64, dst->addr(),
                     dst->rkey()),
            0);
  ASSERT_EQ(poll(&pfd, 1, kDefaultTimeoutMs), 1);
  ASSERT_EQ(ibv_get_cq_event(ch, &ev_cq, &ev_ctx), 0);
  EXPECT_EQ(ev_cq, p.a->cq());
  ibv_ack_cq_events(ev_cq, 1);
  ASSERT_TRUE(PollExpect(p.a->cq(), 3, IBV_WC_SUCCESS));
}

// Idle devices must cost nothing: every softrnic thread blocks in the
// kernel when there is no work (a spinning emulator would starve the
// application on small machines).
TEST_F(SoftrnicTest, IdleDevicesUseNoCpu) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* dst, p.b->Reg(64));
  ASSERT_TRUE(
      RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 1, src, 64, dst->addr(), dst->rkey()));
  auto cpu_us = [] {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000L +
           ru.ru_utime.tv_usec + ru.ru_stime.tv_usec;
  };
  const long before = cpu_us();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const long used = cpu_us() - before;
  // A busy thread would burn ~1,000,000 us here; allow scheduler noise.
  EXPECT_LT(used, 50000) << "softrnic used " << used << " us of CPU while idle";
}

TEST_F(SoftrnicTest, GetCqEventBlocksUntilCompletion) {
  Pair p;
  ibv_comp_channel* ch = nullptr;
  ASSERT_NO_FATAL_FAILURE(MakePairWithChannel(0, 0, &p, &ch));
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* dst, p.b->Reg(64));
  ASSERT_EQ(ibv_req_notify_cq(p.a->cq(), 0), 0);

  struct Waiter {
    std::promise<int> done;
    ibv_cq* cq = nullptr;
    void* cq_ctx = nullptr;
  };
  // Heap-allocated and leaked if the thread never returns (see below).
  auto* w = new Waiter();
  std::future<int> fut = w->done.get_future();
  std::thread([w, ch] {
    w->done.set_value(ibv_get_cq_event(ch, &w->cq, &w->cq_ctx));
  }).detach();

  EXPECT_EQ(fut.wait_for(std::chrono::milliseconds(100)),
            std::future_status::timeout)
      << "ibv_get_cq_event returned with no completion";
  ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, 1, src, 0, 64, dst->addr(),
                     dst->rkey()),
            0);
  if (fut.wait_for(std::chrono::milliseconds(kDefaultTimeoutMs)) !=
      std::future_status::ready) {
    leak_ = true;  // The thread still uses the channel and the CQ.
    FAIL() << "ibv_get_cq_event did not return after a completion";
  }
  EXPECT_EQ(fut.get(), 0);
  EXPECT_EQ(w->cq, p.a->cq());
  ibv_ack_cq_events(w->cq, 1);
  delete w;
  EXPECT_TRUE(PollExpect(p.a->cq(), 1, IBV_WC_SUCCESS));
}

TEST_F(SoftrnicTest, CqOverrunIsReported) {
  EndpointOptions eo;
  eo.cqe = 4;
  eo.max_send_wr = 128;
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p, eo));
  const int cqe = p.a->cq()->cqe;
  ASSERT_GE(cqe, 4);
  const int n = cqe + 8;
  ASSERT_LE(static_cast<uint32_t>(n), p.a->cap().max_send_wr)
      << "CQ rounded up to " << cqe;
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* dst, p.b->Reg(64));
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, i, src, 0, 8, dst->addr(),
                       dst->rkey()),
              0)
        << "post " << i;
  }
  // Without polling, the CQ must overflow: real NICs raise
  // IBV_EVENT_CQ_ERR; an error from ibv_poll_cq is accepted as well.
  ibv_async_event ev = {};
  bool event = WaitAsyncEvent(ctx(0), IBV_EVENT_CQ_ERR, &ev, 3000);
  if (event) {
    EXPECT_EQ(ev.element.cq, p.a->cq());
    return;
  }
  bool poll_error = false;
  int ok = 0;
  for (int i = 0; i < n + 1; ++i) {
    ibv_wc wc = {};
    int r = ibv_poll_cq(p.a->cq(), 1, &wc);
    if (r < 0) {
      poll_error = true;
      break;
    }
    if (r == 0) break;
    if (wc.status != IBV_WC_SUCCESS) {
      poll_error = true;
      break;
    }
    ++ok;
  }
  EXPECT_TRUE(poll_error) << "no IBV_EVENT_CQ_ERR and no poll error after " << n
                          << " completions into a CQ of " << cqe << " (polled "
                          << ok << " successes)";
}

// ===========================================================================
// RC QP state machine.

TEST_F(SoftrnicTest, QpWalksResetInitRtrRtsErrReset) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(NewPair(0, 1, &p));
  ConnectOptions o;
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_RESET);
  ASSERT_EQ(ModifyToInit(p.a->qp(), o), 0);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_INIT);
  ASSERT_EQ(ModifyToRtr(p.a->qp(), p.b->qpn(), p.b->gid(), o), 0);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_RTR);
  ASSERT_EQ(ModifyToRts(p.a->qp(), o), 0);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_RTS);
  ASSERT_EQ(ModifyToState(p.a->qp(), IBV_QPS_ERR), 0);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_ERR);
  ASSERT_EQ(ModifyToState(p.a->qp(), IBV_QPS_RESET), 0);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_RESET);
}

TEST_F(SoftrnicTest, IllegalTransitionsAreEinvalAndKeepState) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(NewPair(0, 1, &p));
  ConnectOptions o;
  // RESET -> RTR and RESET -> RTS skip INIT.
  EXPECT_EQ(ModifyToRtr(p.a->qp(), p.b->qpn(), p.b->gid(), o), EINVAL);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_RESET);
  EXPECT_EQ(ModifyToRts(p.a->qp(), o), EINVAL);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_RESET);
  // INIT -> RTS skips RTR.
  ASSERT_EQ(ModifyToInit(p.a->qp(), o), 0);
  EXPECT_EQ(ModifyToRts(p.a->qp(), o), EINVAL);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_INIT);
  // RTR -> INIT goes backwards.
  ASSERT_EQ(ModifyToRtr(p.a->qp(), p.b->qpn(), p.b->gid(), o), 0);
  EXPECT_EQ(ModifyToInit(p.a->qp(), o), EINVAL);
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_RTR);
}

TEST_F(SoftrnicTest, MissingInitAttributesAreEinval) {
  Endpoint* a = NewEndpoint(0);
  ASSERT_NE(a, nullptr);
  ibv_qp_attr attr = {};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = 1;
  attr.qp_access_flags = kFullAccess;
  const int full =
      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  ExpectEachMissingBitRefused(
      a->qp(), attr, full,
      {IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_ACCESS_FLAGS}, IBV_QPS_RESET);
  // Port 2 does not exist.
  attr.port_num = 2;
  EXPECT_EQ(ibv_modify_qp(a->qp(), &attr, full), EINVAL);
  EXPECT_EQ(QpState(a->qp()), IBV_QPS_RESET);
}

TEST_F(SoftrnicTest, MissingRtrAttributesAreEinval) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(NewPair(0, 1, &p));
  ConnectOptions o;
  ASSERT_EQ(ModifyToInit(p.a->qp(), o), 0);
  ExpectEachMissingBitRefused(
      p.a->qp(), RtrAttr(p.b->qpn(), p.b->gid(), o), kRtrMask,
      {IBV_QP_DEST_QPN, IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_RQ_PSN},
      IBV_QPS_INIT);
}

TEST_F(SoftrnicTest, MissingRtsAttributesAreEinval) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(NewPair(0, 1, &p));
  ConnectOptions o;
  ASSERT_EQ(ModifyToInit(p.a->qp(), o), 0);
  ASSERT_EQ(ModifyToRtr(p.a->qp(), p.b->qpn(), p.b->gid(), o), 0);
  ExpectEachMissingBitRefused(
      p.a->qp(), RtsAttr(o), kRtsMask,
      {IBV_QP_SQ_PSN, IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY},
      IBV_QPS_RTR);
}

TEST_F(SoftrnicTest, QueryQpReturnsConnectionAttributes) {
  ConnectOptions o;
  o.timeout = 15;
  o.retry_cnt = 5;
  o.rnr_retry = 6;
  o.min_rnr_timer = 13;
  o.psn = 0x4242;
  o.mtu = IBV_MTU_1024;
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p, {}, o));
  ibv_qp_attr attr = {};
  ibv_qp_init_attr init = {};
  const int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                   IBV_QP_ACCESS_FLAGS | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                   IBV_QP_RQ_PSN | IBV_QP_SQ_PSN | IBV_QP_AV | IBV_QP_TIMEOUT |
                   IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MIN_RNR_TIMER |
                   IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC |
                   IBV_QP_CAP;
  ASSERT_EQ(ibv_query_qp(p.a->qp(), &attr, mask, &init), 0);
  EXPECT_EQ(attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(attr.path_mtu, IBV_MTU_1024);
  EXPECT_EQ(attr.dest_qp_num, p.b->qpn());
  EXPECT_EQ(attr.rq_psn, 0x4242u);
  EXPECT_EQ(attr.sq_psn, 0x4242u);
  EXPECT_EQ(attr.timeout, 15);
  EXPECT_EQ(attr.retry_cnt, 5);
  EXPECT_EQ(attr.rnr_retry, 6);
  EXPECT_EQ(attr.min_rnr_timer, 13);
  EXPECT_EQ(attr.port_num, 1);
  EXPECT_EQ(attr.qp_access_flags, kFullAccess);
  EXPECT_EQ(attr.ah_attr.is_global, 1);
  EXPECT_EQ(attr.ah_attr.port_num, 1);
  EXPECT_EQ(GidToHex(attr.ah_attr.grh.dgid), GidToHex(p.b->gid()));
  EXPECT_EQ(attr.cap.max_send_wr, p.a->cap().max_send_wr);
  EXPECT_EQ(attr.cap.max_recv_wr, p.a->cap().max_recv_wr);
  EXPECT_GE(attr.cap.max_inline_data, 64u);
  EXPECT_EQ(init.qp_type, IBV_QPT_RC);
  EXPECT_EQ(init.send_cq, p.a->cq());
  EXPECT_EQ(init.recv_cq, p.a->cq());
}

TEST_F(SoftrnicTest, PostSendBeforeRtsFailsAndRecvInInitWorks) {
  Endpoint* a = NewEndpoint(0);
  ASSERT_NE(a, nullptr);
  ASSERT_REG(auto* buf, a->Reg(64));
  ibv_sge sge = buf->Sge(0, 64);
  ibv_send_wr wr = SignaledWr(1, IBV_WR_SEND, &sge);
  ibv_send_wr* bad = nullptr;
  EXPECT_NE(ibv_post_send(a->qp(), &wr, &bad), 0) << "posted in RESET";
  EXPECT_EQ(bad, &wr);
  ASSERT_EQ(ModifyToInit(a->qp(), {}), 0);
  bad = nullptr;
  EXPECT_NE(ibv_post_send(a->qp(), &wr, &bad), 0) << "posted in INIT";
  EXPECT_EQ(bad, &wr);
  // Receives may be posted from INIT on (rc_pingpong relies on it).
  EXPECT_EQ(PostRecvBuf(a->qp(), 2, buf, 0, 64), 0);
  EXPECT_TRUE(CqStaysEmpty(a->cq()));
  // Moving to ERR flushes the posted receive.
  ASSERT_EQ(ModifyToState(a->qp(), IBV_QPS_ERR), 0);
  EXPECT_TRUE(PollExpect(a->cq(), 2, IBV_WC_WR_FLUSH_ERR));
}

TEST_F(SoftrnicTest, ModifyToErrFlushesReceivesInOrder) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* buf, p.b->Reg(4096));
  for (uint64_t i = 0; i < 5; ++i) {
    ASSERT_EQ(PostRecvBuf(p.b->qp(), 10 + i, buf, i * 64, 64), 0);
  }
  ASSERT_EQ(ModifyToState(p.b->qp(), IBV_QPS_ERR), 0);
  for (uint64_t i = 0; i < 5; ++i) {
    ibv_wc wc = {};
    ASSERT_TRUE(PollExpect(p.b->cq(), 10 + i, IBV_WC_WR_FLUSH_ERR, &wc));
    EXPECT_EQ(wc.qp_num, p.b->qpn());
  }
  EXPECT_TRUE(CqStaysEmpty(p.b->cq()));
}

// ===========================================================================
// Async events.

TEST_F(SoftrnicTest, PortDownAndUpRaiseAsyncEventsOnEveryContext) {
  ibv_context* second = OpenExtraContext(1);
  ASSERT_NE(second, nullptr);
  ASSERT_NO_FATAL_FAILURE(SetLink(1, false));
  for (ibv_context* c : {ctx(1), second}) {
    ibv_async_event ev = {};
    ASSERT_TRUE(WaitAsyncEvent(c, IBV_EVENT_PORT_ERR, &ev, 5000));
    EXPECT_EQ(ev.element.port_num, 1);
  }
  ibv_port_attr pa = {};
  ASSERT_EQ(ibv_query_port(ctx(1), 1, &pa), 0);
  EXPECT_EQ(pa.state, IBV_PORT_DOWN);
  // softrnic0 is not affected.
  ibv_async_event ev = {};
  EXPECT_FALSE(WaitAsyncEvent(ctx(0), IBV_EVENT_PORT_ERR, &ev, 200));
  ASSERT_EQ(ibv_query_port(ctx(0), 1, &pa), 0);
  EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);

  ASSERT_NO_FATAL_FAILURE(SetLink(1, true));
  for (ibv_context* c : {ctx(1), second}) {
    ASSERT_TRUE(WaitAsyncEvent(c, IBV_EVENT_PORT_ACTIVE, &ev, 5000));
    EXPECT_EQ(ev.element.port_num, 1);
  }
  ASSERT_EQ(ibv_query_port(ctx(1), 1, &pa), 0);
  EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);

  // Unknown devices are refused.
  errno = 0;
  EXPECT_EQ(softrnic::SetLink("nosuchdev", false), -1);
  EXPECT_EQ(errno, ENODEV);
}

// IBV_EVENT_DEVICE_FATAL (injected) kills the device as hardware does: the
// event on every context, every QP of the device in ERR with its work
// requests flushed, EIO from further verbs on those contexts (destroying
// objects still works), the other device untouched; once every context
// that saw it is closed, the device opens and works again.
TEST(AsyncEvents, DeviceFatalKillsTheDeviceUntilItsContextsAreClosed) {
  signal(SIGPIPE, SIG_IGN);
  std::string err;
  ibv_context* c0 = OpenDeviceByName("softrnic0", &err);
  ASSERT_NE(c0, nullptr) << err;
  ibv_context* c1 = OpenDeviceByName("softrnic1", &err);
  ASSERT_NE(c1, nullptr) << err;
  ibv_context* c1b = OpenDeviceByName("softrnic1", &err);
  ASSERT_NE(c1b, nullptr) << err;
  auto a = Endpoint::Create(c1, {}, &err);  // Dies with softrnic1.
  ASSERT_NE(a, nullptr) << err;
  auto b = Endpoint::Create(c0, {}, &err);  // Its peer on softrnic0.
  ASSERT_NE(b, nullptr) << err;
  ConnectOptions co;
  co.timeout = 10;  // ~4 ms.
  co.retry_cnt = 2;
  co.rnr_retry = 7;  // RNR-retry for ever: the SENDs stay outstanding.
  ASSERT_EQ(ConnectQp(a->qp(), b->qpn(), b->gid(), co, &err), 0) << err;
  ASSERT_EQ(ConnectQp(b->qp(), a->qpn(), a->gid(), co, &err), 0) << err;
  ASSERT_REG(auto* src, a->Reg(4096));
  ASSERT_REG(auto* bsrc, b->Reg(4096));
  ASSERT_REG(auto* adst, a->Reg(4096));
  ASSERT_EQ(PostRecvBuf(a->qp(), 10, src, 0, 1024), 0);
  ASSERT_EQ(PostRecvBuf(a->qp(), 11, src, 1024, 1024), 0);
  ASSERT_EQ(PostSendMsg(a->qp(), 1, src, 0, 64), 0);  // b posts no receive.
  ASSERT_EQ(PostSendMsg(a->qp(), 2, src, 0, 64), 0);

  ASSERT_EQ(softrnic::InjectAsyncEvent("softrnic1", IBV_EVENT_DEVICE_FATAL), 0)
      << strerror(errno);
  for (ibv_context* c : {c1, c1b}) {
    ibv_async_event ev = {};
    EXPECT_TRUE(WaitAsyncEvent(c, IBV_EVENT_DEVICE_FATAL, &ev, 5000));
  }
  std::vector<ibv_wc> wcs;
  ASSERT_EQ(PollCompletions(a->cq(), 4, &wcs), 4);
  std::set<uint64_t> flushed;
  for (const ibv_wc& wc : wcs) {
    EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR)
        << "wr_id " << wc.wr_id << ": " << StatusName(wc.status);
    flushed.insert(wc.wr_id);
  }
  EXPECT_EQ(flushed, (std::set<uint64_t>{1, 2, 10, 11}));

  // Verbs on the dead contexts fail with EIO.
  ibv_sge sge = src->Sge(0, 64);
  ibv_send_wr swr = {};
  swr.sg_list = &sge;
  swr.num_sge = 1;
  swr.opcode = IBV_WR_SEND;
  ibv_send_wr* bad_send = nullptr;
  EXPECT_EQ(ibv_post_send(a->qp(), &swr, &bad_send), EIO);
  EXPECT_EQ(bad_send, &swr);
  ibv_recv_wr rwr = {};
  rwr.sg_list = &sge;
  rwr.num_sge = 1;
  ibv_recv_wr* bad_recv = nullptr;
  EXPECT_EQ(ibv_post_recv(a->qp(), &rwr, &bad_recv), EIO);
  errno = 0;
  EXPECT_EQ(ibv_alloc_pd(c1b), nullptr);
  EXPECT_EQ(errno, EIO);
  errno = 0;
  std::vector<uint8_t> mem(4096);
  EXPECT_EQ(ibv_reg_mr(a->pd(), mem.data(), mem.size(), IBV_ACCESS_LOCAL_WRITE),
            nullptr);
  EXPECT_EQ(errno, EIO);
  errno = 0;
  EXPECT_EQ(ibv_create_cq(c1b, 16, nullptr, nullptr, 0), nullptr);
  EXPECT_EQ(errno, EIO);
  ibv_port_attr pa = {};
  EXPECT_EQ(ibv_query_port(c1, 1, &pa), EIO);
  ibv_device_attr da = {};
  EXPECT_EQ(ibv_query_device(c1b, &da), EIO);
  EXPECT_EQ(ModifyToState(a->qp(), IBV_QPS_RESET), EIO);
  errno = 0;
  EXPECT_EQ(OpenDeviceByName("softrnic1", &err), nullptr);
  EXPECT_EQ(errno, EIO) << "a dead device opened again";

  // softrnic0 is untouched, but its QP's peer is gone: a WRITE to it ends
  // in a transport retry error, as on a fabric with a dead NIC.
  ibv_async_event ev = {};
  EXPECT_FALSE(WaitAsyncEvent(c0, IBV_EVENT_DEVICE_FATAL, &ev, 200));
  ASSERT_EQ(ibv_query_port(c0, 1, &pa), 0);
  EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);
  ASSERT_EQ(PostRdma(b->qp(), IBV_WR_RDMA_WRITE, 5, bsrc, 0, 64, adst->addr(),
                     adst->rkey()),
            0);
  EXPECT_TRUE(PollExpect(b->cq(), 5, IBV_WC_RETRY_EXC_ERR));

  // Destroying everything works; the device lives again once both of its
  // contexts are closed.
  a.reset();
  EXPECT_EQ(ibv_close_device(c1), 0);
  errno = 0;
  EXPECT_EQ(OpenDeviceByName("softrnic1", &err), nullptr)
      << "alive again while a context that saw it die is open";
  EXPECT_EQ(ibv_close_device(c1b), 0);
  ibv_context* again = OpenDeviceByName("softrnic1", &err);
  ASSERT_NE(again, nullptr) << err;
  ASSERT_EQ(ibv_query_port(again, 1, &pa), 0);
  EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);
  {
    auto x = Endpoint::Create(again, {}, &err);
    auto y = Endpoint::Create(c0, {}, &err);
    ASSERT_NE(x, nullptr) << err;
    ASSERT_NE(y, nullptr) << err;
    ASSERT_EQ(ConnectQp(x->qp(), y->qpn(), y->gid(), {}, &err), 0) << err;
    ASSERT_EQ(ConnectQp(y->qp(), x->qpn(), x->gid(), {}, &err), 0) << err;
    ASSERT_REG(auto* xs, x->Reg(4096));
    ASSERT_REG(auto* yd, y->Reg(4096));
    FillPattern(xs->data(), 4096, 9);
    ASSERT_EQ(PostRdma(x->qp(), IBV_WR_RDMA_WRITE, 6, xs, 0, 4096, yd->addr(),
                       yd->rkey()),
              0);
    EXPECT_TRUE(PollExpect(x->cq(), 6, IBV_WC_SUCCESS));
    EXPECT_EQ(FirstPatternMismatch(yd->data(), 4096, 9), -1);
  }
  b.reset();
  ibv_close_device(again);
  ibv_close_device(c0);
}

// An injected IBV_EVENT_GID_CHANGE re-reads the GID table (unchanged: the
// address is still there) and is delivered on every context of that
// device only.
TEST_F(SoftrnicTest, GidChangeIsDeliveredOnEveryContextOfTheDevice) {
  ibv_context* second = OpenExtraContext(0);
  ASSERT_NE(second, nullptr);
  ibv_gid before = {};
  ASSERT_EQ(ibv_query_gid(ctx(0), 1, 0, &before), 0);
  ASSERT_EQ(softrnic::InjectAsyncEvent("softrnic0", IBV_EVENT_GID_CHANGE), 0)
      << strerror(errno);
  for (ibv_context* c : {ctx(0), second}) {
    ibv_async_event ev = {};
    ASSERT_TRUE(WaitAsyncEvent(c, IBV_EVENT_GID_CHANGE, &ev, 5000));
    EXPECT_EQ(ev.element.port_num, 1);
  }
  ibv_async_event ev = {};
  EXPECT_FALSE(WaitAsyncEvent(ctx(1), IBV_EVENT_GID_CHANGE, &ev, 200));
  ibv_gid after = {};
  ASSERT_EQ(ibv_query_gid(ctx(0), 1, 0, &after), 0);
  EXPECT_EQ(GidToHex(after), GidToHex(before));

  errno = 0;
  EXPECT_EQ(softrnic::InjectAsyncEvent("softrnic0", IBV_EVENT_PORT_ERR), -1);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(softrnic::InjectAsyncEvent("nosuchdev", IBV_EVENT_GID_CHANGE), -1);
  EXPECT_EQ(errno, ENODEV);
}

TEST_F(SoftrnicTest, RemoteAccessViolationRaisesQpAsyncEvent) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* dst, p.b->Reg(64, IBV_ACCESS_LOCAL_WRITE));
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 1, src, 64, dst->addr(),
                          dst->rkey(), IBV_WC_REM_ACCESS_ERR));
  // The responder reports the violation as an affiliated QP error (IB
  // spec: QP access error on the responder); accept a fatal or request
  // error on either QP as well.
  const std::set<int> qp_errors = {IBV_EVENT_QP_ACCESS_ERR, IBV_EVENT_QP_FATAL,
                                   IBV_EVENT_QP_REQ_ERR};
  bool seen = false;
  std::vector<int> others;
  const auto start = Clock::now();
  while (!seen && MsSince(start) < 5000) {
    for (int d = 0; d < 2 && !seen; ++d) {
      ibv_async_event ev = {};
      if (!NextAsyncEvent(ctx(d), &ev, 50)) continue;
      if (qp_errors.count(ev.event_type) &&
          (ev.element.qp == p.a->qp() || ev.element.qp == p.b->qp())) {
        seen = true;
      } else {
        others.push_back(ev.event_type);
      }
    }
  }
  EXPECT_TRUE(seen) << "no QP access/fatal async event; other events: "
                    << others.size();
}

// ===========================================================================
// Operations, on one device (loopback) and across softrnic0/softrnic1.

class OpsTest : public SoftrnicTest,
                public ::testing::WithParamInterface<std::pair<int, int>> {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(SoftrnicTest::SetUp());
    ASSERT_NO_FATAL_FAILURE(
        MakePair(GetParam().first, GetParam().second, &p_, Options()));
  }
  virtual EndpointOptions Options() { return {}; }
  Pair p_;
};

TEST_P(OpsTest, RdmaWriteIsVisibleAtSendCompletion) {
  for (uint32_t len : {1u, 4096u, 65537u, 1u << 20, 4u << 20}) {
    SCOPED_TRACE("length " + std::to_string(len));
    ASSERT_REG(auto* src, p_.a->Reg(len));
    // 64 bytes more than written, to catch overlong writes.
    ASSERT_REG(auto* dst, p_.b->Reg(len + 64));
    FillPattern(src->data(), len, len);
    ibv_wc wc = {};
    ASSERT_TRUE(RdmaAndPoll(p_, IBV_WR_RDMA_WRITE, len, src, len, dst->addr(),
                            dst->rkey(), IBV_WC_SUCCESS, &wc));
    EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
    EXPECT_EQ(wc.qp_num, p_.a->qpn());
    // RC: the send completion means the responder applied the data.
    EXPECT_EQ(FirstPatternMismatch(dst->data(), len, len), -1);
    EXPECT_EQ(FirstNotEqual(dst->data() + len, 64, 0), -1);
  }
  // A plain RDMA WRITE produces no completion at the responder.
  EXPECT_TRUE(CqStaysEmpty(p_.b->cq()));
}

TEST_P(OpsTest, EverySendCompletionFollowsItsData) {
  const uint32_t len = 16384;
  ASSERT_REG(auto* src, p_.a->Reg(len));
  ASSERT_REG(auto* dst, p_.b->Reg(len));
  for (uint32_t i = 0; i < 100; ++i) {
    FillPattern(src->data(), len, 1000 + i);
    ASSERT_TRUE(RdmaAndPoll(p_, IBV_WR_RDMA_WRITE, i, src, len, dst->addr(),
                            dst->rkey()));
    ASSERT_EQ(FirstPatternMismatch(dst->data(), len, 1000 + i), -1)
        << "iteration " << i;
  }
}

TEST_P(OpsTest, RdmaWriteWithImmConsumesReceive) {
  const uint32_t len = 8192;
  ASSERT_REG(auto* src, p_.a->Reg(len));
  ASSERT_REG(auto* dst, p_.b->Reg(len));
  ASSERT_REG(auto* rbuf, p_.b->Reg(256));
  memset(rbuf->data(), 0x33, 256);
  FillPattern(src->data(), len, 21);
  ASSERT_EQ(PostRecvBuf(p_.b->qp(), 77, rbuf, 0, 256), 0);
  ASSERT_EQ(PostRdma(p_.a->qp(), IBV_WR_RDMA_WRITE_WITH_IMM, 1, src, 0, len,
                     dst->addr(), dst->rkey(), true, 0xdeadbeef),
            0);
  ibv_wc wc = {};
  ASSERT_TRUE(PollExpect(p_.a->cq(), 1, IBV_WC_SUCCESS, &wc));
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(FirstPatternMismatch(dst->data(), len, 21), -1);
  ASSERT_TRUE(PollExpect(p_.b->cq(), 77, IBV_WC_SUCCESS, &wc));
  EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(ntohl(wc.imm_data), 0xdeadbeefu);
  EXPECT_EQ(wc.qp_num, p_.b->qpn());
  // byte_len is the length of the RDMA WRITE (IB spec, as mlx5).
  EXPECT_EQ(wc.byte_len, len);
  // The data went to remote_addr, not into the receive buffer.
  EXPECT_EQ(FirstNotEqual(rbuf->data(), 256, 0x33), -1);
}

TEST_P(OpsTest, RdmaReadReturnsRemoteData) {
  for (uint32_t len : {1u, 4096u, 1u << 20}) {
    SCOPED_TRACE("length " + std::to_string(len));
    ASSERT_REG(auto* local, p_.a->Reg(len + 64));
    ASSERT_REG(auto* remote, p_.b->Reg(len));
    FillPattern(remote->data(), len, 30 + len);
    ibv_wc wc = {};
    ASSERT_TRUE(RdmaAndPoll(p_, IBV_WR_RDMA_READ, len, local, len,
                            remote->addr(), remote->rkey(), IBV_WC_SUCCESS,
                            &wc));
    EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
    EXPECT_EQ(FirstPatternMismatch(local->data(), len, 30 + len), -1);
    EXPECT_EQ(FirstNotEqual(local->data() + len, 64, 0), -1);
  }
  EXPECT_TRUE(CqStaysEmpty(p_.b->cq()));
}

TEST_P(OpsTest, SendLandsInPostedReceive) {
  for (uint32_t len : {1u, 1000u, 1u << 20}) {
    SCOPED_TRACE("length " + std::to_string(len));
    ASSERT_REG(auto* src, p_.a->Reg(len));
    ASSERT_REG(auto* rbuf, p_.b->Reg(len + 128));
    FillPattern(src->data(), len, 40 + len);
    ASSERT_EQ(PostRecvBuf(p_.b->qp(), 50, rbuf, 0, len + 128), 0);
    ASSERT_EQ(PostSendMsg(p_.a->qp(), 51, src, 0, len), 0);
    ibv_wc wc = {};
    ASSERT_TRUE(PollExpect(p_.a->cq(), 51, IBV_WC_SUCCESS, &wc));
    EXPECT_EQ(wc.opcode, IBV_WC_SEND);
    ASSERT_TRUE(PollExpect(p_.b->cq(), 50, IBV_WC_SUCCESS, &wc));
    EXPECT_EQ(wc.opcode, IBV_WC_RECV);
    EXPECT_EQ(wc.byte_len, len);
    EXPECT_FALSE(wc.wc_flags & IBV_WC_WITH_IMM);
    EXPECT_EQ(wc.qp_num, p_.b->qpn());
    EXPECT_EQ(FirstPatternMismatch(rbuf->data(), len, 40 + len), -1);
    EXPECT_EQ(FirstNotEqual(rbuf->data() + len, 128, 0), -1);
  }
  // And in the other direction.
  ASSERT_REG(auto* src, p_.b->Reg(100));
  ASSERT_REG(auto* rbuf, p_.a->Reg(100));
  FillPattern(src->data(), 100, 49);
  ASSERT_EQ(PostRecvBuf(p_.a->qp(), 60, rbuf, 0, 100), 0);
  ASSERT_EQ(PostSendMsg(p_.b->qp(), 61, src, 0, 100), 0);
  ASSERT_TRUE(PollExpect(p_.b->cq(), 61, IBV_WC_SUCCESS));
  ASSERT_TRUE(PollExpect(p_.a->cq(), 60, IBV_WC_SUCCESS));
  EXPECT_EQ(FirstPatternMismatch(rbuf->data(), 100, 49), -1);
}

TEST_P(OpsTest, SendWithImmCarriesImmediate) {
  ASSERT_REG(auto* src, p_.a->Reg(512));
  ASSERT_REG(auto* rbuf, p_.b->Reg(512));
  FillPattern(src->data(), 512, 55);
  ASSERT_EQ(PostRecvBuf(p_.b->qp(), 70, rbuf, 0, 512), 0);
  ASSERT_EQ(PostSendMsg(p_.a->qp(), 71, src, 0, 300, true, 0x01020304), 0);
  ASSERT_TRUE(PollExpect(p_.a->cq(), 71, IBV_WC_SUCCESS));
  ibv_wc wc = {};
  ASSERT_TRUE(PollExpect(p_.b->cq(), 70, IBV_WC_SUCCESS, &wc));
  EXPECT_EQ(wc.opcode, IBV_WC_RECV);
  EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
  // imm_data is big-endian on both sides: passed through unchanged.
  EXPECT_EQ(ntohl(wc.imm_data), 0x01020304u);
  EXPECT_EQ(wc.byte_len, 300u);
  EXPECT_EQ(FirstPatternMismatch(rbuf->data(), 300, 55), -1);
}

TEST_P(OpsTest, SendGathersAndReceiveScatters) {
  ASSERT_REG(auto* s1, p_.a->Reg(2048));
  ASSERT_REG(auto* s2, p_.a->Reg(1024));
  ASSERT_REG(auto* r1, p_.b->Reg(2048));
  ASSERT_REG(auto* r2, p_.b->Reg(1024));
  FillPattern(s1->data(), 2048, 61);
  FillPattern(s2->data(), 1024, 62);
  // Message = s1[0,100) + s1[500,700) + s2[100,400): 600 bytes.
  std::vector<uint8_t> msg;
  msg.insert(msg.end(), s1->data(), s1->data() + 100);
  msg.insert(msg.end(), s1->data() + 500, s1->data() + 700);
  msg.insert(msg.end(), s2->data() + 100, s2->data() + 400);
  ibv_sge ssge[3] = {s1->Sge(0, 100), s1->Sge(500, 200), s2->Sge(100, 300)};
  // Received into r1[0,150) + r1[1000,1150) + r2[0,300).
  ibv_sge rsge[3] = {r1->Sge(0, 150), r1->Sge(1000, 150), r2->Sge(0, 300)};
  ibv_recv_wr rwr = RecvWr(80, rsge, 3);
  ibv_recv_wr* rbad = nullptr;
  ASSERT_EQ(ibv_post_recv(p_.b->qp(), &rwr, &rbad), 0);
  ibv_send_wr swr = SignaledWr(81, IBV_WR_SEND, ssge, 3);
  ibv_send_wr* sbad = nullptr;
  ASSERT_EQ(ibv_post_send(p_.a->qp(), &swr, &sbad), 0);
  ASSERT_TRUE(PollExpect(p_.a->cq(), 81, IBV_WC_SUCCESS));
  ibv_wc wc = {};
  ASSERT_TRUE(PollExpect(p_.b->cq(), 80, IBV_WC_SUCCESS, &wc));
  EXPECT_EQ(wc.byte_len, 600u);
  EXPECT_EQ(memcmp(r1->data(), msg.data(), 150), 0);
  EXPECT_EQ(memcmp(r1->data() + 1000, msg.data() + 150, 150), 0);
  EXPECT_EQ(memcmp(r2->data(), msg.data() + 300, 300), 0);
  EXPECT_EQ(FirstNotEqual(r1->data() + 150, 850, 0), -1);
  EXPECT_EQ(FirstNotEqual(r1->data() + 1150, 898, 0), -1);
  EXPECT_EQ(FirstNotEqual(r2->data() + 300, 724, 0), -1);
}

TEST_P(OpsTest, RdmaWriteGathersAndReadScatters) {
  ASSERT_REG(auto* s, p_.a->Reg(4096));
  ASSERT_REG(auto* remote, p_.b->Reg(4096));
  FillPattern(s->data(), 4096, 63);
  // WRITE gathers s[0,10) + s[1000,1500) + s[3000,3090) to remote[0,600).
  ibv_sge wsge[3] = {s->Sge(0, 10), s->Sge(1000, 500), s->Sge(3000, 90)};
  ibv_send_wr wr = SignaledRdmaWr(90, IBV_WR_RDMA_WRITE, wsge, 3,
                                  remote->addr(), remote->rkey());
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p_.a->qp(), &wr, &bad), 0);
  ASSERT_TRUE(PollExpect(p_.a->cq(), 90, IBV_WC_SUCCESS));
  EXPECT_EQ(memcmp(remote->data(), s->data(), 10), 0);
  EXPECT_EQ(memcmp(remote->data() + 10, s->data() + 1000, 500), 0);
  EXPECT_EQ(memcmp(remote->data() + 510, s->data() + 3000, 90), 0);
  EXPECT_EQ(FirstNotEqual(remote->data() + 600, 4096 - 600, 0), -1);

  // READ scatters remote[1000,1600) into local l[0,200) + l[2000,2400).
  FillPattern(remote->data(), 4096, 64);
  ASSERT_REG(auto* l, p_.a->Reg(4096));
  ibv_sge rsge[2] = {l->Sge(0, 200), l->Sge(2000, 400)};
  wr = SignaledRdmaWr(91, IBV_WR_RDMA_READ, rsge, 2, remote->addr(1000),
                      remote->rkey());
  ASSERT_EQ(ibv_post_send(p_.a->qp(), &wr, &bad), 0);
  ASSERT_TRUE(PollExpect(p_.a->cq(), 91, IBV_WC_SUCCESS));
  EXPECT_EQ(memcmp(l->data(), remote->data() + 1000, 200), 0);
  EXPECT_EQ(memcmp(l->data() + 2000, remote->data() + 1200, 400), 0);
  EXPECT_EQ(FirstNotEqual(l->data() + 200, 1800, 0), -1);
  EXPECT_EQ(FirstNotEqual(l->data() + 2400, 4096 - 2400, 0), -1);
}

TEST_P(OpsTest, InlineDataIsCopiedAtPostTime) {
  const uint32_t cap = p_.a->cap().max_inline_data;
  ASSERT_GE(cap, 64u);
  ASSERT_REG(auto* rbuf, p_.b->Reg(cap + 64));
  ASSERT_REG(auto* dst, p_.b->Reg(cap));
  // Unregistered memory: inline data needs no lkey.
  std::vector<uint8_t> src(cap + 1);
  FillPattern(src.data(), cap, 65);
  ibv_sge sge = {reinterpret_cast<uintptr_t>(src.data()), cap, 0};
  ibv_send_wr wr = SignaledWr(100, IBV_WR_SEND, &sge);
  wr.send_flags |= IBV_SEND_INLINE;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(PostRecvBuf(p_.b->qp(), 101, rbuf, 0, cap + 64), 0);
  ASSERT_EQ(ibv_post_send(p_.a->qp(), &wr, &bad), 0);
  // The buffer may be reused as soon as post returns.
  memset(src.data(), 0xee, src.size());
  ASSERT_TRUE(PollExpect(p_.a->cq(), 100, IBV_WC_SUCCESS));
  ibv_wc wc = {};
  ASSERT_TRUE(PollExpect(p_.b->cq(), 101, IBV_WC_SUCCESS, &wc));
  EXPECT_EQ(wc.byte_len, cap);
  EXPECT_EQ(FirstPatternMismatch(rbuf->data(), cap, 65), -1);

  // Inline RDMA WRITE.
  FillPattern(src.data(), cap, 66);
  wr.wr_id = 102;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.wr.rdma.remote_addr = dst->addr();
  wr.wr.rdma.rkey = dst->rkey();
  ASSERT_EQ(ibv_post_send(p_.a->qp(), &wr, &bad), 0);
  memset(src.data(), 0xee, src.size());
  ASSERT_TRUE(PollExpect(p_.a->cq(), 102, IBV_WC_SUCCESS));
  EXPECT_EQ(FirstPatternMismatch(dst->data(), cap, 66), -1);

  // One byte over max_inline_data is refused at post time.
  sge.length = cap + 1;
  wr.wr_id = 103;
  bad = nullptr;
  EXPECT_NE(ibv_post_send(p_.a->qp(), &wr, &bad), 0);
  EXPECT_EQ(bad, &wr);
  EXPECT_TRUE(CqStaysEmpty(p_.a->cq()));
}

// One ibv_post_send of a long chain (WRITEs, inline WRITEs and READs,
// unsignaled but for every 10th and the last) crosses several of the
// same-process path's batches: every WR is executed once, in order.
TEST_P(OpsTest, LongChainsExecuteEveryWrInOrder) {
  const int n = 60;  // Within the SQ's 64 WRs; batches are 32.
  const uint32_t len = 200;
  ASSERT_REG(auto* src, p_.a->Reg(n * len));
  ASSERT_REG(auto* local, p_.a->Reg(n * len));
  ASSERT_REG(auto* remote, p_.b->Reg(n * len));
  FillPattern(src->data(), n * len, 80);
  FillPattern(remote->data(), n * len, 81);
  std::vector<uint8_t> remote_before(remote->data(), remote->data() + n * len);
  std::vector<ibv_send_wr> wrs(n);
  std::vector<ibv_sge> sges(n);
  std::vector<uint64_t> signaled;
  for (int i = 0; i < n; ++i) {
    const size_t off = static_cast<size_t>(i) * len;
    ibv_send_wr& wr = wrs[i];
    wr = {};
    wr.wr_id = i;
    wr.num_sge = 1;
    wr.sg_list = &sges[i];
    wr.wr.rdma.remote_addr = remote->addr(off);
    wr.wr.rdma.rkey = remote->rkey();
    if (i % 3 == 2) {
      wr.opcode = IBV_WR_RDMA_READ;
      sges[i] = local->Sge(off, len);
    } else {
      wr.opcode = IBV_WR_RDMA_WRITE;
      sges[i] = src->Sge(off, len);
      if (i % 3 == 1) wr.send_flags |= IBV_SEND_INLINE;
    }
    if (i % 10 == 9 || i == n - 1) {
      wr.send_flags |= IBV_SEND_SIGNALED;
      signaled.push_back(i);
    }
    wr.next = i + 1 < n ? &wrs[i + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p_.a->qp(), wrs.data(), &bad), 0);
  std::vector<ibv_wc> wcs;
  ASSERT_EQ(PollCompletions(p_.a->cq(), signaled.size(), &wcs),
            static_cast<int>(signaled.size()));
  for (size_t k = 0; k < signaled.size(); ++k) {
    EXPECT_EQ(wcs[k].wr_id, signaled[k]);
    EXPECT_EQ(wcs[k].status, IBV_WC_SUCCESS) << StatusName(wcs[k].status);
  }
  for (int i = 0; i < n; ++i) {
    const size_t off = static_cast<size_t>(i) * len;
    if (i % 3 == 2) {
      EXPECT_EQ(memcmp(local->data() + off, remote_before.data() + off, len), 0)
          << "READ " << i;
    } else {
      EXPECT_EQ(memcmp(remote->data() + off, src->data() + off, len), 0)
          << "WRITE " << i;
    }
  }
  EXPECT_TRUE(CqStaysEmpty(p_.a->cq()));
}

// A bad rkey in the middle of a chain: the WRs before it are executed and
// complete, it fails with a remote access error, the rest are flushed and
// never executed.
TEST_P(OpsTest, BadKeyMidChainStopsExactlyThere) {
  const int n = 60, bad_at = 45;
  const uint32_t len = 64;
  ASSERT_REG(auto* src, p_.a->Reg(n * len));
  ASSERT_REG(auto* remote, p_.b->Reg(n * len));
  FillPattern(src->data(), n * len, 90);
  std::vector<ibv_send_wr> wrs(n);
  std::vector<ibv_sge> sges(n);
  for (int i = 0; i < n; ++i) {
    const size_t off = static_cast<size_t>(i) * len;
    sges[i] = src->Sge(off, len);
    wrs[i] = SignaledRdmaWr(
        i, IBV_WR_RDMA_WRITE, &sges[i], 1, remote->addr(off),
        i == bad_at ? remote->rkey() ^ 0x00101000 : remote->rkey());
    wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p_.a->qp(), wrs.data(), &bad), 0);
  std::vector<ibv_wc> wcs;
  ASSERT_EQ(PollCompletions(p_.a->cq(), n, &wcs), n);
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(wcs[i].wr_id, static_cast<uint64_t>(i));
    const ibv_wc_status want = i < bad_at    ? IBV_WC_SUCCESS
                               : i == bad_at ? IBV_WC_REM_ACCESS_ERR
                                             : IBV_WC_WR_FLUSH_ERR;
    EXPECT_EQ(wcs[i].status, want)
        << "WR " << i << ": " << StatusName(wcs[i].status);
  }
  EXPECT_EQ(memcmp(remote->data(), src->data(), bad_at * len), 0);
  EXPECT_EQ(FirstNotEqual(remote->data() + bad_at * len, (n - bad_at) * len, 0),
            -1);
  EXPECT_EQ(QpState(p_.a->qp()), IBV_QPS_ERR);
}

// A key deregistered between two posts is refused on the next one, also
// where the data path had acquired it for an earlier batch.
TEST_P(OpsTest, DeregisteredKeyIsRefusedOnTheNextPost) {
  ASSERT_REG(auto* src, p_.a->Reg(4096));
  ASSERT_REG(auto* remote, p_.b->Reg(4096));
  ASSERT_TRUE(RdmaAndPoll(p_, IBV_WR_RDMA_WRITE, 1, src, 64, remote->addr(),
                          remote->rkey()));
  const uint32_t stale = remote->rkey();
  const uint64_t addr = remote->addr();
  ASSERT_EQ(remote->Deregister(), 0);
  // A new registration may take the freed slot; its key must differ.
  ASSERT_REG(auto* again, p_.b->Reg(4096));
  EXPECT_NE(again->rkey(), stale);
  EXPECT_TRUE(RdmaAndPoll(p_, IBV_WR_RDMA_WRITE, 2, src, 64, addr, stale,
                          IBV_WC_REM_ACCESS_ERR));
}

class SmallSqOpsTest : public OpsTest {
 protected:
  EndpointOptions Options() override {
    EndpointOptions o;
    o.max_send_wr = 16;
    return o;
  }
};

TEST_P(SmallSqOpsTest, OnlySignaledWrsCompleteAndFreeUnsignaledSlots) {
  const uint32_t s = p_.a->cap().max_send_wr;
  ASSERT_GE(s, 16u);
  ASSERT_REG(auto* src, p_.a->Reg(s * 64));
  ASSERT_REG(auto* dst, p_.b->Reg(s * 64));
  // Each round fills the whole SQ: s-1 unsignaled WRs and one signaled.
  // Without freeing the unsignaled slots at the signaled completion, the
  // second round would hit ENOMEM.
  const int rounds = std::max<int>(3, 2048 / static_cast<int>(s));
  for (int r = 0; r < rounds; ++r) {
    SCOPED_TRACE("round " + std::to_string(r));
    for (uint32_t i = 0; i < s; ++i) {
      FillPattern(src->data() + i * 64, 64, r * 100000 + i);
      const bool signaled = i == s - 1;
      ASSERT_EQ(PostRdma(p_.a->qp(), IBV_WR_RDMA_WRITE, r * 100000 + i, src,
                         i * 64, 64, dst->addr(i * 64), dst->rkey(), signaled),
                0)
          << "WR " << i;
    }
    ASSERT_TRUE(PollExpect(p_.a->cq(), r * 100000 + s - 1, IBV_WC_SUCCESS));
    for (uint32_t i = 0; i < s; ++i) {
      ASSERT_EQ(FirstPatternMismatch(dst->data() + i * 64, 64, r * 100000 + i),
                -1)
          << "WR " << i;
    }
  }
  EXPECT_TRUE(CqStaysEmpty(p_.a->cq())) << "unsignaled WR completed";
}

TEST_P(OpsTest, SqSigAllSignalsEveryWr) {
  EndpointOptions eo;
  eo.sq_sig_all = true;
  Pair p;
  ASSERT_NO_FATAL_FAILURE(
      MakePair(GetParam().first, GetParam().second, &p, eo));
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* dst, p.b->Reg(64));
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, i, src, 0, 64, dst->addr(),
                       dst->rkey(), /*signaled=*/false),
              0);
  }
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(PollExpect(p.a->cq(), i, IBV_WC_SUCCESS));
  }
}

TEST_P(OpsTest, CompletionsArriveInPostingOrder) {
  const int n = 60;
  ASSERT_REG(auto* src, p_.a->Reg(n * 256));
  ASSERT_REG(auto* remote, p_.b->Reg(n * 256));
  ASSERT_REG(auto* local, p_.a->Reg(n * 256));
  ASSERT_REG(auto* rbuf, p_.b->Reg(n * 256));
  FillPattern(src->data(), n * 256, 70);
  FillPattern(remote->data(), n * 256, 71);
  std::vector<uint8_t> remote_before(remote->data(), remote->data() + n * 256);
  int recvs = 0;
  for (int i = 0; i < n; ++i) {
    if (i % 3 == 1) {
      ASSERT_EQ(PostRecvBuf(p_.b->qp(), i, rbuf, i * 256, 256), 0);
      ++recvs;
    }
  }
  std::vector<ibv_wc_opcode> want_op;
  for (int i = 0; i < n; ++i) {
    const size_t off = i * 256;
    int rc;
    if (i % 3 == 0) {
      rc = PostRdma(p_.a->qp(), IBV_WR_RDMA_WRITE, i, src, off, 256,
                    remote->addr(off), remote->rkey());
      want_op.push_back(IBV_WC_RDMA_WRITE);
    } else if (i % 3 == 1) {
      rc = PostSendMsg(p_.a->qp(), i, src, off, 256);
      want_op.push_back(IBV_WC_SEND);
    } else {
      rc = PostRdma(p_.a->qp(), IBV_WR_RDMA_READ, i, local, off, 256,
                    remote->addr(off), remote->rkey());
      want_op.push_back(IBV_WC_RDMA_READ);
    }
    ASSERT_EQ(rc, 0) << "WR " << i;
  }
  std::vector<ibv_wc> wcs;
  ASSERT_EQ(PollCompletions(p_.a->cq(), n, &wcs), n);
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(wcs[i].wr_id, static_cast<uint64_t>(i));
    EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS) << StatusName(wcs[i].status);
    EXPECT_EQ(wcs[i].opcode, want_op[i]) << "WR " << i;
  }
  std::vector<ibv_wc> rwcs;
  ASSERT_EQ(PollCompletions(p_.b->cq(), recvs, &rwcs), recvs);
  for (int k = 0; k < recvs; ++k) {
    EXPECT_EQ(rwcs[k].wr_id, static_cast<uint64_t>(3 * k + 1));
  }
  for (int i = 0; i < n; ++i) {
    const size_t off = i * 256;
    if (i % 3 == 0) {
      EXPECT_EQ(memcmp(remote->data() + off, src->data() + off, 256), 0);
    } else if (i % 3 == 1) {
      EXPECT_EQ(memcmp(rbuf->data() + off, src->data() + off, 256), 0);
    } else {
      EXPECT_EQ(memcmp(local->data() + off, remote_before.data() + off, 256),
                0);
    }
  }
}

// Every operation runs on one device (loopback) and across the two.
const std::pair<int, int> kDevicePairs[] = {{0, 0}, {0, 1}};

std::string DevicePairName(
    const ::testing::TestParamInfo<std::pair<int, int>>& info) {
  return info.param.first == info.param.second ? "SameDevice" : "CrossDevice";
}

INSTANTIATE_TEST_SUITE_P(Devices, OpsTest, ::testing::ValuesIn(kDevicePairs),
                         DevicePairName);
INSTANTIATE_TEST_SUITE_P(Devices, SmallSqOpsTest,
                         ::testing::ValuesIn(kDevicePairs), DevicePairName);

// ===========================================================================
// Queue depths and RNR.

TEST_F(SoftrnicTest, SendQueueDepthIsEnforced) {
  EndpointOptions eo;
  eo.max_send_wr = 8;
  ConnectOptions co;
  // The first SEND finds no receive and is retried (forever, rnr_retry 7)
  // every 491 ms, so every WR stays outstanding until receives are posted.
  co.rnr_retry = 7;
  co.min_rnr_timer = 31;
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p, eo, co));
  const uint32_t s = p.a->cap().max_send_wr;
  ASSERT_GE(s, 8u);
  ASSERT_LE(s, p.b->cap().max_recv_wr) << "test needs a receive per send";
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* rbuf, p.b->Reg(64 * s));
  for (uint32_t i = 0; i + 1 < s; ++i) {
    ASSERT_EQ(PostSendMsg(p.a->qp(), i, src, 0, 8), 0) << "WR " << i;
  }
  // A chain of two: the first takes the last slot, the second overflows.
  ibv_sge sge = src->Sge(0, 8);
  ibv_send_wr w2 = SignaledWr(1000, IBV_WR_SEND, &sge);
  ibv_send_wr w1 = w2;
  w1.wr_id = s - 1;
  w1.next = &w2;
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_send(p.a->qp(), &w1, &bad), ENOMEM);
  EXPECT_EQ(bad, &w2);
  // Still full.
  w2.next = nullptr;
  bad = nullptr;
  EXPECT_EQ(ibv_post_send(p.a->qp(), &w2, &bad), ENOMEM);
  EXPECT_EQ(bad, &w2);

  for (uint32_t i = 0; i < s; ++i) {
    ASSERT_EQ(PostRecvBuf(p.b->qp(), i, rbuf, i * 64, 64), 0);
  }
  for (uint32_t i = 0; i < s; ++i) {
    ASSERT_TRUE(PollExpect(p.a->cq(), i, IBV_WC_SUCCESS));
  }
  // Slots are free again.
  ASSERT_EQ(PostRecvBuf(p.b->qp(), 2000, rbuf, 0, 64), 0);
  EXPECT_EQ(PostSendMsg(p.a->qp(), 2001, src, 0, 8), 0);
  EXPECT_TRUE(PollExpect(p.a->cq(), 2001, IBV_WC_SUCCESS));
}

TEST_F(SoftrnicTest, ReceiveQueueDepthIsEnforced) {
  EndpointOptions eo;
  eo.max_recv_wr = 8;
  Endpoint* a = NewEndpoint(0, eo);
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(ModifyToInit(a->qp(), {}), 0);
  const uint32_t r = a->cap().max_recv_wr;
  ASSERT_GE(r, 8u);
  ASSERT_LE(r, 256u) << "the CQ holds 256 flush completions";
  ASSERT_REG(auto* buf, a->Reg(64));
  for (uint32_t i = 0; i + 1 < r; ++i) {
    ASSERT_EQ(PostRecvBuf(a->qp(), i, buf, 0, 64), 0) << "WR " << i;
  }
  ibv_sge sge = buf->Sge(0, 64);
  ibv_recv_wr w2 = RecvWr(1000, &sge);
  ibv_recv_wr w1 = w2;
  w1.wr_id = r - 1;
  w1.next = &w2;
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_recv(a->qp(), &w1, &bad), ENOMEM);
  EXPECT_EQ(bad, &w2);
  // Exactly r receives were queued: the flush shows them.
  ASSERT_EQ(ModifyToState(a->qp(), IBV_QPS_ERR), 0);
  for (uint32_t i = 0; i < r; ++i) {
    EXPECT_TRUE(PollExpect(a->cq(), i, IBV_WC_WR_FLUSH_ERR));
  }
  EXPECT_TRUE(CqStaysEmpty(a->cq()));
}

TEST_F(SoftrnicTest, SendWithoutReceiveEndsInRnrRetryExceeded) {
  ConnectOptions co;
  co.rnr_retry = 1;
  co.min_rnr_timer = 1;  // 0.01 ms.
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p, {}, co));
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_EQ(PostSendMsg(p.a->qp(), 1, src, 0, 64), 0);
  ASSERT_EQ(PostSendMsg(p.a->qp(), 2, src, 0, 64), 0);
  EXPECT_TRUE(PollExpect(p.a->cq(), 1, IBV_WC_RNR_RETRY_EXC_ERR));
  EXPECT_TRUE(PollExpect(p.a->cq(), 2, IBV_WC_WR_FLUSH_ERR));
  EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_ERR);
}

TEST_F(SoftrnicTest, ReceivePostedDuringRnrWindowLetsSendSucceed) {
  ConnectOptions co;
  co.rnr_retry = 6;
  co.min_rnr_timer = 26;  // 81.92 ms: about 500 ms of retries in all.
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p, {}, co));
  ASSERT_REG(auto* src, p.a->Reg(256));
  ASSERT_REG(auto* rbuf, p.b->Reg(256));
  FillPattern(src->data(), 256, 80);
  ASSERT_EQ(PostSendMsg(p.a->qp(), 1, src, 0, 256), 0);
  // With no receive the SEND cannot complete, neither successfully nor by
  // running out of RNR retries (which takes about 570 ms here).
  EXPECT_TRUE(CqStaysEmpty(p.a->cq(), 150));
  ASSERT_EQ(PostRecvBuf(p.b->qp(), 2, rbuf, 0, 256), 0);
  EXPECT_TRUE(PollExpect(p.a->cq(), 1, IBV_WC_SUCCESS));
  ibv_wc wc = {};
  ASSERT_TRUE(PollExpect(p.b->cq(), 2, IBV_WC_SUCCESS, &wc));
  EXPECT_EQ(wc.byte_len, 256u);
  EXPECT_EQ(FirstPatternMismatch(rbuf->data(), 256, 80), -1);
}

TEST_F(SoftrnicTest, SendLongerThanReceiveBufferFailsBothSides) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  ASSERT_REG(auto* src, p.a->Reg(1024));
  ASSERT_REG(auto* rbuf, p.b->Reg(1024));
  ASSERT_EQ(PostRecvBuf(p.b->qp(), 1, rbuf, 0, 100), 0);
  ASSERT_EQ(PostSendMsg(p.a->qp(), 2, src, 0, 1024), 0);
  EXPECT_TRUE(PollExpect(p.b->cq(), 1, IBV_WC_LOC_LEN_ERR));
  EXPECT_TRUE(PollExpect(p.a->cq(), 2, IBV_WC_REM_INV_REQ_ERR));
}

// ===========================================================================
// Fault injection.

TEST_F(SoftrnicTest, LinkDownFailsOnlyThatDevicesQps) {
  ConnectOptions co;
  co.timeout = 10;  // ~4 ms.
  co.retry_cnt = 3;
  Pair p00, p11;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 0, &p00, {}, co));
  ASSERT_NO_FATAL_FAILURE(MakePair(1, 1, &p11, {}, co));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(p00, 4096, 1));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(p11, 4096, 2));

  ASSERT_NO_FATAL_FAILURE(SetLink(1, false));
  ibv_async_event ev = {};
  EXPECT_TRUE(WaitAsyncEvent(ctx(1), IBV_EVENT_PORT_ERR, &ev, 5000));
  ASSERT_REG(auto* src, p11.a->Reg(4096));
  ASSERT_REG(auto* dst, p11.b->Reg(4096));
  EXPECT_TRUE(RdmaAndPoll(p11, IBV_WR_RDMA_WRITE, 3, src, 4096, dst->addr(),
                          dst->rkey(), IBV_WC_RETRY_EXC_ERR));
  // softrnic0 keeps working, several times over.
  for (uint32_t i = 0; i < 5; ++i) {
    ASSERT_NO_FATAL_FAILURE(WriteAndCheck(p00, 65536, 10 + i));
  }
  EXPECT_FALSE(WaitAsyncEvent(ctx(0), IBV_EVENT_PORT_ERR, &ev, 50));

  ASSERT_NO_FATAL_FAILURE(SetLink(1, true));
  EXPECT_TRUE(WaitAsyncEvent(ctx(1), IBV_EVENT_PORT_ACTIVE, &ev, 5000));
  // New QPs on softrnic1 work again.
  Pair fresh;
  ASSERT_NO_FATAL_FAILURE(MakePair(1, 1, &fresh, {}, co));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(fresh, 4096, 20));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(p00, 4096, 21));
}

// A vanished peer (here: its port down, on either side) ends a request in
// IBV_WC_RETRY_EXC_ERR within a time derived from timeout and retry_cnt:
// (1 + 3) tries of ~4 ms. The bound allows for a loaded 2-core machine.
TEST_F(SoftrnicTest, LinkDownGivesRetryExceededWithinBoundedTime) {
  for (int down : {1, 0}) {
    SCOPED_TRACE(std::string("link down on ") + kDevName[down]);
    ConnectOptions co;
    co.timeout = 10;
    co.retry_cnt = 3;
    Pair p;
    ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p, {}, co));
    ASSERT_NO_FATAL_FAILURE(WriteAndCheck(p, 1024, 30));
    ASSERT_REG(auto* src, p.a->Reg(1024));
    ASSERT_REG(auto* dst, p.b->Reg(1024));
    ASSERT_NO_FATAL_FAILURE(SetLink(down, false));
    const auto start = Clock::now();
    ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, 1, src, 0, 1024,
                       dst->addr(), dst->rkey()),
              0);
    ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, 2, src, 0, 1024,
                       dst->addr(), dst->rkey()),
              0);
    EXPECT_TRUE(PollExpect(p.a->cq(), 1, IBV_WC_RETRY_EXC_ERR));
    const int64_t ms = MsSince(start);
    EXPECT_LT(ms, 3000) << "retry exhaustion took " << ms << " ms";
    EXPECT_TRUE(PollExpect(p.a->cq(), 2, IBV_WC_WR_FLUSH_ERR));
    EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_ERR);
    ASSERT_NO_FATAL_FAILURE(SetLink(down, true));
  }
}

// CutConnections closes every TCP connection of a device, mid-transfer:
// each WR must still complete (after reconnecting and retransmitting) or
// fail cleanly with RETRY_EXC_ERR; data of successful WRs is intact and
// never delivered twice. QPs of one process exchange data without a TCP
// connection, so here the cuts must not disturb them at all; the
// two-process test cuts real connections.
TEST_F(SoftrnicTest, CutConnectionsTransfersCompleteOrFailCleanly) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  const uint32_t len = 1 << 20;
  ASSERT_REG(auto* src, p.a->Reg(len));
  ASSERT_REG(auto* dst, p.b->Reg(len));
  ASSERT_REG(auto* rbuf, p.b->Reg(20 * 4096));
  int ok = 0;
  bool failed = false;
  for (uint32_t i = 0; i < 20 && !failed; ++i) {
    SCOPED_TRACE("iteration " + std::to_string(i));
    FillPattern(src->data(), len, 200 + i);
    ASSERT_EQ(PostRecvBuf(p.b->qp(), 500 + i, rbuf, i * 4096, 4096), 0);
    ASSERT_EQ(PostRdma(p.a->qp(), IBV_WR_RDMA_WRITE, i, src, 0, len,
                       dst->addr(), dst->rkey()),
              0);
    ASSERT_EQ(PostSendMsg(p.a->qp(), 1000 + i, src, 0, 4096), 0);
    ASSERT_EQ(softrnic::CutConnections(kDevName[i % 2]), 0);
    std::vector<ibv_wc> wcs;
    ASSERT_EQ(PollCompletions(p.a->cq(), 2, &wcs), 2) << "transfer hung";
    EXPECT_EQ(wcs[0].wr_id, i);
    EXPECT_EQ(wcs[1].wr_id, 1000 + i);
    if (wcs[0].status == IBV_WC_SUCCESS) {
      EXPECT_EQ(FirstPatternMismatch(dst->data(), len, 200 + i), -1);
    }
    if (wcs[1].status == IBV_WC_SUCCESS) {
      ++ok;
      ibv_wc rwc = {};
      ASSERT_TRUE(PollExpect(p.b->cq(), 500 + i, IBV_WC_SUCCESS, &rwc));
      EXPECT_EQ(FirstPatternMismatch(rbuf->data() + i * 4096, 4096, 200 + i),
                -1);
    }
    if (wcs[0].status != IBV_WC_SUCCESS || wcs[1].status != IBV_WC_SUCCESS) {
      // Failing cleanly: the first error is a transport retry error, the
      // QP is in ERR, and nothing else is pending.
      failed = true;
      EXPECT_TRUE(wcs[0].status == IBV_WC_RETRY_EXC_ERR ||
                  wcs[1].status == IBV_WC_RETRY_EXC_ERR)
          << StatusName(wcs[0].status) << " / " << StatusName(wcs[1].status);
      EXPECT_EQ(QpState(p.a->qp()), IBV_QPS_ERR);
    }
  }
  if (!failed) {
    // A retransmitted SEND must not consume a second receive.
    EXPECT_TRUE(CqStaysEmpty(p.b->cq())) << "duplicate delivery";
  }
  EXPECT_EQ(ok, 20) << "a cut disturbed QPs that share no connection";
  // Fresh QPs on both devices work after the cuts.
  Pair fresh;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &fresh));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(fresh, 65536, 300));
}

TEST_F(SoftrnicTest, SetDelayUsAddsLatency) {
  ConnectOptions co;
  co.timeout = 18;  // ~1 s: the delay must not look like a lost frame.
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p, {}, co));
  ASSERT_REG(auto* src, p.a->Reg(64));
  ASSERT_REG(auto* dst, p.b->Reg(64));
  auto one_write_us = [&](uint64_t id) -> int64_t {
    const auto start = Clock::now();
    if (!RdmaAndPoll(p, IBV_WR_RDMA_WRITE, id, src, 64, dst->addr(),
                     dst->rkey())) {
      return -1;
    }
    return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() -
                                                                 start)
        .count();
  };
  std::vector<int64_t> base;
  for (int i = 0; i < 10; ++i) base.push_back(one_write_us(i));
  std::sort(base.begin(), base.end());
  ASSERT_GE(base[0], 0);
  const uint32_t delay_us = 30000;
  ASSERT_NO_FATAL_FAILURE(SetDelay(0, delay_us));
  for (int i = 0; i < 5; ++i) {
    int64_t us = one_write_us(100 + i);
    ASSERT_GE(us, 0);
    EXPECT_GE(us, delay_us * 9 / 10) << "write " << i << " took " << us
                                     << " us; baseline median " << base[5];
  }
  ASSERT_NO_FATAL_FAILURE(SetDelay(0, 0));
  std::vector<int64_t> after;
  for (int i = 0; i < 10; ++i) after.push_back(one_write_us(200 + i));
  std::sort(after.begin(), after.end());
  ASSERT_GE(after[0], 0);
  EXPECT_LT(after[5], delay_us / 2) << "delay not removed";
  errno = 0;
  EXPECT_EQ(softrnic::SetDelayUs("nosuchdev", 1), -1);
  EXPECT_EQ(errno, ENODEV);
}

// ===========================================================================
// Deregistration while a peer holds the MR.

// A peer that announces a large RDMA WRITE, sends part of it and then
// stalls holds the target MR in an access in progress. ibv_dereg_mr must
// still return within its bound (it aborts the access and breaks that
// connection), and nothing the peer sends afterwards reaches the memory.
TEST_F(SoftrnicTest, DeregMrReturnsWhileAStalledPeerWritesIntoIt) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(1, 0, &p));  // Responder on softrnic0.
  const uint32_t len = 1 << 20;
  ASSERT_REG(auto* dst, p.b->Reg(len));
  const std::string ip = GidIpv4(p.b->gid());
  const uint16_t port = GidPort(p.b->gid());
  std::string err;
  // From the peer QP's address: a connected QP takes HELLOs from there only.
  const int fd = ConnectFrom(GidIpv4(p.a->gid()), ip, port, &err);
  ASSERT_GE(fd, 0) << err;
  auto send_all = [fd](const std::vector<uint8_t>& v) {
    return send(fd, v.data(), v.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(v.size());
  };
  ASSERT_TRUE(
      send_all(Header(1, /*HELLO*/ 1, p.b->qpn(), 0, 0, 0, p.a->qpn())));
  uint8_t ack[40];
  pollfd pfd = {fd, POLLIN, 0};
  ASSERT_EQ(poll(&pfd, 1, kDefaultTimeoutMs), 1) << "no HELLO_ACK";
  ASSERT_EQ(recv(fd, ack, sizeof(ack), MSG_WAITALL), 40);
  ASSERT_EQ(ack[5], 2) << "not a HELLO_ACK";
  std::vector<uint8_t> write =
      Header(1, /*WRITE*/ 12, p.b->qpn(), len, dst->rkey(), dst->addr(), 0);
  std::vector<uint8_t> part(4096);
  FillPattern(part.data(), part.size(), 5);
  write.insert(write.end(), part.begin(), part.end());
  ASSERT_TRUE(send_all(write));
  // Wait until the responder is inside the WRITE (its first bytes landed).
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (FirstPatternMismatch(dst->data(), part.size(), 5) != -1 &&
         Clock::now() < deadline) {
    usleep(1000);
  }
  ASSERT_EQ(FirstPatternMismatch(dst->data(), part.size(), 5), -1)
      << "the WRITE's first bytes never arrived";

  struct Dereg {
    std::promise<int> done;
  };
  auto* d = new Dereg();  // Leaked if the thread never returns.
  std::future<int> fut = d->done.get_future();
  ibv_mr* mr = dst->mr();
  const auto start = Clock::now();
  std::thread([d, mr] { d->done.set_value(ibv_dereg_mr(mr)); }).detach();
  if (fut.wait_for(std::chrono::seconds(2)) != std::future_status::ready) {
    close(fd);  // Lets the responder go, so the dereg can end.
    if (fut.wait_for(std::chrono::milliseconds(kDefaultTimeoutMs)) !=
        std::future_status::ready) {
      leak_ = true;
    }
    FAIL() << "ibv_dereg_mr did not return within 2 s while a stalled peer "
              "held the MR";
  }
  const int64_t ms = MsSince(start);
  ASSERT_EQ(fut.get(), 0);
  delete d;
  EXPECT_LT(ms, 1000) << "ibv_dereg_mr took " << ms << " ms";
  // The rest of the WRITE must not reach the memory any more.
  std::vector<uint8_t> snapshot(dst->data(), dst->data() + len);
  std::vector<uint8_t> rest(64 * 1024, 0xee);
  send(fd, rest.data(), rest.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  EXPECT_TRUE(ClosedByPeer(fd, kDefaultTimeoutMs))
      << "the aborted connection stays open";
  close(fd);
  EXPECT_EQ(memcmp(dst->data(), snapshot.data(), len), 0)
      << "memory changed after ibv_dereg_mr returned";
  // The device still serves its other QPs.
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(p, 4096, 6));
}

// ===========================================================================
// Wire robustness.

TEST_F(SoftrnicTest, GarbageOnListenerDisturbsNoQp) {
  Pair same, cross;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 0, &same));
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &cross));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(same, 4096, 1));
  ASSERT_NO_FATAL_FAILURE(WriteAndCheck(cross, 4096, 2));

  for (int d = 0; d < 2; ++d) {
    SCOPED_TRACE(kDevName[d]);
    ibv_gid gid = {};
    ASSERT_EQ(ibv_query_gid(ctx(d), 1, 0, &gid), 0);
    const std::string ip = GidIpv4(gid);
    const uint16_t port = GidPort(gid);
    ASSERT_NE(port, 0) << "GID bytes 8..9 carry no listener port: "
                       << GidToHex(gid);
    const uint32_t victim = d == 0 ? same.b->qpn() : cross.b->qpn();

    // A connection that sends half a header and then stalls must not
    // block the listener for everyone else.
    int stalled = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(stalled, 0);
    sockaddr_in sa = {};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    inet_pton(AF_INET, ip.c_str(), &sa.sin_addr);
    ASSERT_EQ(connect(stalled, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0)
        << strerror(errno);
    ASSERT_EQ(send(stalled, "SRNC\x01", 5, MSG_NOSIGNAL), 5);

    std::vector<std::vector<uint8_t>> inputs;
    inputs.push_back({});      // Connect and close.
    inputs.push_back({0x00});  // One byte.
    inputs.push_back(std::vector<uint8_t>(40, 0xff));
    inputs.push_back(Header(1, 1, 0, 0, 0, 0, 0));  // HELLO, bad qpn.
    inputs.push_back(Header(1, 1, 0xfffff0, 0, 0, 0, 7));
    inputs.push_back(Header(99, 1, victim, 0, 0, 0, 7));    // Bad version.
    inputs.push_back(Header(1, 0xee, victim, 0, 0, 0, 7));  // Bad type.
    inputs.push_back(Header(1, 10, victim, 0xffffffffu, 0, 0, 0));
    inputs.push_back(Header(1, 12, victim, 0x7fffffff, 0, 0, 0));
    auto trunc = Header(1, 10, victim, 16, 0, 0, 0);
    trunc.resize(23);
    inputs.push_back(trunc);
    // A SEND for an existing QP on a connection that never said HELLO.
    auto send_frame = Header(1, 10, victim, 16, 0, 0, 0);
    send_frame.resize(send_frame.size() + 16, 0xab);
    inputs.push_back(send_frame);
    // Random bytes of random lengths, also behind a valid magic.
    uint32_t x = 12345 + d;
    for (int i = 0; i < 40; ++i) {
      x = x * 1103515245 + 12345;
      std::vector<uint8_t> junk((x >> 8) % 70000 + 1);
      FillPattern(junk.data(), junk.size(), x);
      if (i % 2 == 1 && junk.size() > 4) {
        memcpy(junk.data(), "SRNC", 4);
        if (junk.size() > 5) junk[4] = 1;
      }
      inputs.push_back(std::move(junk));
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      SendToListener(ip, port, inputs[i], /*linger_open=*/i % 3 == 0);
    }

    // Existing QPs are undisturbed: writes, and SENDs that land in the
    // expected receive (the stray SEND above consumed none).
    for (Pair* p : {&same, &cross}) {
      ASSERT_NO_FATAL_FAILURE(WriteAndCheck(*p, 65536, 40 + d));
      ASSERT_REG(auto* src, p->a->Reg(64));
      ASSERT_REG(auto* rbuf, p->b->Reg(64));
      FillPattern(src->data(), 64, 50 + d);
      ASSERT_EQ(PostRecvBuf(p->b->qp(), 60 + d, rbuf, 0, 64), 0);
      ASSERT_EQ(PostSendMsg(p->a->qp(), 61 + d, src, 0, 64), 0);
      ASSERT_TRUE(PollExpect(p->a->cq(), 61 + d, IBV_WC_SUCCESS));
      ibv_wc wc = {};
      ASSERT_TRUE(PollExpect(p->b->cq(), 60 + d, IBV_WC_SUCCESS, &wc));
      EXPECT_EQ(wc.byte_len, 64u);
      EXPECT_EQ(FirstPatternMismatch(rbuf->data(), 64, 50 + d), -1);
      EXPECT_EQ(QpState(p->b->qp()), IBV_QPS_RTS);
    }
    // New connections are accepted while the stalled one stays open.
    Pair fresh;
    ASSERT_NO_FATAL_FAILURE(MakePair(1 - d, d, &fresh));
    ASSERT_NO_FATAL_FAILURE(WriteAndCheck(fresh, 4096, 45 + d));
    close(stalled);
  }
}

// ===========================================================================
// dma-buf MRs: GPUDirect RDMA into device memory softgpu exports.

// A dma-buf as softgpu exports one (gpu/softgpu/dmabuf.h): a memory file
// named "softgpu-...", positioned at the exported range's first byte.
int SoftgpuStyleDmabuf(const char* name, size_t size, off_t position) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      lseek(fd, position, SEEK_SET) != position) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST_F(SoftrnicTest, DmabufMrTakesRdmaWriteAndReadAtItsIova) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // The exported range starts a page into the file; the MR 100 bytes into
  // the range, so that both offsets are exercised.
  int fd = SoftgpuStyleDmabuf("softgpu-dev0-test", 4 * page, page);
  ASSERT_GE(fd, 0) << strerror(errno);
  constexpr uint64_t kOffset = 100;
  constexpr uint32_t kLen = 8000;
  constexpr uint64_t kIova = 0x7f1234560000ull + kOffset;
  ibv_mr* mr =
      ibv_reg_dmabuf_mr(p.b->pd(), kOffset, kLen, kIova, fd, kFullAccess);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  EXPECT_EQ(mr->addr, reinterpret_cast<void*>(kOffset));  // as rdma-core
  EXPECT_EQ(mr->length, kLen);
  close(fd);  // The MR keeps the memory, as a dma-buf attachment does.

  ASSERT_REG(auto* src, p.a->Reg(kLen));
  ASSERT_REG(auto* back, p.a->Reg(kLen));
  FillPattern(src->data(), kLen, 41);
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 1, src, kLen, kIova, mr->rkey));
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_READ, 2, back, kLen, kIova, mr->rkey));
  EXPECT_EQ(FirstPatternMismatch(back->data(), kLen, 41), -1);
  // One byte past the MR: refused.
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 3, src, 1, kIova + kLen,
                          mr->rkey, IBV_WC_REM_ACCESS_ERR));
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
}

TEST_F(SoftrnicTest, DmabufMrBytesLandInTheExportersMemory) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  int fd = SoftgpuStyleDmabuf("softgpu-dev1-test", 3 * page, page);
  ASSERT_GE(fd, 0) << strerror(errno);
  ibv_mr* mr = ibv_reg_dmabuf_mr(p.b->pd(), 0, page, 0x1000, fd, kFullAccess);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  ASSERT_REG(auto* src, p.a->Reg(page));
  FillPattern(src->data(), page, 7);
  ASSERT_TRUE(
      RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 1, src, page, 0x1000, mr->rkey));
  // The exporter's view: the file's second page (the range), not its first.
  std::vector<uint8_t> file(page);
  ASSERT_EQ(pread(fd, file.data(), page, static_cast<off_t>(page)),
            static_cast<ssize_t>(page));
  EXPECT_EQ(FirstPatternMismatch(file.data(), page, 7), -1);
  ASSERT_EQ(pread(fd, file.data(), page, 0), static_cast<ssize_t>(page));
  EXPECT_EQ(FirstNotEqual(file.data(), page, 0), -1);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  close(fd);
}

TEST_F(SoftrnicTest, DmabufMrKeepsAccessRights) {
  Pair p;
  ASSERT_NO_FATAL_FAILURE(MakePair(0, 1, &p));
  int fd = SoftgpuStyleDmabuf("softgpu-dev0-ro", 4096, 0);
  ASSERT_GE(fd, 0) << strerror(errno);
  ibv_mr* mr =
      ibv_reg_dmabuf_mr(p.b->pd(), 0, 4096, 0x2000, fd,
                        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  ASSERT_REG(auto* src, p.a->Reg(4096));
  FillPattern(src->data(), 4096, 9);
  ASSERT_TRUE(RdmaAndPoll(p, IBV_WR_RDMA_WRITE, 1, src, 4096, 0x2000, mr->rkey,
                          IBV_WC_REM_ACCESS_ERR));
  std::vector<uint8_t> file(4096);
  ASSERT_EQ(pread(fd, file.data(), 4096, 0), 4096);
  EXPECT_EQ(FirstNotEqual(file.data(), 4096, 0), -1);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  close(fd);
}

TEST_F(SoftrnicTest, DmabufMrRefusesWhatIsNoDmabufOrLiesPastItsEnd) {
  ibv_pd* pd = ibv_alloc_pd(ctx(0));
  ASSERT_NE(pd, nullptr);
  // A memory file of someone else's: not a dma-buf softrnic can import.
  int other = memfd_create("not-a-dmabuf", MFD_CLOEXEC);
  ASSERT_GE(other, 0);
  ASSERT_EQ(ftruncate(other, 4096), 0);
  errno = 0;
  EXPECT_EQ(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, other, kFullAccess), nullptr);
  EXPECT_EQ(errno, EINVAL);
  close(other);
  errno = 0;
  EXPECT_EQ(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, kFullAccess), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // Past the end of the exported range (which starts at the position).
  int fd = SoftgpuStyleDmabuf("softgpu-dev0-short", 8192, 4096);
  ASSERT_GE(fd, 0);
  errno = 0;
  EXPECT_EQ(ibv_reg_dmabuf_mr(pd, 1, 4096, 0, fd, kFullAccess), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_mr* mr = ibv_reg_dmabuf_mr(pd, 0, 4096, 0, fd, kFullAccess);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  close(fd);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

// FERRY_SOFTRNIC_PIN_PAGES=1 (conformance_pin_pages_test) makes a
// registration fault its pages in, as the kernel's pinning does: fresh
// memory is resident after ibv_reg_mr. Without it softrnic leaves memory
// as it is (tests register buffers they never touch).
TEST_F(SoftrnicTest, RegMrPinsPagesOnlyWhenAsked) {
  const char* env = std::getenv("FERRY_SOFTRNIC_PIN_PAGES");
  const bool pin = env != nullptr && std::string(env) == "1";
  ibv_pd* pd = ibv_alloc_pd(ctx(0));
  ASSERT_NE(pd, nullptr);
  constexpr size_t kLen = 4 << 20;
  void* mem = mmap(nullptr, kLen, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto resident = [&] {
    std::vector<unsigned char> v(kLen / 4096);
    EXPECT_EQ(mincore(mem, kLen, v.data()), 0);
    size_t n = 0;
    for (unsigned char c : v) n += c & 1;
    return n;
  };
  ASSERT_EQ(resident(), 0u);
  ibv_mr* mr = ibv_reg_mr(pd, mem, kLen, kFullAccess);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  EXPECT_EQ(resident(), pin ? kLen / 4096 : 0u);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  munmap(mem, kLen);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

// What the kernel cannot pin, ibv_reg_mr refuses with EFAULT: the
// nvidia-peermem path (ibv_reg_mr on a GPU address) without that module
// (softgpu's device memory is a PROT_NONE reservation), a hole in the
// range, and read-only memory under a writable access.
TEST_F(SoftrnicTest, RegMrOfWhatCannotBePinnedIsEfault) {
  ibv_pd* pd = ibv_alloc_pd(ctx(0));
  ASSERT_NE(pd, nullptr);
  const size_t kLen = 1 << 16;
  // Three pages' worth of regions: read-write, PROT_NONE, read-only.
  uint8_t* rw =
      static_cast<uint8_t*>(mmap(nullptr, 3 * kLen, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(rw, MAP_FAILED);
  uint8_t* none = rw + kLen;
  uint8_t* ro = rw + 2 * kLen;
  ASSERT_EQ(mprotect(none, kLen, PROT_NONE), 0);
  ASSERT_EQ(mprotect(ro, kLen, PROT_READ), 0);
  // (Strict page mode: privileged_test, which runs where frames show.)
  {
    auto expect_efault = [&](void* addr, size_t len, int access) {
      errno = 0;
      ibv_mr* mr = ibv_reg_mr(pd, addr, len, access);
      EXPECT_EQ(mr, nullptr);
      EXPECT_EQ(errno, EFAULT);
      if (mr != nullptr) ibv_dereg_mr(mr);
    };
    expect_efault(none, kLen, kFullAccess);
    expect_efault(none, kLen, 0);
    expect_efault(ro, kLen, kFullAccess);
    expect_efault(rw, 2 * kLen, 0);  // Runs into the PROT_NONE pages.
    // Read-only memory for reading only, and read-write memory: fine.
    ibv_mr* mr = ibv_reg_mr(pd, ro, kLen, IBV_ACCESS_REMOTE_READ);
    EXPECT_NE(mr, nullptr) << strerror(errno);
    if (mr != nullptr) EXPECT_EQ(ibv_dereg_mr(mr), 0);
    mr = ibv_reg_mr(pd, rw, kLen, kFullAccess);
    EXPECT_NE(mr, nullptr) << strerror(errno);
    if (mr != nullptr) EXPECT_EQ(ibv_dereg_mr(mr), 0);
  }
  // A hole: the middle region unmapped.
  ASSERT_EQ(munmap(none, kLen), 0);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd, rw, 3 * kLen, IBV_ACCESS_REMOTE_READ), nullptr);
  EXPECT_EQ(errno, EFAULT);
  munmap(rw, kLen);
  munmap(ro, kLen);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

}  // namespace
}  // namespace softrnic_test
