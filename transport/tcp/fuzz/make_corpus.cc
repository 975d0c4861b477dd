// Writes the seed corpora of the TCP fuzz targets: real frames, made with
// the wire encoders, in the input layouts server_frame_fuzz.cc and
// client_frame_fuzz.cc describe.
//
//   bazel run //transport/tcp:make_fuzz_corpus -- $PWD/transport/tcp/fuzz
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "transport/tcp/fuzz/fuzz_memory.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

std::string Req(WireOp op, uint64_t id, uint64_t addr, uint64_t len) {
  uint8_t h[kRequestHeaderBytes];
  EncodeRequest({op, id, addr, len, fuzz::kFuzzKey, fuzz::kFuzzIncarnation}, h);
  return std::string(reinterpret_cast<char*>(h), sizeof(h));
}

std::string Resp(WireOp op, WireStatus st, uint64_t id, uint64_t len) {
  uint8_t h[kResponseHeaderBytes];
  EncodeResponse({op, st, id, len}, h);
  return std::string(reinterpret_cast<char*>(h), sizeof(h));
}

void Write(const std::string& dir, const std::string& name,
           const std::string& bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Server input: read size, send size, clock step (ms), then the stream.
std::string Server(uint8_t read, uint8_t send, uint8_t step,
                   const std::string& stream) {
  return std::string{static_cast<char>(read), static_cast<char>(send),
                     static_cast<char>(step)} +
         stream;
}

struct ClientSlice {
  bool write;
  uint32_t length;  // 1..2048
};

// Client input: slices, send size, receive size, send budget (x64), sweep
// time (s), then the peer's bytes.
std::string Client(const std::vector<ClientSlice>& slices, uint8_t send,
                   uint8_t recv, uint8_t budget, uint8_t sweep,
                   const std::string& stream) {
  std::string s(1, static_cast<char>(slices.size() - 1));
  for (const ClientSlice& c : slices) {
    const uint32_t v = c.length - 1;
    s.push_back(static_cast<char>(((v >> 8) << 1) | (c.write ? 1 : 0)));
    s.push_back(static_cast<char>(v & 0xff));
  }
  s += std::string{static_cast<char>(send), static_cast<char>(recv),
                   static_cast<char>(budget), static_cast<char>(sweep)};
  return s + stream;
}

void ServerCorpus(const std::string& dir) {
  const uint64_t base = fuzz::kFuzzBase;
  const uint64_t priv = base + fuzz::kFuzzBytes / 2;
  const uint64_t end = priv;  // Of the remote-accessible half.
  Write(dir, "write_then_read",
        Server(0, 0, 1,
               Req(WireOp::kWrite, 1, base + 16, 100) + std::string(100, 'w') +
                   Req(WireOp::kRead, 2, base + 16, 100)));
  std::string reads;
  for (int i = 0; i < 20; ++i) {
    reads += Req(WireOp::kRead, i + 1, base + 1000 * i, 1000);
  }
  Write(dir, "pipelined_reads", Server(7, 13, 0, reads));
  Write(dir, "out_of_bounds",
        Server(0, 0, 0,
               Req(WireOp::kWrite, 1, end - 50, 100) + std::string(100, 'x') +
                   Req(WireOp::kRead, 2, priv, 8) +
                   Req(WireOp::kWrite, 3, priv + 8, 8) + std::string(8, 'y') +
                   Req(WireOp::kRead, 4, base, 8)));
  Write(dir, "partial_header",
        Server(0, 0, 200, Req(WireOp::kRead, 1, base, 8).substr(0, 10)));
  Write(dir, "partial_payload",
        Server(3, 0, 100,
               Req(WireOp::kWrite, 1, base, 4096) + std::string(2000, 'p')));
  Write(dir, "byte_by_byte",
        Server(1, 1, 0,
               Req(WireOp::kWrite, 7, base + 64, 64) + std::string(64, 'b') +
                   Req(WireOp::kRead, 8, base + 64, 64)));
  Write(dir, "garbage", Server(0, 0, 0, std::string(40, 'Z')));
  std::string refused = Req(WireOp::kRead, 1, base, 8);
  refused[32] ^= 1;  // The key's first byte.
  std::string stale = Req(WireOp::kWrite, 2, base, 8);
  stale[47] ^= 1;  // The incarnation's last byte.
  Write(dir, "wrong_key_and_incarnation",
        Server(0, 0, 0,
               refused + stale + std::string(8, 's') +
                   Req(WireOp::kRead, 3, base, 8)));
}

void ClientCorpus(const std::string& dir) {
  Write(dir, "write_and_read",
        Client({{true, 100}, {false, 200}}, 0, 0, 255, 15,
               Resp(WireOp::kWriteAck, WireStatus::kOk, 1, 0) +
                   Resp(WireOp::kReadData, WireStatus::kOk, 2, 200) +
                   std::string(200, 'r')));
  Write(dir, "rejected",
        Client({{false, 8}, {true, 8}}, 0, 0, 255, 15,
               Resp(WireOp::kReadData, WireStatus::kOutOfBounds, 1, 0) +
                   Resp(WireOp::kWriteAck, WireStatus::kOutOfBounds, 2, 0)));
  std::vector<ClientSlice> eight;
  std::string answers;
  for (int i = 0; i < 8; ++i) {
    const bool write = i % 3 == 0;
    const uint32_t len = 1 + 250 * i;
    eight.push_back({write, len});
    answers += write ? Resp(WireOp::kWriteAck, WireStatus::kOk, i + 1, 0)
                     : Resp(WireOp::kReadData, WireStatus::kOk, i + 1, len) +
                           std::string(len, static_cast<char>('a' + i));
  }
  Write(dir, "eight_in_small_pieces", Client(eight, 5, 7, 255, 15, answers));
  Write(dir, "late_sweep", Client(eight, 0, 0, 255, 3, answers));
  Write(dir, "wrong_id",
        Client({{false, 16}}, 0, 0, 255, 15,
               Resp(WireOp::kReadData, WireStatus::kOk, 9, 16) +
                   std::string(16, 'q')));
  Write(
      dir, "refused",
      Client({{false, 8}, {true, 8}}, 0, 0, 255, 15,
             Resp(WireOp::kReadData, WireStatus::kBadKey, 1, 0) +
                 Resp(WireOp::kWriteAck, WireStatus::kWrongIncarnation, 2, 0)));
  Write(dir, "partly_sent",
        Client({{true, 1000}, {false, 8}}, 0, 0, 1, 0,
               Resp(WireOp::kWriteAck, WireStatus::kOk, 1, 0)));
}

}  // namespace
}  // namespace ferry::tcp

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_corpus <transport/tcp/fuzz dir>\n");
    return 2;
  }
  const std::string root = argv[1];
  ferry::tcp::ServerCorpus(root + "/server_frame_fuzz_test_corpus");
  ferry::tcp::ClientCorpus(root + "/client_frame_fuzz_test_corpus");
  return 0;
}
