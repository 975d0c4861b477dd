#include "transport/softrnic/wire_verbs.h"

#include "gtest/gtest.h"

namespace softrnic {
namespace {

TEST(SoftrnicWireVerbsTest, EachPostedOpcodeHasItsFrameAndCompletion) {
  EXPECT_EQ(RequestType(IBV_WR_RDMA_WRITE), FrameType::kWrite);
  EXPECT_EQ(RequestType(IBV_WR_RDMA_WRITE_WITH_IMM), FrameType::kWriteImm);
  EXPECT_EQ(RequestType(IBV_WR_RDMA_READ), FrameType::kRead);
  EXPECT_EQ(RequestType(IBV_WR_SEND), FrameType::kSend);
  EXPECT_EQ(RequestType(IBV_WR_SEND_WITH_IMM), FrameType::kSendImm);

  // A WRITE completes as a WRITE with or without its immediate, as a SEND
  // does.
  EXPECT_EQ(WcOpcode(IBV_WR_RDMA_WRITE), IBV_WC_RDMA_WRITE);
  EXPECT_EQ(WcOpcode(IBV_WR_RDMA_WRITE_WITH_IMM), IBV_WC_RDMA_WRITE);
  EXPECT_EQ(WcOpcode(IBV_WR_RDMA_READ), IBV_WC_RDMA_READ);
  EXPECT_EQ(WcOpcode(IBV_WR_SEND), IBV_WC_SEND);
  EXPECT_EQ(WcOpcode(IBV_WR_SEND_WITH_IMM), IBV_WC_SEND);
}

TEST(SoftrnicWireVerbsTest, NaksFailWithTheRemoteErrorTheyName) {
  EXPECT_EQ(NakStatus(NakCode::kRemoteAccess), IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(NakStatus(NakCode::kInvalidRequest), IBV_WC_REM_INV_REQ_ERR);
  EXPECT_EQ(NakStatus(NakCode::kRemoteOp), IBV_WC_REM_OP_ERR);
}

TEST(SoftrnicWireVerbsTest, MsnOrderWraps) {
  EXPECT_TRUE(MsnBefore(1, 2));
  EXPECT_FALSE(MsnBefore(2, 1));
  EXPECT_FALSE(MsnBefore(5, 5));
  // Across the wrap: 0xffffffff is just before 0.
  EXPECT_TRUE(MsnBefore(0xffffffffu, 0));
  EXPECT_FALSE(MsnBefore(0, 0xffffffffu));
  EXPECT_TRUE(MsnBefore(0x7ffffff0u, 0x80000010u));
}

TEST(SoftrnicWireVerbsTest, ResponderTellsRetransmissionsFromGaps) {
  EXPECT_EQ(ClassifyMsn(7, 7), MsnOrder::kExpected);
  EXPECT_EQ(ClassifyMsn(6, 7), MsnOrder::kDuplicate);
  EXPECT_EQ(ClassifyMsn(9, 7), MsnOrder::kGap);
  EXPECT_EQ(ClassifyMsn(0xfffffffeu, 1), MsnOrder::kDuplicate);
  EXPECT_EQ(ClassifyMsn(2, 0xfffffffeu), MsnOrder::kGap);
}

}  // namespace
}  // namespace softrnic
