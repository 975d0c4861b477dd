// How the verbs a QP posts and completes map onto softrnic's wire protocol
// (wire.h): the frame a send work request travels as, the opcode its
// completion reports, the status a NAK fails it with, and the order of
// message sequence numbers, which wrap. Pure functions; thread-safe.
#ifndef FERRY_TRANSPORT_SOFTRNIC_WIRE_VERBS_H_
#define FERRY_TRANSPORT_SOFTRNIC_WIRE_VERBS_H_

#include <infiniband/verbs.h>

#include <cstdint>

#include "transport/softrnic/wire.h"

namespace softrnic {

// The request frame of a send work request (kSend for an opcode it does
// not name: posting accepts no other).
FrameType RequestType(ibv_wr_opcode op);

// The opcode a send work request's completion reports.
ibv_wc_opcode WcOpcode(ibv_wr_opcode op);

// The status of the completion a NAK with `code` fails its WQE with, for
// the NAKs that fail one: kRemoteAccess, kInvalidRequest and kRemoteOp
// (any other code also reads as a remote operation error).
ibv_wc_status NakStatus(NakCode code);

// Whether MSN `a` comes before MSN `b`. MSNs are 32-bit counters that wrap:
// `a` is before `b` when it is less than half the space behind it.
inline bool MsnBefore(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(a - b) < 0;
}

// Where a request's MSN stands against the MSN its responder expects next.
enum class MsnOrder {
  kExpected,
  kDuplicate,  // Before it: a retransmission of a request executed already.
  kGap,        // After it: requests in between were lost.
};
MsnOrder ClassifyMsn(uint32_t msn, uint32_t expected);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_WIRE_VERBS_H_
