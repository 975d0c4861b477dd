#include "transport/softrnic/wire.h"

#include <cstring>

#include "gtest/gtest.h"

namespace softrnic {
namespace {

Frame Sample() {
  Frame f{};
  f.type = FrameType::kWriteImm;
  f.flags = kFlagSolicited;
  f.qpn = 0xabcdef;
  f.msn = 0x01020304;
  f.length = 4096;
  f.rkey = 0x11223344;
  f.remote_addr = 0x0102030405060708;
  f.imm = 0xdeadbeef;
  f.aux = 7;
  return f;
}

TEST(SoftrnicWireTest, RoundTripInNetworkOrder) {
  uint8_t buf[kHeaderBytes];
  EncodeFrame(Sample(), buf);
  EXPECT_EQ(std::memcmp(buf, "SRNC", 4), 0);
  EXPECT_EQ(buf[12], 0x01);  // MSN, big-endian.
  EXPECT_EQ(buf[24], 0x01);  // Remote address, big-endian.
  Frame g;
  ASSERT_TRUE(DecodeFrame(buf, 1 << 20, &g));
  EXPECT_EQ(g.type, FrameType::kWriteImm);
  EXPECT_EQ(g.flags, kFlagSolicited);
  EXPECT_EQ(g.qpn, 0xabcdefu);
  EXPECT_EQ(g.msn, 0x01020304u);
  EXPECT_EQ(g.length, 4096u);
  EXPECT_EQ(g.rkey, 0x11223344u);
  EXPECT_EQ(g.remote_addr, 0x0102030405060708u);
  EXPECT_EQ(g.imm, 0xdeadbeefu);  // Opaque: passed through as stored.
  EXPECT_EQ(g.aux, 7u);
}

TEST(SoftrnicWireTest, RejectsMalformedHeaders) {
  uint8_t good[kHeaderBytes];
  EncodeFrame(Sample(), good);
  Frame g;
  auto with = [&](int at, uint8_t v) {
    uint8_t b[kHeaderBytes];
    std::memcpy(b, good, sizeof(b));
    b[at] = v;
    return DecodeFrame(b, 1 << 20, &g);
  };
  EXPECT_FALSE(with(0, 'X'));  // Magic.
  EXPECT_FALSE(with(4, 2));    // Version.
  EXPECT_FALSE(with(5, 0));    // Unknown type.
  EXPECT_FALSE(with(5, 99));
  EXPECT_FALSE(with(6, 0x80));               // Unknown flag.
  EXPECT_FALSE(with(8, 0x01));               // QPN above 24 bits.
  EXPECT_FALSE(DecodeFrame(good, 100, &g));  // Longer than allowed.
  uint8_t zeros[kHeaderBytes] = {};
  EXPECT_FALSE(DecodeFrame(zeros, 1 << 20, &g));
}

TEST(SoftrnicWireTest, PayloadOnlyWhereItBelongs) {
  Frame ack{};
  ack.type = FrameType::kAck;
  ack.length = 5;  // An ACK carries no payload.
  uint8_t buf[kHeaderBytes];
  EncodeFrame(ack, buf);
  Frame g;
  EXPECT_FALSE(DecodeFrame(buf, 1 << 20, &g));
  Frame read{};
  read.type = FrameType::kRead;
  read.length = 5;  // A READ request names the length it wants.
  EncodeFrame(read, buf);
  EXPECT_TRUE(DecodeFrame(buf, 1 << 20, &g));
  EXPECT_FALSE(HasPayload(FrameType::kRead));
  EXPECT_TRUE(HasPayload(FrameType::kReadResp));
}

TEST(SoftrnicWireTest, RepliesKeepOnlyTheRequestsQpAndMsn) {
  const Frame req = Sample();
  const Frame ack = ReplyTo(FrameType::kAck, req);
  EXPECT_EQ(ack.type, FrameType::kAck);
  EXPECT_EQ(ack.qpn, req.qpn);
  EXPECT_EQ(ack.msn, req.msn);
  EXPECT_EQ(ack.flags, 0);
  EXPECT_EQ(ack.length, 0u);
  EXPECT_EQ(ack.rkey, 0u);
  EXPECT_EQ(ack.remote_addr, 0u);
  EXPECT_EQ(ack.imm, 0u);
  EXPECT_EQ(ack.aux, 0u);
  // An ACK announces no payload, so it decodes as it was built.
  uint8_t buf[kHeaderBytes];
  EncodeFrame(ack, buf);
  Frame g;
  EXPECT_TRUE(DecodeFrame(buf, 1 << 20, &g));
}

TEST(SoftrnicWireTest, NakNamesItsCodeAndTheMsnGiven) {
  const Frame req = Sample();
  const Frame nak = NakTo(req, NakCode::kSequence, 17);
  EXPECT_EQ(nak.type, FrameType::kNak);
  EXPECT_EQ(nak.qpn, req.qpn);
  EXPECT_EQ(nak.msn, 17u);  // Not the request's: where to resume.
  EXPECT_EQ(nak.aux, static_cast<uint32_t>(NakCode::kSequence));
  EXPECT_EQ(nak.length, 0u);
  EXPECT_EQ(nak.rkey, 0u);
}

}  // namespace
}  // namespace softrnic
