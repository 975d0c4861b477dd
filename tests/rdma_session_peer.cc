// rdma_session_peer: a short RDMA initiator session for cross-process
// tests. Starts an engine (RDMA only), WRITEs --bytes to the first buffer
// of segment --target, prints "DONE <state>" (or "ERR <status>"), then
// waits for stdin to close -- or, as the tests mean it to, to be killed
// with its endpoints still connected.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "ferry/transfer_engine.h"

ABSL_FLAG(std::string, name, "session", "segment name");
ABSL_FLAG(std::string, metadata, "", "metadata endpoint");
ABSL_FLAG(std::string, target, "target", "segment to write to");
ABSL_FLAG(uint64_t, bytes, 65536, "bytes to write");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  ferry::EngineOptions o;
  o.local_segment_name = absl::GetFlag(FLAGS_name);
  o.metadata_endpoint = absl::GetFlag(FLAGS_metadata);
  o.transports = {"rdma"};
  o.transfer_timeout = absl::Seconds(10);
  ferry::TransferEngine engine;
  auto fail = [](const absl::Status& s) {
    std::printf("ERR %s\n", s.ToString().c_str());
    std::fflush(stdout);
    return 1;
  };
  if (absl::Status s = engine.Init(o); !s.ok()) return fail(s);
  const size_t n = absl::GetFlag(FLAGS_bytes);
  std::unique_ptr<uint8_t[]> buf(new uint8_t[n]);
  std::memset(buf.get(), 0x5a, n);
  if (absl::Status s = engine.RegisterLocalMemory(buf.get(), n, "*", false);
      !s.ok()) {
    return fail(s);
  }
  auto seg = engine.OpenSegment(absl::GetFlag(FLAGS_target));
  if (!seg.ok()) return fail(seg.status());
  auto buffers = engine.GetSegmentBuffers(*seg);
  if (!buffers.ok()) return fail(buffers.status());
  if (buffers->empty()) return fail(absl::NotFoundError("no target buffer"));
  ferry::TransferRequest r;
  r.opcode = ferry::OpCode::kWrite;
  r.source = buf.get();
  r.target_id = *seg;
  r.target_offset = (*buffers)[0].addr;
  r.length = n;
  auto batch = engine.AllocateBatch(1);
  if (!batch.ok()) return fail(batch.status());
  if (absl::Status s = engine.SubmitTransfer(*batch, {r}); !s.ok()) {
    return fail(s);
  }
  auto st = engine.WaitBatch(*batch, absl::Seconds(30));
  if (!st.ok()) return fail(st.status());
  std::printf("DONE %s\n", st->state == ferry::TransferState::kCompleted
                               ? "COMPLETED"
                               : st->first_error.ToString().c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  (void)engine.FreeBatch(*batch);
  engine.Shutdown();
  return 0;
}
