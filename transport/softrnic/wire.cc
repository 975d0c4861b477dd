#include "transport/softrnic/wire.h"

#include <endian.h>

#include <cstring>

namespace softrnic {
namespace {

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(v));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

bool KnownType(uint8_t t) {
  switch (static_cast<FrameType>(t)) {
    case FrameType::kHello:
    case FrameType::kHelloAck:
    case FrameType::kChallenge:
    case FrameType::kSend:
    case FrameType::kSendImm:
    case FrameType::kWrite:
    case FrameType::kWriteImm:
    case FrameType::kRead:
    case FrameType::kAck:
    case FrameType::kNak:
    case FrameType::kReadResp:
      return true;
  }
  return false;
}

}  // namespace

bool HasPayload(FrameType t) {
  return t == FrameType::kHello || t == FrameType::kSend ||
         t == FrameType::kSendImm || t == FrameType::kWrite ||
         t == FrameType::kWriteImm || t == FrameType::kReadResp;
}

bool IsRequestFor(const Frame& f, uint32_t qpn) {
  switch (f.type) {
    case FrameType::kSend:
    case FrameType::kSendImm:
    case FrameType::kWrite:
    case FrameType::kWriteImm:
    case FrameType::kRead:
      return f.qpn == qpn;
    default:
      return false;
  }
}

void EncodeFrame(const Frame& f, uint8_t out[kHeaderBytes]) {
  Put<uint32_t>(out, htobe32(kWireMagic));
  out[4] = kWireVersion;
  out[5] = static_cast<uint8_t>(f.type);
  Put<uint16_t>(out + 6, htobe16(f.flags));
  Put<uint32_t>(out + 8, htobe32(f.qpn));
  Put<uint32_t>(out + 12, htobe32(f.msn));
  Put<uint32_t>(out + 16, htobe32(f.length));
  Put<uint32_t>(out + 20, htobe32(f.rkey));
  Put<uint64_t>(out + 24, htobe64(f.remote_addr));
  Put<uint32_t>(out + 32, f.imm);  // Already big-endian (ibv imm_data).
  Put<uint32_t>(out + 36, htobe32(f.aux));
}

bool DecodeFrame(const uint8_t in[kHeaderBytes], uint32_t max_length,
                 Frame* f) {
  if (be32toh(Get<uint32_t>(in)) != kWireMagic) return false;
  if (in[4] != kWireVersion) return false;
  if (!KnownType(in[5])) return false;
  f->type = static_cast<FrameType>(in[5]);
  f->flags = be16toh(Get<uint16_t>(in + 6));
  if ((f->flags & ~(kFlagSolicited | kFlagRoceV1)) != 0) return false;
  f->qpn = be32toh(Get<uint32_t>(in + 8));
  f->msn = be32toh(Get<uint32_t>(in + 12));
  f->length = be32toh(Get<uint32_t>(in + 16));
  f->rkey = be32toh(Get<uint32_t>(in + 20));
  f->remote_addr = be64toh(Get<uint64_t>(in + 24));
  f->imm = Get<uint32_t>(in + 32);
  f->aux = be32toh(Get<uint32_t>(in + 36));
  if (f->length > max_length) return false;
  if (f->qpn > 0xffffff) return false;
  // Frames without payload must not announce one, except READ (the length
  // requested).
  if (!HasPayload(f->type) && f->type != FrameType::kRead && f->length != 0) {
    return false;
  }
  // A HELLO's payload is its proof, or nothing.
  if (f->type == FrameType::kHello && f->length != 0 &&
      f->length != kHelloProofBytes) {
    return false;
  }
  return true;
}

}  // namespace softrnic
