// softrnic's "mlx5-ib" profile behaves as an InfiniBand port: a LID from the
// subnet manager, one GID (fe80::<port GUID>), peers addressed by DLID with
// no GRH; a DLID no port holds routes nowhere. Runs with
// --softrnic_profile=mlx5-ib and a subnet table of its own
// (softrnic_test_main puts it in TEST_TMPDIR).
#include <infiniband/verbs.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/softrnic/verbs_test_util.h"

namespace softrnic_test {
namespace {

class InfinibandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ctx_a_ = OpenDeviceByName("softrnic0", &error_);
    ctx_b_ = OpenDeviceByName("softrnic1", &error_);
    ASSERT_NE(ctx_a_, nullptr) << error_;
    ASSERT_NE(ctx_b_, nullptr) << error_;
    a_ = Endpoint::Create(ctx_a_, EndpointOptions(), &error_);
    ASSERT_NE(a_, nullptr) << error_;
    b_ = Endpoint::Create(ctx_b_, EndpointOptions(), &error_);
    ASSERT_NE(b_, nullptr) << error_;
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    if (ctx_a_ != nullptr) ibv_close_device(ctx_a_);
    if (ctx_b_ != nullptr) ibv_close_device(ctx_b_);
  }

  static ibv_port_attr Port(ibv_context* ctx) {
    ibv_port_attr p{};
    EXPECT_EQ(ibv_query_port(ctx, 1, &p), 0);
    return p;
  }

  // RTR by LID alone (is_global 0), as Ferry and perftest do within a
  // subnet.
  static int ToRtrByLid(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid,
                        const ConnectOptions& o) {
    ibv_qp_attr a = RtrAttr(dest_qpn, ibv_gid{}, o);
    a.ah_attr.is_global = 0;
    a.ah_attr.dlid = dlid;
    return ibv_modify_qp(qp, &a, kRtrMask);
  }
  static int ConnectByLid(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid,
                          const ConnectOptions& o) {
    if (int rc = ModifyToInit(qp, o)) return rc;
    if (int rc = ToRtrByLid(qp, dest_qpn, dlid, o)) return rc;
    return ModifyToRts(qp, o);
  }

  // A new QP on softrnic0 sent to `dlid`, whose peer, a new QP on
  // softrnic1, is connected back to it by its real LID: a WRITE must end
  // in IBV_WC_RETRY_EXC_ERR.
  void ExpectRoutesNowhere(uint16_t dlid) {
    std::string err;
    auto e = Endpoint::Create(ctx_a_, EndpointOptions(), &err);
    ASSERT_NE(e, nullptr) << err;
    auto p = Endpoint::Create(ctx_b_, EndpointOptions(), &err);
    ASSERT_NE(p, nullptr) << err;
    Endpoint* peer = p.get();
    ConnectOptions o;
    o.timeout = 8;  // 1 ms per try.
    o.retry_cnt = 1;
    ASSERT_EQ(ConnectByLid(peer->qp(), e->qpn(), Port(ctx_a_).lid, o), 0);
    ASSERT_EQ(ConnectByLid(e->qp(), peer->qpn(), dlid, o), 0);
    Buffer* src = e->Reg(4096);
    Buffer* dst = peer->Reg(4096);
    ASSERT_EQ(PostRdma(e->qp(), IBV_WR_RDMA_WRITE, 1, src, 0, 4096, dst->addr(),
                       dst->rkey()),
              0);
    std::vector<ibv_wc> wc;
    ASSERT_EQ(PollCompletions(e->cq(), 1, &wc), 1);
    EXPECT_EQ(wc[0].status, IBV_WC_RETRY_EXC_ERR)
        << ibv_wc_status_str(wc[0].status);
  }

  std::string error_;
  ibv_context* ctx_a_ = nullptr;
  ibv_context* ctx_b_ = nullptr;
  std::unique_ptr<Endpoint> a_, b_;
};

TEST_F(InfinibandTest, PortHasALidOfItsOwnAndAnIbGid) {
  const ibv_port_attr pa = Port(ctx_a_), pb = Port(ctx_b_);
  EXPECT_EQ(pa.link_layer, IBV_LINK_LAYER_INFINIBAND);
  EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);
  EXPECT_EQ(pa.active_mtu, IBV_MTU_4096);
  EXPECT_NE(pa.lid, 0);
  EXPECT_LT(pa.lid, 0xc000) << "a unicast LID";
  EXPECT_NE(pa.lid, pb.lid);
  EXPECT_NE(pa.sm_lid, 0) << "an ACTIVE IB port has a subnet manager";
  ibv_gid_entry e{};
  ASSERT_EQ(ibv_query_gid_ex(ctx_a_, 1, 0, &e, 0), 0);
  EXPECT_EQ(e.gid_type, IBV_GID_TYPE_IB);
  EXPECT_EQ(e.gid.raw[0], 0xfe);
  EXPECT_EQ(e.gid.raw[1], 0x80);
  ibv_device_attr d{};
  ASSERT_EQ(ibv_query_device(ctx_a_, &d), 0);
  EXPECT_EQ(std::memcmp(&e.gid.raw[8], &d.node_guid, 8), 0)
      << "GID = default subnet prefix + port GUID";
}

TEST_F(InfinibandTest, WriteAndReadByLidWithoutGrh) {
  const uint16_t lid_a = Port(ctx_a_).lid, lid_b = Port(ctx_b_).lid;
  ConnectOptions o;
  o.mtu = IBV_MTU_4096;
  ASSERT_EQ(ConnectByLid(a_->qp(), b_->qpn(), lid_b, o), 0);
  ASSERT_EQ(ConnectByLid(b_->qp(), a_->qpn(), lid_a, o), 0);
  ibv_qp_attr q{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(ibv_query_qp(a_->qp(), &q, IBV_QP_AV, &init), 0);
  EXPECT_EQ(q.ah_attr.is_global, 0);
  EXPECT_EQ(q.ah_attr.dlid, lid_b);

  constexpr size_t kLen = 256 << 10;
  Buffer* src = a_->Reg(kLen);
  Buffer* dst = b_->Reg(kLen);
  Buffer* back = a_->Reg(kLen);
  ASSERT_TRUE(src && dst && back);
  FillPattern(src->data(), kLen, 7);
  ASSERT_EQ(PostRdma(a_->qp(), IBV_WR_RDMA_WRITE, 1, src, 0, kLen, dst->addr(),
                     dst->rkey()),
            0);
  ASSERT_EQ(PostRdma(a_->qp(), IBV_WR_RDMA_READ, 2, back, 0, kLen, dst->addr(),
                     dst->rkey()),
            0);
  std::vector<ibv_wc> wc;
  ASSERT_EQ(PollCompletions(a_->cq(), 2, &wc), 2);
  for (const ibv_wc& w : wc) {
    EXPECT_EQ(w.status, IBV_WC_SUCCESS) << ibv_wc_status_str(w.status);
  }
  EXPECT_EQ(FirstPatternMismatch(dst->data(), kLen, 7), -1);
  EXPECT_EQ(FirstPatternMismatch(back->data(), kLen, 7), -1);
}

// A DLID that no port holds: the QP reaches RTS (the HCA cannot know), and
// its requests time out, as packets to an unassigned LID are dropped by the
// switch. The same for 0, what a RoCE-only set-up would put there.
TEST_F(InfinibandTest, UnassignedDlidRoutesNowhere) {
  for (uint16_t dlid : {uint16_t{0}, uint16_t{0xbffe}}) {
    SCOPED_TRACE(dlid);
    ExpectRoutesNowhere(dlid);
  }
}

// An entry that outlived its port (nobody holds it locked) is no route,
// even though it names a live listener: softrnic1's, where a QP waits for
// exactly this requester.
TEST_F(InfinibandTest, StaleLidEntryRoutesNowhere) {
  const char* dir = std::getenv("FERRY_SOFTRNIC_SUBNET");
  ASSERT_NE(dir, nullptr) << "softrnic_test_main sets it";
  constexpr uint16_t kStale = 0xbffd;
  const std::string live =
      std::string(dir) + "/" + std::to_string(Port(ctx_b_).lid);
  std::ifstream in(live);
  std::string line;
  ASSERT_TRUE(std::getline(in, line)) << live;
  std::ofstream(std::string(dir) + "/" + std::to_string(kStale))
      << line << "\n";
  ExpectRoutesNowhere(kStale);
}

}  // namespace
}  // namespace softrnic_test
