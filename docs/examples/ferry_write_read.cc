// ferry_write_read: the transfer of verbs_write_read.cc -- a WRITE of a
// pattern into a peer's registered buffer, a READ back into a second local
// buffer, compare -- on Ferry's API. docs/verbs-example.md reads the two
// side by side. Two engines run in this process: "target" plays the
// server (it registers a buffer, then does nothing) and "initiator" the
// client. The transport is the first argument: "rdma" (the default; real
// NICs, or softrnic under tools/softrnic-run) or "tcp".
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/transfer_engine.h"

namespace {

constexpr size_t kBytes = 64 << 10;

uint8_t Pattern(size_t i) { return static_cast<uint8_t>(i % 251); }

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  return 1;
}

// One request in a batch of its own, waited for (bounded) and freed: a
// signaled work request and its completion, on every NIC Ferry uses.
absl::Status Transfer(ferry::TransferEngine& engine, ferry::OpCode op,
                      void* local, ferry::SegmentHandle target,
                      uint64_t remote_addr) {
  absl::StatusOr<ferry::BatchId> batch = engine.AllocateBatch(1);
  if (!batch.ok()) return batch.status();
  ferry::TransferRequest req;
  req.opcode = op;
  req.source = local;  // WRITE: read from here; READ: written here.
  req.target_id = target;
  req.target_offset = remote_addr;
  req.length = kBytes;
  absl::Status s = engine.SubmitTransfer(*batch, {req});
  if (s.ok()) {
    auto status = engine.WaitBatch(*batch, absl::Seconds(10));
    if (!status.ok()) {
      s = status.status();
    } else if (status->state != ferry::TransferState::kCompleted) {
      s = status->first_error;
    }
  }
  absl::Status freed = engine.FreeBatch(*batch);
  return s.ok() ? freed : s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string transport = argc > 1 ? argv[1] : "rdma";
  // The buffers outlive the engines (declared first, destroyed last): an
  // engine may touch registered memory until it shuts down.
  std::vector<uint8_t> remote(kBytes, 0);
  std::vector<uint8_t> local(2 * kBytes, 0);  // Source, then READ's target.
  for (size_t i = 0; i < kBytes; ++i) local[i] = Pattern(i);

  // 1. Devices, PDs, CQs: Init opens every active NIC. The target also
  //    runs the metadata service, where each engine publishes its segment.
  ferry::TransferEngine target;
  ferry::EngineOptions target_opts;
  target_opts.local_segment_name = "target-0";
  target_opts.transports = {transport};
  if (auto s = target.Init(target_opts); !s.ok()) return Fail("target", s);
  ferry::TransferEngine initiator;
  ferry::EngineOptions initiator_opts;
  initiator_opts.local_segment_name = "initiator-0";
  initiator_opts.metadata_endpoint = target.metadata_address();
  initiator_opts.transports = {transport};
  if (auto s = initiator.Init(initiator_opts); !s.ok()) {
    return Fail("initiator", s);
  }

  // 2. Memory regions: registered on every NIC; a remote-accessible one is
  //    published (address, length, rkey per NIC) in the segment.
  if (auto s = target.RegisterLocalMemory(remote.data(), remote.size(), "*",
                                          /*remote_accessible=*/true);
      !s.ok()) {
    return Fail("register target buffer", s);
  }
  if (auto s = initiator.RegisterLocalMemory(local.data(), local.size(), "*",
                                             /*remote_accessible=*/false);
      !s.ok()) {
    return Fail("register initiator buffer", s);
  }

  // 3. The handshake's first half: the peer's buffers and keys, from the
  //    metadata service. QPs are created and connected on first use.
  auto segment = initiator.OpenSegment("target-0");
  if (!segment.ok()) return Fail("OpenSegment", segment.status());
  auto buffers = initiator.GetSegmentBuffers(*segment);
  if (!buffers.ok() || buffers->empty()) {
    return Fail("GetSegmentBuffers", buffers.ok()
                                         ? absl::NotFoundError("no buffers")
                                         : buffers.status());
  }
  const uint64_t remote_addr = buffers->front().addr;

  // 4. WRITE, then READ back into the second half; each waits for its
  //    completion. The target's CPU takes no part.
  if (auto s = Transfer(initiator, ferry::OpCode::kWrite, local.data(),
                        *segment, remote_addr);
      !s.ok()) {
    return Fail("WRITE", s);
  }
  if (auto s = Transfer(initiator, ferry::OpCode::kRead, local.data() + kBytes,
                        *segment, remote_addr);
      !s.ok()) {
    return Fail("READ", s);
  }

  // 5. Verify: the READ brought back what the WRITE put at the target.
  if (std::memcmp(local.data(), local.data() + kBytes, kBytes) != 0) {
    return Fail("verify", absl::DataLossError("READ differs from WRITE"));
  }
  for (size_t i = 0; i < kBytes; ++i) {
    if (remote[i] != Pattern(i)) {
      return Fail("verify", absl::DataLossError("target buffer differs"));
    }
  }
  std::string nics;
  for (const ferry::TransportStats& t : initiator.GetTransportStats()) {
    for (const ferry::NicStats& n : t.nics) {
      if (n.slices > 0) nics += " " + n.name;
    }
  }
  std::printf(
      "ferry: WRITE of %zu bytes into target-0's buffer, READ back: equal; "
      "the target holds the pattern (over %s via%s)\n",
      kBytes, transport.c_str(), nics.c_str());
  return 0;
}
