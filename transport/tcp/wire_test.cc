#include "transport/tcp/wire.h"

#include <cstring>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::tcp {
namespace {

TEST(WireTest, RequestRoundTripInNetworkOrder) {
  uint8_t buf[kRequestHeaderBytes];
  EncodeRequest({WireOp::kWrite, 0x0102030405060708, 0xdeadbeef, 4096,
                 0xa1a2a3a4a5a6a7a8, 0xb1b2b3b4b5b6b7b8},
                buf);
  EXPECT_EQ(buf[0], 'F');
  EXPECT_EQ(buf[3], 'Y');
  EXPECT_EQ(buf[8], 0x01);  // Big-endian request id.
  EXPECT_EQ(buf[15], 0x08);
  RequestHeader h;
  ASSERT_OK(DecodeRequest(buf, &h));
  EXPECT_EQ(h.op, WireOp::kWrite);
  EXPECT_EQ(h.request_id, 0x0102030405060708u);
  EXPECT_EQ(h.remote_addr, 0xdeadbeefu);
  EXPECT_EQ(h.length, 4096u);
  EXPECT_EQ(h.key, 0xa1a2a3a4a5a6a7a8u);
  EXPECT_EQ(h.incarnation, 0xb1b2b3b4b5b6b7b8u);
  EXPECT_EQ(buf[32], 0xa1);  // Big-endian key, then incarnation.
  EXPECT_EQ(buf[47], 0xb8);
}

TEST(WireTest, RejectsGarbageRequests) {
  uint8_t good[kRequestHeaderBytes];
  EncodeRequest({WireOp::kRead, 1, 2, 3}, good);
  RequestHeader h;
  auto mutate = [&](int at, uint8_t v) {
    uint8_t b[kRequestHeaderBytes];
    std::memcpy(b, good, sizeof(b));
    b[at] = v;
    return DecodeRequest(b, &h);
  };
  EXPECT_FALSE(mutate(0, 'X').ok());    // Magic.
  EXPECT_FALSE(mutate(4, 9).ok());      // Version.
  EXPECT_FALSE(mutate(5, 0x81).ok());   // A response opcode.
  EXPECT_FALSE(mutate(7, 1).ok());      // Flags.
  EXPECT_FALSE(mutate(31, 0).ok());     // Length 0.
  EXPECT_FALSE(mutate(24, 0xff).ok());  // Length beyond the frame limit.
  uint8_t zeros[kRequestHeaderBytes] = {};
  EXPECT_EQ(DecodeRequest(zeros, &h).code(), absl::StatusCode::kDataLoss);
}

TEST(WireTest, ResponseValidation) {
  uint8_t buf[kResponseHeaderBytes];
  EncodeResponse({WireOp::kReadData, WireStatus::kOk, 7, 100}, buf);
  ResponseHeader h;
  ASSERT_OK(DecodeResponse(buf, &h));
  EXPECT_EQ(h.length, 100u);
  EncodeResponse({WireOp::kWriteAck, WireStatus::kOk, 7, 100}, buf);
  EXPECT_FALSE(DecodeResponse(buf, &h).ok());  // Acks carry no data.
  EncodeResponse({WireOp::kReadData, WireStatus::kOutOfBounds, 7, 5}, buf);
  EXPECT_FALSE(DecodeResponse(buf, &h).ok());  // Errors carry no data.
  EncodeResponse({WireOp::kReadData, static_cast<WireStatus>(77), 7, 0}, buf);
  EXPECT_FALSE(DecodeResponse(buf, &h).ok());
  for (WireStatus refusal :
       {WireStatus::kBadKey, WireStatus::kWrongIncarnation}) {
    EncodeResponse({WireOp::kWriteAck, refusal, 7, 0}, buf);
    ASSERT_OK(DecodeResponse(buf, &h));
    EXPECT_EQ(h.status, refusal);
  }
}

}  // namespace
}  // namespace ferry::tcp
