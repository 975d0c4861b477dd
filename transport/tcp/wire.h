// Wire format of the TCP transport. Every field is in network byte order;
// every header is validated before any of its fields is used. A frame that
// fails validation closes its connection and nothing else.
//
// Request (initiator -> target), 48 bytes, then `length` payload bytes for a
// WRITE:
//   u32 magic 'FRRY' | u8 version | u8 opcode | u16 flags (0)
//   u64 request_id | u64 remote_addr | u64 length
//   u64 key | u64 incarnation
// `key` is the target buffer's key from the segment descriptor
// (Buffer.tcp_key) and `incarnation` the target engine run's, as the
// initiator's descriptor names them: the target serves a frame only if both
// match, so an address alone reads and writes nothing, and a sender with a
// stale descriptor never touches a process that later took the same port.
// Response (target -> initiator), 24 bytes, then `length` data bytes for a
// successful READ:
//   u32 magic 'FRRY' | u8 version | u8 opcode | u16 status
//   u64 request_id | u64 length
//
// Under a cluster token (TransportEnv::auth_token) a connection opens with
// a proof: the target first sends a CHALLENGE, a response header whose
// request_id and length fields hold 16 random bytes; the initiator answers
// with a PROOF request (every field 0 but length = 32) and 32 payload
// bytes, TokenProof (common/token_proof.h) under the token of the label
// "ferry tcp proof v1", the CHALLENGE's 24 bytes and the PROOF's header.
// The target serves nothing before a valid PROOF, and closes the
// connection on a wrong one; so a descriptor's keys grant nothing to
// whoever lacks the token. Without a token, neither side sends either.
#ifndef FERRY_TRANSPORT_TCP_WIRE_H_
#define FERRY_TRANSPORT_TCP_WIRE_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ferry::tcp {

constexpr uint32_t kMagic = 0x46525259;  // "FRRY"
constexpr uint8_t kVersion = 2;
constexpr size_t kRequestHeaderBytes = 48;
constexpr size_t kResponseHeaderBytes = 24;
// No slice is larger; a header announcing more is garbage.
constexpr uint64_t kMaxFrameLength = 64ull << 20;

enum class WireOp : uint8_t {
  kWrite = 1,
  kRead = 2,
  kProof = 3,  // Initiator's answer to kChallenge (token only).
  kWriteAck = 0x81,
  kReadData = 0x82,
  kChallenge = 0x83,  // Target's first frame (token only).
};

constexpr char kProofLabel[] = "ferry tcp proof v1";
constexpr size_t kProofBytes = 32;  // The PROOF's payload.

enum class WireStatus : uint16_t {
  kOk = 0,
  // Range not inside a buffer registered as remote-accessible.
  kOutOfBounds = 1,
  // The key is not the buffer's (nothing was read or written).
  kBadKey = 2,
  // The frame names another run of the target engine (it restarted, or
  // another process has its port): nothing was read or written.
  kWrongIncarnation = 3,
  // The range is GPU memory, which the target stages through host buffers
  // smaller than the frame: nothing was read or written.
  kTooLarge = 4,
  // The range is GPU memory and the target could not stage it (no driver,
  // no pinned memory, a failed copy); a WRITE may be partly applied.
  kStagingFailed = 5,
};

struct RequestHeader {
  WireOp op;
  uint64_t request_id;
  uint64_t remote_addr;
  uint64_t length;
  uint64_t key = 0;
  uint64_t incarnation = 0;
};

struct ResponseHeader {
  WireOp op;
  WireStatus status;
  uint64_t request_id;
  uint64_t length;
};

void EncodeRequest(const RequestHeader& h, uint8_t out[kRequestHeaderBytes]);
void EncodeResponse(const ResponseHeader& h, uint8_t out[kResponseHeaderBytes]);

// What is left to send of a frame -- a header of `header_bytes`, then
// `body_bytes` at `body` -- once `sent` bytes of it went out, as at most two
// iovecs at `iov`; returns how many it wrote.
int UnsentFrame(const uint8_t* header, size_t header_bytes, const uint8_t* body,
                size_t body_bytes, size_t sent, iovec* iov);

// DataLoss with a reason if the bytes are not a valid header. A PROOF
// request decodes (with length kProofBytes and every other field 0) and a
// CHALLENGE response too (its nonce in request_id and length): where one
// is not expected, the caller refuses it.
absl::Status DecodeRequest(const uint8_t in[kRequestHeaderBytes],
                           RequestHeader* h);
absl::Status DecodeResponse(const uint8_t in[kResponseHeaderBytes],
                            ResponseHeader* h);

// A CHALLENGE with a fresh random nonce, encoded.
void EncodeChallenge(uint8_t out[kResponseHeaderBytes]);
// The PROOF answering `challenge` under `token`: header, then payload.
void EncodeProof(absl::string_view token,
                 const uint8_t challenge[kResponseHeaderBytes],
                 uint8_t out[kRequestHeaderBytes + kProofBytes]);
// Whether `frame` (a PROOF's header, then its payload) answers `challenge`
// under `token` (compared in constant time).
bool ProofMatches(absl::string_view token,
                  const uint8_t challenge[kResponseHeaderBytes],
                  const uint8_t frame[kRequestHeaderBytes + kProofBytes]);

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_WIRE_H_
