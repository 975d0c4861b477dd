#include "transport/tcp/wire.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/byte_order.h"
#include "common/secure_random.h"
#include "common/status_macros.h"
#include "common/token_proof.h"

namespace ferry::tcp {
namespace {

static_assert(kProofBytes == kTokenProofBytes);

absl::Status CheckPreamble(const uint8_t* in) {
  if (LoadBe32(in) != kMagic) {
    return absl::DataLossError(
        absl::StrCat("bad magic 0x", absl::Hex(LoadBe32(in))));
  }
  if (in[4] != kVersion) {
    return absl::DataLossError(absl::StrCat("unsupported wire version ", in[4],
                                            " (this side speaks ", kVersion,
                                            ")"));
  }
  return absl::OkStatus();
}

}  // namespace

void EncodeRequest(const RequestHeader& h, uint8_t out[kRequestHeaderBytes]) {
  StoreBe32(out, kMagic);
  out[4] = kVersion;
  out[5] = static_cast<uint8_t>(h.op);
  StoreBe16(out + 6, 0);
  StoreBe64(out + 8, h.request_id);
  StoreBe64(out + 16, h.remote_addr);
  StoreBe64(out + 24, h.length);
  StoreBe64(out + 32, h.key);
  StoreBe64(out + 40, h.incarnation);
}

void EncodeResponse(const ResponseHeader& h,
                    uint8_t out[kResponseHeaderBytes]) {
  StoreBe32(out, kMagic);
  out[4] = kVersion;
  out[5] = static_cast<uint8_t>(h.op);
  StoreBe16(out + 6, static_cast<uint16_t>(h.status));
  StoreBe64(out + 8, h.request_id);
  StoreBe64(out + 16, h.length);
}

int UnsentFrame(const uint8_t* header, size_t header_bytes, const uint8_t* body,
                size_t body_bytes, size_t sent, iovec* iov) {
  int n = 0;
  if (sent < header_bytes) {
    iov[n++] = {const_cast<uint8_t*>(header) + sent, header_bytes - sent};
  }
  if (body_bytes > 0) {
    const size_t off = std::max(sent, header_bytes) - header_bytes;
    iov[n++] = {const_cast<uint8_t*>(body) + off, body_bytes - off};
  }
  return n;
}

absl::Status DecodeRequest(const uint8_t in[kRequestHeaderBytes],
                           RequestHeader* h) {
  FERRY_RETURN_IF_ERROR(CheckPreamble(in));
  uint8_t op = in[5];
  if (op != static_cast<uint8_t>(WireOp::kWrite) &&
      op != static_cast<uint8_t>(WireOp::kRead) &&
      op != static_cast<uint8_t>(WireOp::kProof)) {
    return absl::DataLossError(absl::StrCat("bad request opcode ", op));
  }
  if (LoadBe16(in + 6) != 0)
    return absl::DataLossError("unknown request flags");
  h->op = static_cast<WireOp>(op);
  h->request_id = LoadBe64(in + 8);
  h->remote_addr = LoadBe64(in + 16);
  h->length = LoadBe64(in + 24);
  h->key = LoadBe64(in + 32);
  h->incarnation = LoadBe64(in + 40);
  if (h->op == WireOp::kProof &&
      (h->length != kProofBytes || h->request_id != 0 || h->remote_addr != 0 ||
       h->key != 0 || h->incarnation != 0)) {
    return absl::DataLossError("bad proof header");
  }
  if (h->length == 0 || h->length > kMaxFrameLength) {
    return absl::DataLossError(absl::StrCat("request length ", h->length,
                                            " outside 1..", kMaxFrameLength));
  }
  return absl::OkStatus();
}

absl::Status DecodeResponse(const uint8_t in[kResponseHeaderBytes],
                            ResponseHeader* h) {
  FERRY_RETURN_IF_ERROR(CheckPreamble(in));
  uint8_t op = in[5];
  if (op == static_cast<uint8_t>(WireOp::kChallenge)) {
    if (LoadBe16(in + 6) != 0) return absl::DataLossError("bad challenge");
    h->op = WireOp::kChallenge;
    h->status = WireStatus::kOk;
    h->request_id = LoadBe64(in + 8);  // The nonce, not an id or a length.
    h->length = LoadBe64(in + 16);
    return absl::OkStatus();
  }
  if (op != static_cast<uint8_t>(WireOp::kWriteAck) &&
      op != static_cast<uint8_t>(WireOp::kReadData)) {
    return absl::DataLossError(absl::StrCat("bad response opcode ", op));
  }
  uint16_t status = LoadBe16(in + 6);
  if (status > static_cast<uint16_t>(WireStatus::kStagingFailed)) {
    return absl::DataLossError(absl::StrCat("bad response status ", status));
  }
  h->op = static_cast<WireOp>(op);
  h->status = static_cast<WireStatus>(status);
  h->request_id = LoadBe64(in + 8);
  h->length = LoadBe64(in + 16);
  if (h->length > kMaxFrameLength ||
      (h->op == WireOp::kWriteAck && h->length != 0) ||
      (h->status != WireStatus::kOk && h->length != 0)) {
    return absl::DataLossError(absl::StrCat("bad response length ", h->length));
  }
  return absl::OkStatus();
}

void EncodeChallenge(uint8_t out[kResponseHeaderBytes]) {
  uint64_t nonce[2];
  SecureRandomBytes(nonce, sizeof(nonce));
  EncodeResponse({WireOp::kChallenge, WireStatus::kOk, nonce[0], nonce[1]},
                 out);
}

void EncodeProof(absl::string_view token,
                 const uint8_t challenge[kResponseHeaderBytes],
                 uint8_t out[kRequestHeaderBytes + kProofBytes]) {
  EncodeRequest({WireOp::kProof, 0, 0, kProofBytes}, out);
  TokenProof(token, kProofLabel,
             {absl::MakeConstSpan(challenge, kResponseHeaderBytes),
              absl::MakeConstSpan(out, kRequestHeaderBytes)},
             out + kRequestHeaderBytes);
}

bool ProofMatches(absl::string_view token,
                  const uint8_t challenge[kResponseHeaderBytes],
                  const uint8_t frame[kRequestHeaderBytes + kProofBytes]) {
  return TokenProofMatches(
      token, kProofLabel,
      {absl::MakeConstSpan(challenge, kResponseHeaderBytes),
       absl::MakeConstSpan(frame, kRequestHeaderBytes)},
      frame + kRequestHeaderBytes);
}

}  // namespace ferry::tcp
