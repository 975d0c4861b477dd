#include "transport/softrnic/wire_verbs.h"

namespace softrnic {

FrameType RequestType(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
      return FrameType::kWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return FrameType::kWriteImm;
    case IBV_WR_RDMA_READ:
      return FrameType::kRead;
    case IBV_WR_SEND_WITH_IMM:
      return FrameType::kSendImm;
    default:
      return FrameType::kSend;
  }
}

ibv_wc_opcode WcOpcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    default:
      return IBV_WC_SEND;
  }
}

ibv_wc_status NakStatus(NakCode code) {
  return code == NakCode::kRemoteAccess     ? IBV_WC_REM_ACCESS_ERR
         : code == NakCode::kInvalidRequest ? IBV_WC_REM_INV_REQ_ERR
                                            : IBV_WC_REM_OP_ERR;
}

MsnOrder ClassifyMsn(uint32_t msn, uint32_t expected) {
  if (msn == expected) return MsnOrder::kExpected;
  return MsnBefore(msn, expected) ? MsnOrder::kDuplicate : MsnOrder::kGap;
}

}  // namespace softrnic
