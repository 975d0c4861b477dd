// The tutorial's example (docs/tutorial.md): a "prefill" engine pushes a
// KV-cache block to a "decode" engine with one WRITE batch, then tells it
// so with a notification. Both engines run in this process; the decode
// engine embeds the metadata service. The transport is the first argument
// ("tcp" by default; "rdma" runs on real NICs, or on softrnic under
// tools/softrnic-run). Built and run by CI, over both.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/transfer_engine.h"

namespace {

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string transport = argc > 1 ? argv[1] : "tcp";
  // 1. Start two engines. "embedded" runs the metadata service inside the
  //    first; the second finds it through metadata_address().
  ferry::TransferEngine decode;
  ferry::EngineOptions decode_opts;
  decode_opts.local_segment_name = "decode-0";
  decode_opts.transports = {transport};
  if (auto s = decode.Init(decode_opts); !s.ok()) return Fail("decode Init", s);

  ferry::TransferEngine prefill;
  ferry::EngineOptions prefill_opts;
  prefill_opts.local_segment_name = "prefill-0";
  prefill_opts.metadata_endpoint = decode.metadata_address();
  prefill_opts.transports = {transport};
  if (auto s = prefill.Init(prefill_opts); !s.ok()) {
    return Fail("prefill Init", s);
  }

  // 2. Register memory. The decode side's KV pool is remote-accessible; the
  //    prefill side's block only needs to be a registered source.
  std::vector<char> kv_pool(1 << 20, 0);
  std::vector<char> kv_block(64 << 10);
  for (size_t i = 0; i < kv_block.size(); ++i) kv_block[i] = 'a' + i % 26;
  if (auto s = decode.RegisterLocalMemory(kv_pool.data(), kv_pool.size(),
                                          "cpu:0", /*remote_accessible=*/true);
      !s.ok()) {
    return Fail("register kv_pool", s);
  }
  if (auto s = prefill.RegisterLocalMemory(kv_block.data(), kv_block.size(),
                                           "cpu:0", false);
      !s.ok()) {
    return Fail("register kv_block", s);
  }

  // 3. Open the peer's segment and find where to write: here, slot 3 of its
  //    pool (a real scheduler would have told us the address).
  auto decode_seg = prefill.OpenSegment("decode-0");
  if (!decode_seg.ok()) return Fail("OpenSegment", decode_seg.status());
  auto buffers = prefill.GetSegmentBuffers(*decode_seg);
  if (!buffers.ok() || buffers->empty())
    return Fail("buffers", buffers.status());
  const uint64_t slot3 = buffers->front().addr + 3 * kv_block.size();

  // 4. One batch, one WRITE request, wait without spinning, free.
  auto batch = prefill.AllocateBatch(1);
  if (!batch.ok()) return Fail("AllocateBatch", batch.status());
  ferry::TransferRequest req;
  req.opcode = ferry::OpCode::kWrite;
  req.source = kv_block.data();
  req.target_id = *decode_seg;
  req.target_offset = slot3;
  req.length = kv_block.size();
  if (auto s = prefill.SubmitTransfer(*batch, {req}); !s.ok()) {
    return Fail("SubmitTransfer", s);
  }
  auto status = prefill.WaitBatch(*batch, absl::Seconds(10));
  if (!status.ok()) return Fail("WaitBatch", status.status());
  if (status->state != ferry::TransferState::kCompleted) {
    return Fail("transfer", status->first_error);
  }
  if (auto s = prefill.FreeBatch(*batch); !s.ok()) return Fail("FreeBatch", s);

  // 5. COMPLETED means applied at the target: tell the decode engine.
  if (auto s = prefill.SendNotification(*decode_seg, "kv-ready", "slot=3");
      !s.ok()) {
    return Fail("SendNotification", s);
  }
  std::vector<ferry::Notification> got = decode.GetNotifications();
  if (got.size() != 1 || got[0].message != "slot=3") {
    return Fail("notification", absl::InternalError("not received"));
  }
  if (std::memcmp(kv_pool.data() + 3 * kv_block.size(), kv_block.data(),
                  kv_block.size()) != 0) {
    return Fail("verify", absl::DataLossError("decode pool differs"));
  }
  // 6. Which NICs carried it (the transports' counters).
  std::string nics;
  for (const ferry::TransportStats& t : prefill.GetTransportStats()) {
    for (const ferry::NicStats& n : t.nics) {
      if (n.slices > 0) nics += " " + n.name;
    }
  }
  std::printf(
      "moved %zu bytes prefill-0 -> decode-0 slot 3 over %s (via%s); "
      "notified '%s'\n",
      kv_block.size(), transport.c_str(), nics.c_str(), got[0].name.c_str());
  return 0;
}
