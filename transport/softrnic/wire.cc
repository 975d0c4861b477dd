#include "transport/softrnic/wire.h"

#include "common/byte_order.h"

namespace softrnic {
namespace {

using ferry::LoadBe16;
using ferry::LoadBe32;
using ferry::LoadBe64;
using ferry::LoadUnaligned;
using ferry::StoreBe16;
using ferry::StoreBe32;
using ferry::StoreBe64;
using ferry::StoreUnaligned;

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

Frame ReplyTo(FrameType type, const Frame& req) {
  Frame r{};
  r.type = type;
  r.qpn = req.qpn;
  r.msn = req.msn;
  return r;
}

Frame NakTo(const Frame& req, NakCode code, uint32_t msn) {
  Frame r = ReplyTo(FrameType::kNak, req);
  r.msn = msn;
  r.aux = static_cast<uint32_t>(code);
  return r;
}

void EncodeFrame(const Frame& f, uint8_t out[kHeaderBytes]) {
  StoreBe32(out, kWireMagic);
  out[4] = kWireVersion;
  out[5] = static_cast<uint8_t>(f.type);
  StoreBe16(out + 6, f.flags);
  StoreBe32(out + 8, f.qpn);
  StoreBe32(out + 12, f.msn);
  StoreBe32(out + 16, f.length);
  StoreBe32(out + 20, f.rkey);
  StoreBe64(out + 24, f.remote_addr);
  StoreUnaligned<uint32_t>(out + 32,
                           f.imm);  // Already big-endian (ibv imm_data).
  StoreBe32(out + 36, f.aux);
}

bool DecodeFrame(const uint8_t in[kHeaderBytes], uint32_t max_length,
                 Frame* f) {
  if (LoadBe32(in) != kWireMagic) return false;
  if (in[4] != kWireVersion) return false;
  if (!KnownType(in[5])) return false;
  f->type = static_cast<FrameType>(in[5]);
  f->flags = LoadBe16(in + 6);
  if ((f->flags & ~(kFlagSolicited | kFlagRoceV1)) != 0) return false;
  f->qpn = LoadBe32(in + 8);
  f->msn = LoadBe32(in + 12);
  f->length = LoadBe32(in + 16);
  f->rkey = LoadBe32(in + 20);
  f->remote_addr = LoadBe64(in + 24);
  f->imm = LoadUnaligned<uint32_t>(in + 32);
  f->aux = LoadBe32(in + 36);
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
