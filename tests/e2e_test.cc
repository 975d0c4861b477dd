// End to end between two processes, over each transport (TCP, and RDMA on
// softrnic, whose TCP wire then carries the verbs traffic): this test
// process runs an engine with the embedded metadata service;
// tests/engine_peer is the other engine, started and killed by the tests.
#include <unistd.h>

#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/pattern.h"
#include "common/sanitizers.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"

namespace ferry {
namespace {

using ferry::testing::RunfilePath;
using ferry::testing::Subprocess;

// Each case starts a peer with this buffer and registers as much locally:
// under the sanitizers, touching it was most of a case's time.
constexpr size_t kPeerBuffer = (128 << 20) / kSanitizerVolumeDivisor;
constexpr uint64_t kPeerSeed = 99;

class E2eTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    EngineOptions o;
    o.local_segment_name = "initiator";
    o.transfer_timeout = absl::Seconds(5);
    o.transports = absl::StrSplit(GetParam(), ',');
    ASSERT_OK(engine_.Init(o));
    StartPeer();
    local_size_ = kPeerBuffer;
    local_.reset(new uint8_t[local_size_]);
    std::memset(local_.get(), 0, local_size_);
    ASSERT_OK(engine_.RegisterLocalMemory(local_.get(), local_size_));
  }

  // `refresh`: RefreshSegment after a restart (else the engine must notice
  // the new descriptor by itself).
  void StartPeer(bool refresh = true) {
    auto peer = Subprocess::Start(
        {RunfilePath("tests/engine_peer"), "--name=peer",
         absl::StrCat("--metadata=", engine_.metadata_address()),
         absl::StrCat("--buffer_size=", kPeerBuffer),
         absl::StrCat("--seed=", kPeerSeed),
         absl::StrCat("--transport=", GetParam()),
         // A restarted peer waits for the killed one's lease to end before
         // it takes the name: 3 s instead of the default 10 (renewed every
         // second, ample for a loaded machine).
         "--lease_ms=3000"});
    ASSERT_OK(peer);
    peer_ = std::move(*peer);
    auto ready = peer_->ReadLine(absl::Seconds(30));
    ASSERT_OK(ready);
    std::vector<std::string> parts = absl::StrSplit(*ready, ' ');
    ASSERT_EQ(parts[0], "READY") << *ready;
    remote_base_ = std::stoull(parts[1]);
    if (seg_ == 0) {
      auto seg = engine_.OpenSegment("peer");
      ASSERT_OK(seg);
      seg_ = *seg;
    } else if (refresh) {
      ASSERT_OK(engine_.RefreshSegment(seg_));
    }
  }

  TransferRequest Req(OpCode op, size_t off, size_t len) {
    TransferRequest r;
    r.opcode = op;
    r.source = local_.get() + off;
    r.target_id = seg_;
    r.target_offset = remote_base_ + off;
    r.length = len;
    return r;
  }

  BatchStatus Run(const std::vector<TransferRequest>& reqs,
                  absl::Duration wait = absl::Seconds(60)) {
    auto batch = engine_.AllocateBatch(reqs.size());
    EXPECT_OK(batch);
    absl::Status s = engine_.SubmitTransfer(*batch, reqs);
    EXPECT_OK(s);
    auto st = engine_.WaitBatch(*batch, wait);
    EXPECT_OK(st);
    EXPECT_OK(engine_.FreeBatch(*batch));
    return st.ok() ? *st : BatchStatus{};
  }

  std::string Check(size_t off, size_t len, uint64_t seed) {
    auto r = peer_->Ask(absl::StrCat("check ", off, " ", len, " ", seed));
    return r.ok() ? *r : r.status().ToString();
  }

  TransferEngine engine_;
  std::unique_ptr<Subprocess> peer_;
  std::unique_ptr<uint8_t[]> local_;
  size_t local_size_ = 0;
  uint64_t remote_base_ = 0;
  SegmentHandle seg_ = 0;
};

const size_t kSizes[] = {1,
                         7,
                         4096,
                         65537,
                         1 << 20,
                         (4 << 20) + 3,
                         (64 << 20) / kSanitizerVolumeDivisor};

TEST_P(E2eTest, ReadVerifiesEveryByteForAllSizes) {
  size_t off = 0;
  for (size_t len : kSizes) {
    off = (off + 4096 + 13) % (kPeerBuffer - len);  // Unaligned offsets too.
    BatchStatus st = Run({Req(OpCode::kRead, off, len)});
    ASSERT_EQ(st.state, TransferState::kCompleted)
        << len << " " << st.first_error;
    EXPECT_EQ(st.transferred_bytes, len);
    ASSERT_EQ(CheckPattern(local_.get() + off, len, off, kPeerSeed), len)
        << "READ of " << len << " bytes at " << off;
  }
}

TEST_P(E2eTest, WriteIsAppliedAtTargetForAllSizes) {
  uint64_t seed = 1000;
  size_t off = 0;
  for (size_t len : kSizes) {
    off = (off + 8192 + 5) % (kPeerBuffer - len);
    FillPattern(local_.get() + off, len, off, ++seed);
    BatchStatus st = Run({Req(OpCode::kWrite, off, len)});
    ASSERT_EQ(st.state, TransferState::kCompleted)
        << len << " " << st.first_error;
    // Completion means applied: the target sees the data right away.
    ASSERT_EQ(Check(off, len, seed), "OK") << "WRITE of " << len;
  }
}

TEST_P(E2eTest, ManyRequestsPerBatchMixed) {
  std::vector<TransferRequest> reqs;
  const size_t kBlock = 96 * 1024 + 1;
  for (size_t i = 0; i < 256; ++i) {
    size_t off = i * kBlock;
    if (i % 2 == 0) {
      FillPattern(local_.get() + off, kBlock, off, 5);
      reqs.push_back(Req(OpCode::kWrite, off, kBlock));
    } else {
      reqs.push_back(Req(OpCode::kRead, off, kBlock));
    }
  }
  BatchStatus st = Run(reqs);
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(st.completed, 256u);
  for (size_t i = 0; i < 256; ++i) {
    size_t off = i * kBlock;
    if (i % 2 == 0) {
      ASSERT_EQ(Check(off, kBlock, 5), "OK") << i;
    } else {
      ASSERT_EQ(CheckPattern(local_.get() + off, kBlock, off, kPeerSeed),
                kBlock)
          << i;
    }
  }
}

TEST_P(E2eTest, BadInputGetsClearErrors) {
  auto batch = engine_.AllocateBatch(2);
  ASSERT_OK(batch);
  std::vector<uint8_t> unregistered(16);
  TransferRequest r = Req(OpCode::kWrite, 0, 16);
  r.source = unregistered.data();
  absl::Status s = engine_.SubmitTransfer(*batch, {r});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  r = Req(OpCode::kWrite, 0, 16);
  r.target_offset = remote_base_ + kPeerBuffer - 8;  // 8 bytes past the end.
  // Accepted, then refused once a fresh descriptor confirms the range is
  // outside the peer's buffers (SubmitTransfer does not wait for it).
  ASSERT_OK(engine_.SubmitTransfer(*batch, {r}));
  auto done = engine_.WaitBatch(*batch, absl::Seconds(10));
  ASSERT_OK(done);
  EXPECT_EQ(done->state, TransferState::kFailed);
  EXPECT_STATUS(done->first_error, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(done->first_error.message().find("remote range"), std::string::npos)
      << done->first_error;
  EXPECT_EQ(Check(kPeerBuffer - 8, 8, kPeerSeed), "OK");  // Nothing written.
  ASSERT_OK(engine_.FreeBatch(*batch));
  batch = engine_.AllocateBatch(2);
  ASSERT_OK(batch);
  EXPECT_EQ(engine_.OpenSegment("no-such-engine").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_.SubmitTransfer(*batch, {Req(OpCode::kRead, 0, 0)}).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<TransferRequest> three(3, Req(OpCode::kRead, 0, 8));
  EXPECT_EQ(engine_.SubmitTransfer(*batch, three).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK(engine_.FreeBatch(*batch));
  EXPECT_EQ(engine_.FreeBatch(*batch).code(),
            absl::StatusCode::kInvalidArgument);  // Double free.
  EXPECT_EQ(engine_.GetTransferStatus(*batch, 0).status().code(),
            absl::StatusCode::kInvalidArgument);  // Stale id.
}

TEST_P(E2eTest, TargetSideCheckWhenDescriptorIsStale) {
  // The peer unregisters its buffer; our cached descriptor still lists it,
  // so the request reaches the peer, which must refuse it.
  ASSERT_EQ(*peer_->Ask("unregister"), "OK");
  FillPattern(local_.get(), 4096, 0, 7);
  BatchStatus st = Run({Req(OpCode::kWrite, 0, 4096)});
  EXPECT_EQ(st.state, TransferState::kFailed);
  // shm's initiator checks the target's table; the others' target refuses.
  // (Or the new descriptor came first, and this engine refuses.)
  const absl::string_view m = st.first_error.message();
  EXPECT_TRUE(absl::StrContains(m, "remote-accessible") ||
              (absl::StartsWith(GetParam(), "shm") &&
               absl::StrContains(m, "unregistered")))
      << st.first_error;
  EXPECT_EQ(Check(0, 4096, kPeerSeed), "OK");  // Untouched.
}

TEST_P(E2eTest, PeerKilledFailsWithinTimeoutThenRestartWorks) {
  peer_->Kill();
  absl::Time start = absl::Now();
  BatchStatus st = Run({Req(OpCode::kRead, 0, 1 << 20)}, absl::Seconds(30));
  EXPECT_TRUE(st.state == TransferState::kFailed ||
              st.state == TransferState::kTimeout);
  EXPECT_FALSE(st.first_error.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // transfer_timeout 5 s.
  // A restarted peer publishes a new descriptor (new address, keys, QPs).
  // Without a RefreshSegment, the failures mark the cached descriptor
  // stale and a later submission fetches the new one: transfers succeed
  // again (reconnect backoff is at most 2 s).
  StartPeer(/*refresh=*/false);
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    st = Run({Req(OpCode::kRead, 0, 1 << 20)});
    if (st.state == TransferState::kCompleted) break;
    absl::SleepFor(absl::Milliseconds(200));
  } while (absl::Now() < deadline);
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(CheckPattern(local_.get(), 1 << 20, 0, kPeerSeed), 1u << 20);
}

TEST_P(E2eTest, PeerExitsCleanly) {
  auto code = peer_->Finish(absl::Seconds(10));
  ASSERT_OK(code);
  EXPECT_EQ(*code, 0);
  // Its segment is gone from the metadata service.
  TransferEngine other;
  EngineOptions o;
  o.local_segment_name = "other";
  o.metadata_endpoint = engine_.metadata_address();
  ASSERT_OK(other.Init(o));
  EXPECT_EQ(other.OpenSegment("peer").status().code(),
            absl::StatusCode::kNotFound);
}

// The first transport listed moves the bytes: on the same host, "shm,tcp"
// copies directly and leaves TCP idle.
TEST_P(E2eTest, TheFirstTransportMovesTheBytes) {
  FillPattern(local_.get(), 1 << 20, 0, 5);
  BatchStatus st = Run({Req(OpCode::kWrite, 0, 1 << 20)});
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(Check(0, 1 << 20, 5), "OK");
  std::vector<TransportStats> stats = engine_.GetTransportStats();
  std::vector<std::string> names = absl::StrSplit(GetParam(), ',');
  ASSERT_EQ(stats.size(), names.size());
  for (size_t t = 0; t < stats.size(); ++t) {
    EXPECT_EQ(stats[t].transport, names[t]);
    uint64_t bytes = 0;
    for (const NicStats& n : stats[t].nics) bytes += n.bytes;
    EXPECT_EQ(bytes, t == 0 ? 1u << 20 : 0u) << names[t];
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, E2eTest,
                         ::testing::Values("tcp", "rdma", "shm,tcp"),
                         [](const auto& info) {
                           return absl::StrReplaceAll(info.param, {{",", "_"}});
                         });

// A peer whose pids this process cannot name (another PID namespace, as
// in a container) is not tried over shm: "shm,tcp" goes to TCP at once.
TEST(E2eShmTest, APeerInAnotherPidNamespaceIsReachedOverTcp) {
  if (::geteuid() != 0) GTEST_SKIP() << "unshare --pid needs root";
  TransferEngine engine;
  EngineOptions o;
  o.local_segment_name = "initiator";
  o.transports = {"shm", "tcp"};
  ASSERT_OK(engine.Init(o));
  auto peer =
      Subprocess::Start({"/usr/bin/unshare", "--pid", "--kill-child",
                         RunfilePath("tests/engine_peer"), "--name=peer",
                         absl::StrCat("--metadata=", engine.metadata_address()),
                         "--buffer_size=1048576", "--transport=shm,tcp"});
  ASSERT_OK(peer);
  auto ready = (*peer)->ReadLine(absl::Seconds(30));
  ASSERT_OK(ready);
  std::vector<std::string> parts = absl::StrSplit(*ready, ' ');
  ASSERT_EQ(parts[0], "READY") << *ready;
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, engine.OpenSegment("peer"));
  std::vector<uint8_t> local(1 << 20);
  ASSERT_OK(engine.RegisterLocalMemory(local.data(), local.size()));
  TransferRequest r;
  r.opcode = OpCode::kRead;
  r.source = local.data();
  r.target_id = seg;
  r.target_offset = std::stoull(parts[1]);
  r.length = local.size();
  ASSERT_OK_AND_ASSIGN(BatchId batch, engine.AllocateBatch(1));
  ASSERT_OK(engine.SubmitTransfer(batch, {r}));
  ASSERT_OK_AND_ASSIGN(BatchStatus st,
                       engine.WaitBatch(batch, absl::Seconds(30)));
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  ASSERT_OK(engine.FreeBatch(batch));
  EXPECT_EQ(CheckPattern(local.data(), local.size(), 0, 1), local.size());
  std::vector<TransportStats> stats = engine.GetTransportStats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].nics[0].bytes, 0u);
  EXPECT_EQ(stats[0].connects_started, 0u);  // Not even tried.
  EXPECT_EQ(stats[1].nics[0].bytes, local.size());
}

// The endpoint store across processes: this engine keeps one RDMA endpoint
// while two peer processes take turns, so every turn evicts idle endpoints
// to the other peer (closing them with it) and reconnects; no byte may go
// missing either way.
TEST(E2eRdmaStoreTest, EvictionAcrossProcessesLosesNoWork) {
  TransferEngine engine;
  EngineOptions o;
  o.local_segment_name = "initiator";
  o.transports = {"rdma"};
  o.rdma.max_endpoints = 1;
  ASSERT_OK(engine.Init(o));
  const size_t kLocal = 16 << 20;
  std::unique_ptr<uint8_t[]> local(new uint8_t[kLocal]);
  ASSERT_OK(engine.RegisterLocalMemory(local.get(), kLocal));
  std::unique_ptr<Subprocess> peers[2];
  uint64_t bases[2];
  SegmentHandle segs[2];
  for (int p = 0; p < 2; ++p) {
    auto peer = Subprocess::Start(
        {RunfilePath("tests/engine_peer"), absl::StrCat("--name=peer", p),
         absl::StrCat("--metadata=", engine.metadata_address()),
         absl::StrCat("--buffer_size=", kLocal),
         absl::StrCat("--seed=", 300 + p), "--transport=rdma"});
    ASSERT_OK(peer);
    peers[p] = std::move(*peer);
    auto ready = peers[p]->ReadLine(absl::Seconds(30));
    ASSERT_OK(ready);
    std::vector<std::string> parts = absl::StrSplit(*ready, ' ');
    ASSERT_EQ(parts[0], "READY") << *ready;
    bases[p] = std::stoull(parts[1]);
    auto seg = engine.OpenSegment(absl::StrCat("peer", p));
    ASSERT_OK(seg);
    segs[p] = *seg;
  }
  for (int round = 0; round < 6; ++round) {
    const int p = round % 2;
    const size_t off = static_cast<size_t>(round / 2) * (4 << 20);
    // WRITE 2 MiB, READ the peer's pattern back into another 2 MiB.
    FillPattern(local.get() + off, 2 << 20, off, 500 + round);
    std::vector<TransferRequest> reqs;
    for (int k = 0; k < 2; ++k) {
      TransferRequest r;
      r.opcode = k == 0 ? OpCode::kWrite : OpCode::kRead;
      r.source = local.get() + off + k * (2 << 20);
      r.target_id = segs[p];
      r.target_offset = bases[p] + off + k * (2 << 20);
      r.length = 2 << 20;
      reqs.push_back(r);
    }
    auto batch = engine.AllocateBatch(2);
    ASSERT_OK(batch);
    ASSERT_OK(engine.SubmitTransfer(*batch, reqs));
    auto st = engine.WaitBatch(*batch, absl::Seconds(60));
    ASSERT_OK(st);
    ASSERT_EQ(st->state, TransferState::kCompleted) << st->first_error;
    ASSERT_OK(engine.FreeBatch(*batch));
    auto check = peers[p]->Ask(
        absl::StrCat("check ", off, " ", 2 << 20, " ", 500 + round));
    ASSERT_OK(check);
    EXPECT_EQ(*check, "OK") << round;
    EXPECT_EQ(CheckPattern(local.get() + off + (2 << 20), 2 << 20,
                           off + (2 << 20), 300 + p),
              size_t{2 << 20})
        << round;
  }
  const TransportStats st = engine.GetTransportStats()[0];
  EXPECT_GT(st.evictions, 0u);
  EXPECT_EQ(st.connect_failures, 0u);
}

TEST(E2eInitTest, MetadataServerUnreachable) {
  auto peer = Subprocess::Start(
      {RunfilePath("tests/engine_peer"), "--name=p", "--metadata=127.0.0.1:1"});
  ASSERT_OK(peer);
  auto line = (*peer)->ReadLine(absl::Seconds(15));
  ASSERT_OK(line);
  EXPECT_EQ(line->rfind("ERR ", 0), 0u) << *line;
  EXPECT_NE(line->find("127.0.0.1:1"), std::string::npos) << *line;
  auto code = (*peer)->Finish(absl::Seconds(10));
  ASSERT_OK(code);
  EXPECT_EQ(*code, 1);
}

}  // namespace
}  // namespace ferry
