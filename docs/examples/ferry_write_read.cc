// ferry_write_read: the transfer of verbs_write_read.cc -- a WRITE of a
// pattern into a peer's registered buffer, a READ back into a second local
// buffer, compare -- on Ferry's API. docs/verbs-example.md reads the two
// side by side. As the verbs example, two processes:
//   ferry_write_read --server [--port P] [tcp|rdma]
//   ferry_write_read --client HOST --port P [tcp|rdma]
// The server's engine runs the metadata service on port P (0: any; it
// prints the port) and registers a buffer; the client WRITEs and READs it,
// then notifies the server, which checks its buffer holds the pattern.
// With no role, both engines run in this process. The transport is "rdma"
// (the default; real NICs, or softrnic under tools/softrnic-run) or "tcp".
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ferry/transfer_engine.h"

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

// The client's side: open the server's segment, WRITE, READ back, verify
// what came back. `engine` has registered `local` (2 * kBytes).
int RunClient(ferry::TransferEngine& engine, std::vector<uint8_t>& local,
              ferry::SegmentHandle* segment_out) {
  // The handshake's first half: the peer's buffers and keys, from the
  // metadata service. QPs are created and connected on first use.
  auto segment = engine.OpenSegment("target-0");
  if (!segment.ok()) return Fail("OpenSegment", segment.status());
  *segment_out = *segment;
  auto buffers = engine.GetSegmentBuffers(*segment);
  if (!buffers.ok() || buffers->empty()) {
    return Fail("GetSegmentBuffers", buffers.ok()
                                         ? absl::NotFoundError("no buffers")
                                         : buffers.status());
  }
  const uint64_t remote_addr = buffers->front().addr;
  // WRITE, then READ back into the second half; each waits for its
  // completion. The target's CPU takes no part.
  if (auto s = Transfer(engine, ferry::OpCode::kWrite, local.data(), *segment,
                        remote_addr);
      !s.ok()) {
    return Fail("WRITE", s);
  }
  if (auto s = Transfer(engine, ferry::OpCode::kRead, local.data() + kBytes,
                        *segment, remote_addr);
      !s.ok()) {
    return Fail("READ", s);
  }
  if (std::memcmp(local.data(), local.data() + kBytes, kBytes) != 0) {
    return Fail("verify", absl::DataLossError("READ differs from WRITE"));
  }
  return 0;
}

bool HoldsPattern(const std::vector<uint8_t>& remote) {
  for (size_t i = 0; i < kBytes; ++i) {
    if (remote[i] != Pattern(i)) return false;
  }
  return true;
}

std::string NicsUsed(ferry::TransferEngine& engine) {
  std::string nics;
  for (const ferry::TransportStats& t : engine.GetTransportStats()) {
    for (const ferry::NicStats& n : t.nics) {
      if (n.slices > 0) nics += " " + n.name;
    }
  }
  return nics;
}

}  // namespace

int main(int argc, char** argv) {
  std::string role, host, transport = "rdma";
  int port = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--server") {
      role = "server";
    } else if (a == "--client" && i + 1 < argc) {
      role = "client";
      host = argv[++i];
    } else if (a == "--port" && i + 1 < argc) {
      port = std::atoi(argv[++i]);
    } else if (a == "tcp" || a == "rdma") {
      transport = a;
    } else {
      std::fprintf(stderr,
                   "usage: ferry_write_read [--server [--port P] | --client "
                   "HOST --port P] [tcp|rdma]\n");
      return 2;
    }
  }
  if (port < 0 || port > 65535 || (role == "client" && port == 0)) {
    std::fprintf(stderr, "ferry_write_read: bad --port %d\n", port);
    return 2;
  }
  // The buffers outlive the engines (declared first, destroyed last): an
  // engine may touch registered memory until it shuts down.
  std::vector<uint8_t> remote(kBytes, 0);
  std::vector<uint8_t> local(2 * kBytes, 0);  // Source, then READ's target.
  for (size_t i = 0; i < kBytes; ++i) local[i] = Pattern(i);

  // Devices, PDs, CQs: Init opens every active NIC. The target also runs
  // the metadata service, where each engine publishes its segment.
  ferry::TransferEngine target;
  if (role != "client") {
    ferry::EngineOptions opts;
    opts.local_segment_name = "target-0";
    opts.transports = {transport};
    opts.rpc_port = static_cast<uint16_t>(port);
    if (auto s = target.Init(opts); !s.ok()) return Fail("target", s);
    // Memory regions: registered on every NIC; a remote-accessible one is
    // published (address, length, rkey per NIC) in the segment.
    if (auto s = target.RegisterLocalMemory(remote.data(), remote.size(), "*",
                                            /*remote_accessible=*/true);
        !s.ok()) {
      return Fail("register target buffer", s);
    }
  }
  if (role == "server") {
    const std::string md = target.metadata_address();
    std::printf("server: listening on port %s\n",
                md.substr(md.rfind(':') + 1).c_str());
    std::fflush(stdout);
    // The client says when it is done; then this buffer must hold the
    // pattern, put there without this process doing anything.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    bool done = false;
    while (!done && absl::Now() < deadline) {
      for (const ferry::Notification& n : target.GetNotifications()) {
        done = done || n.name == "done";
      }
      if (!done) absl::SleepFor(absl::Milliseconds(10));
    }
    if (!done) return Fail("server", absl::DeadlineExceededError("no client"));
    if (!HoldsPattern(remote)) {
      return Fail("verify", absl::DataLossError("target buffer differs"));
    }
    std::printf(
        "server: the client's WRITE is in this buffer, verified (%zu bytes)\n",
        kBytes);
    return 0;
  }

  ferry::TransferEngine initiator;
  ferry::EngineOptions opts;
  opts.local_segment_name = "initiator-0";
  opts.metadata_endpoint = role == "client" ? host + ":" + std::to_string(port)
                                            : target.metadata_address();
  opts.transports = {transport};
  if (auto s = initiator.Init(opts); !s.ok()) return Fail("initiator", s);
  if (auto s = initiator.RegisterLocalMemory(local.data(), local.size(), "*",
                                             /*remote_accessible=*/false);
      !s.ok()) {
    return Fail("register initiator buffer", s);
  }
  ferry::SegmentHandle segment = 0;
  if (int rc = RunClient(initiator, local, &segment); rc != 0) return rc;
  if (role == "client") {
    if (auto s = initiator.SendNotification(segment, "done", ""); !s.ok()) {
      return Fail("SendNotification", s);
    }
    std::printf(
        "client: WRITE of %zu bytes, READ back: equal (over %s via%s)\n",
        kBytes, transport.c_str(), NicsUsed(initiator).c_str());
    return 0;
  }
  if (!HoldsPattern(remote)) {
    return Fail("verify", absl::DataLossError("target buffer differs"));
  }
  std::printf(
      "ferry: WRITE of %zu bytes into target-0's buffer, READ back: equal; "
      "the target holds the pattern (over %s via%s)\n",
      kBytes, transport.c_str(), NicsUsed(initiator).c_str());
  return 0;
}
