// softrnic wire protocol: one TCP connection per (requester QP, responder
// QP) pair. The requester sends requests and receives responses on it; the
// responder answers in order. Every field is big-endian; a frame that fails
// validation closes its connection and nothing else.
//
// Frame header, 40 bytes, then `length` payload bytes for SEND/WRITE
// requests and READ responses:
//   u32 magic 'SRNC' | u8 version | u8 type | u16 flags
//   u32 qpn (destination QP) | u32 msn | u32 length | u32 rkey
//   u64 remote_addr | u32 imm (opaque) | u32 aux
// HELLO opens a connection: qpn = responder QP, aux = requester QP; its
// payload is empty, or, where the listener has a cluster token, the proof
// (hello_auth.h) answering the CHALLENGE the listener sent first.
// NAK: aux = reason (NakCode); for RNR, rkey carries the RNR timer code.
#ifndef FERRY_TRANSPORT_SOFTRNIC_WIRE_H_
#define FERRY_TRANSPORT_SOFTRNIC_WIRE_H_

#include <cstddef>
#include <cstdint>

namespace softrnic {

constexpr uint32_t kWireMagic = 0x53524e43;  // "SRNC"
constexpr uint8_t kWireVersion = 1;
constexpr size_t kHeaderBytes = 40;

enum class FrameType : uint8_t {
  kHello = 1,
  kHelloAck = 2,
  kChallenge = 3,  // Listener to requester, before the HELLO (token only).
  kSend = 10,
  kSendImm = 11,
  kWrite = 12,
  kWriteImm = 13,
  kRead = 14,
  kAck = 20,
  kNak = 21,
  kReadResp = 22,
};

enum class NakCode : uint32_t {
  kRemoteAccess = 1,    // Bad rkey, bounds or rights.
  kInvalidRequest = 2,  // Message too long for the receive buffer, etc.
  kRnr = 3,             // No receive WQE posted: retry later.
  kSequence = 4,        // Out-of-order MSN: retransmit from `msn`.
  kNoQp = 5,            // HELLO for a QP that does not exist.
  kRemoteOp = 6,        // Responder-side failure (its receive buffer's key).
};

// A HELLO's payload under a cluster token: HMAC-SHA256.
constexpr uint32_t kHelloProofBytes = 32;

constexpr uint16_t kFlagSolicited = 1;
// HELLO: the requester QP's source GID is RoCE v1 (a v2 QP drops it).
constexpr uint16_t kFlagRoceV1 = 2;

struct Frame {
  FrameType type;
  uint16_t flags = 0;
  uint32_t qpn = 0;
  uint32_t msn = 0;
  uint32_t length = 0;
  uint32_t rkey = 0;
  uint64_t remote_addr = 0;
  uint32_t imm = 0;
  uint32_t aux = 0;
};

void EncodeFrame(const Frame& f, uint8_t out[kHeaderBytes]);
// False if the bytes are not a valid frame header (bad magic, version, type,
// or a length above `max_length`).
bool DecodeFrame(const uint8_t in[kHeaderBytes], uint32_t max_length, Frame* f);

// Whether this frame type carries `length` payload bytes.
bool HasPayload(FrameType t);

// Whether a (decoded) frame is a request a responder serving QP `qpn`
// executes: SEND, WRITE (with or without immediate) or READ, addressed to
// that QP. Anything else on an accepted connection is a protocol violation.
bool IsRequestFor(const Frame& f, uint32_t qpn);

// A reply of `type` to request `req`: addressed to the same QP, with its
// MSN; every other field zero.
Frame ReplyTo(FrameType type, const Frame& req);
// A NAK of `req` for `code` that names `msn` (for a sequence NAK, where the
// requester must retransmit from, which is not the request's own MSN).
Frame NakTo(const Frame& req, NakCode code, uint32_t msn);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_WIRE_H_
