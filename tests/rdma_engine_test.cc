// The engine over the RDMA transport on softrnic, two engines in one
// process with two soft NICs (softrnic0 on 127.0.0.1, softrnic1 on
// 127.0.0.2; softrnic_test_main sets that up): every byte verified.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/identity.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/pattern.h"
#include "common/sanitizers.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"
#include "metadata/metadata_client.h"
#include "metadata/peer_service.h"
#include "metadata/store_testing.h"
#include "transport/softrnic/softrnic_control.h"

namespace ferry {
namespace {

// Both engines register this much in every case's set-up; the largest
// transfers move 2/3 of it (under the sanitizers, a quarter of each).
constexpr size_t kBuffer = (96 << 20) / kSanitizerVolumeDivisor;
constexpr size_t kLarge = (64 << 20) / kSanitizerVolumeDivisor;

// Captures the log ("component: message" lines) through the host's sink
// while it lives. Thread-safe: the transport's threads log concurrently.
class LogCapture {
 public:
  LogCapture() {
    log::SetSink([this](log::Level, absl::string_view c, absl::string_view m) {
      MutexLock lock(&mu_);
      lines_.push_back(absl::StrCat(c, ": ", m));
    });
  }
  ~LogCapture() { log::SetSink(nullptr); }

  // Lines holding both `a` and `b`.
  int Count(absl::string_view a, absl::string_view b = "") const {
    MutexLock lock(&mu_);
    int n = 0;
    for (const std::string& l : lines_) {
      n += absl::StrContains(l, a) && absl::StrContains(l, b);
    }
    return n;
  }
  bool Has(absl::string_view a, absl::string_view b = "") const {
    return Count(a, b) > 0;
  }
  std::string All() const {
    MutexLock lock(&mu_);
    return absl::StrJoin(lines_, "\n");
  }

 private:
  mutable Mutex mu_;
  std::vector<std::string> lines_ ABSL_GUARDED_BY(mu_);
};

class RdmaEngineTest : public ::testing::Test {
 protected:
  // Tests may change these before SetUp runs.
  size_t max_endpoints_ = 4096;
  int worker_threads_ = 0;
  absl::Duration wait_spin_ = absl::Microseconds(50);
  std::vector<std::string> devices_;  // Empty: every NIC.
  int signal_every_ = 16;
  int inline_bytes_ = 64;
  size_t stripe_bytes_ = 1 << 20;

  void SetUp() override {
    EngineOptions t;
    t.local_segment_name = "target";
    t.transports = {"rdma"};
    t.transfer_timeout = absl::Seconds(20);
    t.rdma.max_endpoints = max_endpoints_;
    t.rdma.worker_threads = worker_threads_;
    t.wait_spin = wait_spin_;
    t.rdma.devices = devices_;
    t.rdma.signal_every = signal_every_;
    t.rdma.inline_bytes = inline_bytes_;
    t.rdma.stripe_bytes = stripe_bytes_;
    ASSERT_OK(target_.Init(t));
    EngineOptions i = t;
    i.local_segment_name = "initiator";
    i.metadata_endpoint = target_.metadata_address();
    absl::Status s = initiator_.Init(i);
    ASSERT_OK(s);
    remote_.reset(new uint8_t[kBuffer]);
    local_.reset(new uint8_t[kBuffer]);
    FillPattern(remote_.get(), kBuffer, 0, 11);
    std::memset(local_.get(), 0, kBuffer);
    ASSERT_OK(target_.RegisterLocalMemory(remote_.get(), kBuffer));
    ASSERT_OK(initiator_.RegisterLocalMemory(local_.get(), kBuffer));
    auto seg = initiator_.OpenSegment("target");
    ASSERT_OK(seg);
    seg_ = *seg;
  }

  TransferRequest Req(OpCode op, size_t off, size_t len) {
    TransferRequest r;
    r.opcode = op;
    r.source = local_.get() + off;
    r.target_id = seg_;
    r.target_offset = reinterpret_cast<uint64_t>(remote_.get()) + off;
    r.length = len;
    return r;
  }

  BatchStatus Run(const std::vector<TransferRequest>& reqs) {
    auto batch = initiator_.AllocateBatch(reqs.size());
    EXPECT_OK(batch);
    absl::Status s = initiator_.SubmitTransfer(*batch, reqs);
    EXPECT_OK(s);
    auto st = initiator_.WaitBatch(*batch, absl::Seconds(60));
    EXPECT_OK(st);
    EXPECT_OK(initiator_.FreeBatch(*batch));
    return st.ok() ? *st : BatchStatus{};
  }

  // Memory outlives the engines that may access it.
  std::unique_ptr<uint8_t[]> remote_, local_;
  TransferEngine target_, initiator_;
  SegmentHandle seg_ = 0;
};

TEST_F(RdmaEngineTest, ReadAndWriteMixedSizesEveryByteVerified) {
  const size_t sizes[] = {1,     7,       4096,          65535,
                          65537, 1 << 20, (8 << 20) + 3, kLarge};
  size_t off = 0;
  for (size_t len : sizes) {
    off = (off + 12345) % (kBuffer - len);
    BatchStatus st = Run({Req(OpCode::kRead, off, len)});
    ASSERT_EQ(st.state, TransferState::kCompleted) << len << st.first_error;
    ASSERT_EQ(CheckPattern(local_.get() + off, len, off, 11), len)
        << len << " transferred " << st.transferred_bytes;
    FillPattern(local_.get() + off, len, off, 77);
    st = Run({Req(OpCode::kWrite, off, len)});
    ASSERT_EQ(st.state, TransferState::kCompleted) << len << st.first_error;
    ASSERT_EQ(CheckPattern(remote_.get() + off, len, off, 77), len) << len;
    FillPattern(remote_.get() + off, len, off, 11);  // For the next READ.
  }
}

// A handshake or rail notice through Exchange must come from the segment
// it names: the live probe's spoofed ConnectRequest ("from B", with a
// made-up incarnation) cut B's rail for good. One signed with another key,
// or not at all, is refused before the rdma transport sees it, and the
// real initiator's rail still carries transfers.
TEST_F(RdmaEngineTest, SpoofedExchangesAreRefused) {
  metadata::MetadataClient md(target_.metadata_address(), absl::Seconds(3));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor td, md.Get("target"));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const IdentityKey> other,
                       IdentityKey::Generate());
  metadata::PeerClient unsigned_client(absl::Seconds(3));
  metadata::PeerClient wrong_key(
      absl::Seconds(3), metadata::PeerClient::kMaxStubs, "", nullptr, other);
  for (metadata::PeerClient* spoofer : {&wrong_key, &unsigned_client}) {
    auto r = spoofer->Exchange(td.rpc_address(), "rdma", "initiator", "x");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied)
        << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "exchange refused"))
        << r.status();
  }
  BatchStatus st = Run({Req(OpCode::kRead, 0, 4096)});
  EXPECT_EQ(st.state, TransferState::kCompleted);
}

// An Exchange is numbered inside what its sender signs, and each number
// is accepted once: one captured on the wire and sent again (a DISCONNECT
// would cut a rail) is refused, and so is one whose number was stripped
// (its signature no longer matches). The sender here is a segment whose
// key the test holds.
TEST_F(RdmaEngineTest, ReplayedExchangesAreRefused) {
  metadata::MetadataClient md(target_.metadata_address(), absl::Seconds(3));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const IdentityKey> key,
                       IdentityKey::Generate());
  descriptor::SegmentDescriptor sender =
      metadata::TestSegment("sender-x", 9, 0);
  sender.set_rpc_address("127.0.0.1:1");
  sender.set_identity_key(key->public_key());
  ASSERT_OK(md.Put(metadata::LeasedPutOf(sender)));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor td, md.Get("target"));
  metadata::ExchangeRequest req;
  req.set_transport("rdma");
  req.set_from_segment("sender-x");
  req.set_payload("not a handshake");
  req.set_seq(12345);
  ASSERT_OK_AND_ASSIGN(std::string sig,
                       key->Sign(metadata::ExchangeContent(req)));
  req.set_signature(sig);
  auto stub = metadata::PeerService::NewStub(grpc::CreateChannel(
      td.rpc_address(), grpc::InsecureChannelCredentials()));
  auto send = [&](const metadata::ExchangeRequest& r) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    metadata::ExchangeResponse resp;
    return stub->Exchange(&ctx, r, &resp);
  };
  // Checked and taken (its number is used); the transport then refuses
  // what it says, which is no handshake.
  grpc::Status first = send(req);
  EXPECT_FALSE(absl::StrContains(first.error_message(), "exchange refused"))
      << first.error_message();
  grpc::Status again = send(req);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << again.error_message();
  EXPECT_TRUE(absl::StrContains(again.error_message(), "exchange refused"))
      << again.error_message();
  metadata::ExchangeRequest stripped = req;
  stripped.set_seq(0);
  // Refused for good, or "try again" where the refusal rests on a key read
  // a moment before (the segment might have just restarted): either way
  // the signature does not match.
  grpc::Status unnumbered = send(stripped);
  EXPECT_FALSE(unnumbered.ok());
  EXPECT_TRUE(
      absl::StrContains(unnumbered.error_message(), "signature does not match"))
      << unnumbered.error_message();
}

// In P2PHANDSHAKE mode there is no metadata service to ask, and Exchanges
// went unchecked: anyone could send a ConnectRequest or DISCONNECT in a
// peer's name. Now the claimed address is read for the key that must sign
// it: a spoofer (another key, or none) is refused, and the real handshake
// still goes through.
TEST(RdmaP2pTest, ExchangesAreVerifiedByTheSendersKey) {
  EngineOptions o;
  o.metadata_endpoint = "P2PHANDSHAKE";
  o.listen_host = "127.0.0.1";
  o.transports = {"rdma"};
  o.transfer_timeout = absl::Seconds(20);
  constexpr size_t kBytes = 64 << 10;
  std::vector<uint8_t> remote(kBytes), local(kBytes);
  FillPattern(remote.data(), kBytes, 0, 3);
  TransferEngine target, initiator;
  ASSERT_OK(target.Init(o));
  ASSERT_OK(initiator.Init(o));
  ASSERT_OK(target.RegisterLocalMemory(remote.data(), kBytes));
  ASSERT_OK(initiator.RegisterLocalMemory(local.data(), kBytes));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h,
                       initiator.OpenSegment(target.local_segment_name()));
  auto read = [&] {
    std::fill(local.begin(), local.end(), 0);
    TransferRequest r;
    r.opcode = OpCode::kRead;
    r.source = local.data();
    r.target_id = h;
    r.target_offset = reinterpret_cast<uint64_t>(remote.data());
    r.length = kBytes;
    auto batch = initiator.AllocateBatch(1);
    EXPECT_OK(batch);
    EXPECT_OK(initiator.SubmitTransfer(*batch, {r}));
    auto st = initiator.WaitBatch(*batch, absl::Seconds(30));
    EXPECT_OK(st);
    EXPECT_OK(initiator.FreeBatch(*batch));
    EXPECT_EQ(st.ok() ? st->state : TransferState::kFailed,
              TransferState::kCompleted);
    EXPECT_EQ(CheckPattern(local.data(), kBytes, 0, 3), kBytes);
  };
  read();
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const IdentityKey> other,
                       IdentityKey::Generate());
  metadata::PeerClient unsigned_client(absl::Seconds(3));
  metadata::PeerClient wrong_key(
      absl::Seconds(3), metadata::PeerClient::kMaxStubs, "", nullptr, other);
  for (metadata::PeerClient* spoofer : {&wrong_key, &unsigned_client}) {
    auto r = spoofer->Exchange(target.local_segment_name(), "rdma",
                               initiator.local_segment_name(), "x");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied)
        << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "exchange refused"))
        << r.status();
  }
  read();
}

TEST_F(RdmaEngineTest, ManyRequestsPerBatch) {
  std::vector<TransferRequest> reqs;
  const size_t kBlock = 100 * 1000 / kSanitizerVolumeDivisor;
  for (size_t i = 0; i < 300; ++i) {
    reqs.push_back(
        Req(i % 2 ? OpCode::kRead : OpCode::kWrite, i * kBlock, kBlock));
    if (i % 2 == 0)
      FillPattern(local_.get() + i * kBlock, kBlock, i * kBlock, 5);
  }
  BatchStatus st = Run(reqs);
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  for (size_t i = 0; i < 300; ++i) {
    const uint8_t* p = i % 2 ? local_.get() : remote_.get();
    ASSERT_EQ(CheckPattern(p + i * kBlock, kBlock, i * kBlock, i % 2 ? 11 : 5),
              kBlock)
        << i;
  }
}

TEST_F(RdmaEngineTest, NicDownMidTransferCompletesOverTheOther) {
  FillPattern(local_.get(), kLarge, 0, 99);
  auto batch = initiator_.AllocateBatch(1);
  ASSERT_OK(batch);
  ASSERT_OK(
      initiator_.SubmitTransfer(*batch, {Req(OpCode::kWrite, 0, kLarge)}));
  // Take one NIC down while its slices are in flight.
  ASSERT_EQ(softrnic::SetLink("softrnic1", false), 0);
  auto st = initiator_.WaitBatch(*batch, absl::Seconds(60));
  ASSERT_EQ(softrnic::SetLink("softrnic1", true), 0);
  ASSERT_OK(st);
  ASSERT_EQ(st->state, TransferState::kCompleted) << st->first_error;
  EXPECT_EQ(CheckPattern(remote_.get(), kLarge, 0, 99), kLarge);
  ASSERT_OK(initiator_.FreeBatch(*batch));
}

TEST_F(RdmaEngineTest, RemoteRangeOutsideRegisteredMemoryIsRefused) {
  auto batch = initiator_.AllocateBatch(1);
  ASSERT_OK(batch);
  TransferRequest r = Req(OpCode::kWrite, 0, 4096);
  r.target_offset = reinterpret_cast<uint64_t>(remote_.get()) + kBuffer - 100;
  // Accepted; refused once a fresh descriptor confirms it (SubmitTransfer
  // never waits for one).
  ASSERT_OK(initiator_.SubmitTransfer(*batch, {r}));
  auto st = initiator_.WaitBatch(*batch, absl::Seconds(10));
  ASSERT_OK(st);
  EXPECT_EQ(st->state, TransferState::kFailed);
  EXPECT_STATUS(st->first_error, absl::StatusCode::kInvalidArgument);
  ASSERT_OK(initiator_.FreeBatch(*batch));
}

// A batch large enough to register on several threads (the pinning runs
// in parallel) is still all or nothing: a buffer the NICs cannot pin
// (PROT_NONE, EFAULT from ibv_reg_mr) fails the batch naming it, and the
// others -- pinned meanwhile on other threads -- are left unregistered.
TEST_F(RdmaEngineTest, ALargeBatchIsPinnedInParallelAllOrNothing) {
  constexpr size_t kPiece = 80 << 20;  // 4 x 80 MiB: past 256 MiB.
  constexpr int kPieces = 4;
  void* mem = mmap(nullptr, kPiece * kPieces, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* base = static_cast<uint8_t*>(mem);
  std::vector<BufferEntry> entries;
  for (int i = 0; i < kPieces; ++i) {
    entries.push_back(BufferEntry{base + i * kPiece, kPiece});
  }
  ASSERT_EQ(mprotect(base + 2 * kPiece, kPiece, PROT_NONE), 0);
  absl::Status s = target_.RegisterLocalMemoryBatch(entries);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("buffer 2 of 4"), std::string::npos) << s;
  // Nothing of the batch stayed: each piece registers again on its own.
  for (int i : {0, 1, 3}) {
    ASSERT_OK(target_.RegisterLocalMemory(entries[i].addr, kPiece)) << i;
    ASSERT_OK(target_.UnregisterLocalMemory(entries[i].addr)) << i;
  }
  ASSERT_EQ(mprotect(base + 2 * kPiece, kPiece, PROT_READ | PROT_WRITE), 0);
  ASSERT_OK(target_.RegisterLocalMemoryBatch(entries));
  // Every piece is usable by a peer: read the start of the last one.
  FillPattern(base + 3 * kPiece, 4096, 0, 31);
  TransferRequest r = Req(OpCode::kRead, 0, 4096);
  r.target_offset = reinterpret_cast<uint64_t>(base + 3 * kPiece);
  BatchStatus st = Run({r});
  EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(CheckPattern(local_.get(), 4096, 0, 31), 4096u);
  std::vector<void*> addrs;
  for (const BufferEntry& e : entries) addrs.push_back(e.addr);
  ASSERT_OK(target_.UnregisterLocalMemoryBatch(addrs));
  munmap(mem, kPiece * kPieces);
}

TEST(RdmaTopologyTest, PriorityMatrixIsValidated) {
  TransferEngine bad;
  EngineOptions o;
  o.local_segment_name = "t";
  o.transports = {"rdma"};
  o.rdma.topology_json = R"({"cpu:0": [["no-such-nic"]]})";
  absl::Status s = bad.Init(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("no-such-nic"), std::string::npos) << s;

  // That a valid matrix steers slices is RdmaEndpointTest's
  // RailChoiceFollowsTheTopology (rdma_endpoint_test.cc).
}

// No application-side polling (wait_spin 0: WaitBatch blocks at once) and
// one worker thread for both NICs: that worker alone must reap every
// completion of both CQs.
class OneWorkerTest : public RdmaEngineTest {
 protected:
  void SetUp() override {
    worker_threads_ = 1;
    wait_spin_ = absl::ZeroDuration();
    RdmaEngineTest::SetUp();
  }
};

TEST_F(OneWorkerTest, ServesBothNicsWithoutApplicationPolling) {
  std::vector<TransferRequest> reqs;
  const size_t kBlock = 256 * 1024 + 3;
  for (size_t i = 0; i < 64; ++i) {
    FillPattern(local_.get() + i * kBlock, kBlock, i * kBlock, 41);
    reqs.push_back(Req(OpCode::kWrite, i * kBlock, kBlock));
  }
  BatchStatus st = Run(reqs);
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  ASSERT_EQ(CheckPattern(remote_.get(), 64 * kBlock, 0, 41), 64 * kBlock);
  // Both NICs carried slices.
  auto nics = initiator_.GetTransportStats()[0].nics;
  ASSERT_EQ(nics.size(), 2u);
  EXPECT_GT(nics[0].slices, 0u);
  EXPECT_GT(nics[1].slices, 0u);
}

// One NIC on each side, so one rail: a request's slices reach its
// endpoint one after another and are posted as shared work requests (up to
// 16 slices, 1 MiB each): fewer WRs than slices, and every byte where it
// belongs. (Over several rails slices alternate, and each is its own WR.)
class OneRailTest : public RdmaEngineTest {
 protected:
  void SetUp() override {
    devices_ = {"softrnic0"};
    RdmaEngineTest::SetUp();
  }
};

TEST_F(OneRailTest, AdjacentSlicesShareWorkRequests) {
  constexpr size_t kBlock = 4 << 20;  // 64 slices of 64 KiB.
  FillPattern(local_.get(), kBlock, 0, 77);
  BatchStatus st = Run({Req(OpCode::kWrite, 0, kBlock)});
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  ASSERT_EQ(CheckPattern(remote_.get(), kBlock, 0, 77), kBlock);
  // READ it back in two adjacent requests of one batch (coalescing across
  // requests, too).
  std::memset(local_.get(), 0, kBlock);
  st = Run({Req(OpCode::kRead, 0, kBlock / 2),
            Req(OpCode::kRead, kBlock / 2, kBlock / 2)});
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  ASSERT_EQ(CheckPattern(local_.get(), kBlock, 0, 77), kBlock);
  uint64_t slices = 0, wrs = 0;
  const std::vector<TransportStats> stats = initiator_.GetTransportStats();
  for (const NicStats& n : stats[0].nics) {
    slices += n.slices;
    wrs += n.work_requests;
  }
  EXPECT_GE(slices, 2 * kBlock / (64 << 10));
  EXPECT_LT(wrs * 4, slices)
      << wrs << " work requests for " << slices << " slices";
}

// Two NICs on each side (four rails). A request's slices ride one rail a
// stripe (rdma.stripe_bytes, 1 MiB) at a time, so they still share work
// requests, and the stripes of a larger request spread over both NICs; a
// request of one stripe stays on one NIC. stripe_bytes 0 spreads slice by
// slice (a WR each: consecutive slices never share a rail).
class StripeTest : public RdmaEngineTest,
                   public ::testing::WithParamInterface<size_t> {
 protected:
  void SetUp() override {
    stripe_bytes_ = GetParam();
    RdmaEngineTest::SetUp();
  }

  struct Counts {
    std::vector<uint64_t> slices;  // Per NIC.
    uint64_t wrs = 0;
  };
  Counts Now() {
    Counts c;
    const std::vector<TransportStats> stats = initiator_.GetTransportStats();
    for (const NicStats& n : stats[0].nics) {
      c.slices.push_back(n.slices);
      c.wrs += n.work_requests;
    }
    return c;
  }
};

TEST_P(StripeTest, StripesCoalesceAndSpreadOverNics) {
  ASSERT_EQ(Run({Req(OpCode::kWrite, 0, 64)}).state, TransferState::kCompleted);
  constexpr size_t kBlock = 8 << 20;  // 128 slices of 64 KiB.
  FillPattern(local_.get(), kBlock, 0, 31);
  const Counts before = Now();
  BatchStatus st = Run({Req(OpCode::kWrite, 0, kBlock)});
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  ASSERT_EQ(CheckPattern(remote_.get(), kBlock, 0, 31), kBlock);
  const Counts after = Now();
  ASSERT_EQ(after.slices.size(), 2u);
  uint64_t slices = 0;
  for (size_t i = 0; i < 2; ++i) {
    const uint64_t n = after.slices[i] - before.slices[i];
    EXPECT_GT(n, 0u) << "NIC " << i << " carried no slice";
    slices += n;
  }
  const uint64_t wrs = after.wrs - before.wrs;
  ASSERT_GE(slices, kBlock / (64 << 10));
  if (GetParam() == 0) {
    EXPECT_GT(wrs * 2, slices) << wrs << " work requests, " << slices
                               << " slices, spread slice by slice";
  } else {
    EXPECT_LT(wrs * 4, slices) << wrs << " work requests, " << slices
                               << " slices, in stripes of " << GetParam();
    // One stripe's worth: one NIC.
    FillPattern(local_.get(), 1 << 20, 0, 32);
    const Counts one_before = Now();
    st = Run({Req(OpCode::kWrite, 0, 1 << 20)});
    ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
    ASSERT_EQ(CheckPattern(remote_.get(), 1 << 20, 0, 32), size_t{1} << 20);
    const Counts one_after = Now();
    int nics_used = 0;
    for (size_t i = 0; i < 2; ++i) {
      nics_used += one_after.slices[i] > one_before.slices[i];
    }
    EXPECT_EQ(nics_used, 1) << "a request of one stripe split over NICs";
  }
}

INSTANTIATE_TEST_SUITE_P(Stripes, StripeTest,
                         ::testing::Values(size_t{0}, size_t{1} << 20));

TEST(StripeOptionTest, AboveOneGibIsRefused) {
  EngineOptions o;
  o.local_segment_name = "stripes";
  o.transports = {"rdma"};
  o.rdma.stripe_bytes = size_t{2} << 30;
  TransferEngine e;
  const absl::Status s = e.Init(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("rdma.stripe_bytes"), std::string::npos) << s;
}

// Selective signaling and inline data are options (RdmaOptions::
// signal_every, inline_bytes): whatever their values, every byte lands, and
// completions follow the signaling interval (one per WR at 1, fewer at
// 16). Non-adjacent requests keep every slice its own WR.
struct PostingCase {
  int signal_every;
  int inline_bytes;
};

class PostingTest : public RdmaEngineTest,
                    public ::testing::WithParamInterface<PostingCase> {
 protected:
  void SetUp() override {
    devices_ = {"softrnic0"};
    signal_every_ = GetParam().signal_every;
    // Above the device's limit (softrnic: 256 B, 32 B in roce-1500) the
    // QP still comes up, with what the device allows.
    inline_bytes_ = GetParam().inline_bytes;
    RdmaEngineTest::SetUp();
  }

  // The initiator's work requests and completions so far.
  std::pair<uint64_t, uint64_t> Counters() {
    const NicStats n = initiator_.GetTransportStats()[0].nics[0];
    return {n.work_requests, n.completions};
  }
};

TEST_P(PostingTest, EveryByteLandsAndCompletionsFollowTheInterval) {
  // Warm up: the endpoint is connected before counting.
  ASSERT_EQ(Run({Req(OpCode::kWrite, 0, 64)}).state, TransferState::kCompleted);
  for (size_t len : {size_t{8}, size_t{64}, size_t{200}, size_t{4096}}) {
    SCOPED_TRACE(len);
    constexpr size_t kRequests = 96;
    const size_t stride = 2 * len + 8;  // Gaps: nothing coalesces.
    std::vector<TransferRequest> reqs;
    for (size_t i = 0; i < kRequests; ++i) {
      FillPattern(local_.get() + i * stride, len, i * stride, 7 + len);
      reqs.push_back(Req(OpCode::kWrite, i * stride, len));
    }
    const auto [wrs0, cqes0] = Counters();
    BatchStatus st = Run(reqs);
    ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
    const auto [wrs1, cqes1] = Counters();
    for (size_t i = 0; i < kRequests; ++i) {
      ASSERT_EQ(
          CheckPattern(remote_.get() + i * stride, len, i * stride, 7 + len),
          len)
          << "request " << i;
    }
    // READ them back over a cleared buffer.
    std::memset(local_.get(), 0, kRequests * stride);
    for (TransferRequest& r : reqs) r.opcode = OpCode::kRead;
    st = Run(reqs);
    ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
    for (size_t i = 0; i < kRequests; ++i) {
      ASSERT_EQ(
          CheckPattern(local_.get() + i * stride, len, i * stride, 7 + len),
          len)
          << "request " << i;
    }
    const uint64_t wrs = wrs1 - wrs0, cqes = cqes1 - cqes0;
    EXPECT_GE(wrs, kRequests);
    if (GetParam().signal_every == 1) {
      // A keepalive probe may add one.
      EXPECT_GE(cqes, wrs);
      EXPECT_LE(cqes, wrs + 2);
    } else {
      EXPECT_LT(cqes, wrs);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Options, PostingTest,
                         ::testing::Values(PostingCase{1, 0},
                                           PostingCase{16, 64},
                                           PostingCase{32, 1024},
                                           PostingCase{7, 200}),
                         [](const ::testing::TestParamInfo<PostingCase>& i) {
                           return absl::StrCat("signal", i.param.signal_every,
                                               "_inline", i.param.inline_bytes);
                         });

class TinyEndpointStoreTest : public RdmaEngineTest {
 protected:
  void SetUp() override {
    max_endpoints_ = 1;  // Four rails (2 x 2 NICs) share one slot.
    RdmaEngineTest::SetUp();
  }
};

// With room for one endpoint, alternating between two targets keeps
// creating endpoints: idle ones are evicted (and reconnected when needed
// again), busy ones never, and no transfer loses a byte.
TEST_F(TinyEndpointStoreTest, EvictionNeverLosesInFlightWork) {
  std::unique_ptr<uint8_t[]> remote2(new uint8_t[16 << 20]);
  TransferEngine second;
  EngineOptions o;
  o.local_segment_name = "target2";
  o.transports = {"rdma"};
  o.metadata_endpoint = target_.metadata_address();
  ASSERT_OK(second.Init(o));
  ASSERT_OK(second.RegisterLocalMemory(remote2.get(), 16 << 20));
  auto seg2 = initiator_.OpenSegment("target2");
  ASSERT_OK(seg2);
  for (int round = 0; round < 6; ++round) {
    const bool to_second = round % 2 == 1;
    const size_t off = static_cast<size_t>(round / 2) * (4 << 20);
    FillPattern(local_.get() + off, 4 << 20, off, 100 + round);
    std::vector<TransferRequest> reqs;
    for (int i = 0; i < 4; ++i) {
      TransferRequest r = Req(OpCode::kWrite, off + i * (1 << 20), 1 << 20);
      if (to_second) {
        r.target_id = *seg2;
        r.target_offset =
            reinterpret_cast<uint64_t>(remote2.get()) + off + i * (1 << 20);
      }
      reqs.push_back(r);
    }
    BatchStatus st = Run(reqs);
    ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
    const uint8_t* dst = to_second ? remote2.get() : remote_.get();
    ASSERT_EQ(CheckPattern(dst + off, 4 << 20, off, 100 + round),
              size_t{4 << 20})
        << round;
  }
}

// One WRITE of `local` to `remote` (registered on both sides) in a batch
// of its own; the batch's status once it ended.
absl::StatusOr<BatchStatus> WriteOnce(TransferEngine& initiator,
                                      const std::string& target,
                                      const std::vector<uint8_t>& local,
                                      const std::vector<uint8_t>& remote) {
  auto seg = initiator.OpenSegment(target);
  if (!seg.ok()) return seg.status();
  auto batch = initiator.AllocateBatch(1);
  if (!batch.ok()) return batch.status();
  TransferRequest r;
  r.opcode = OpCode::kWrite;
  r.source = const_cast<uint8_t*>(local.data());
  r.target_id = *seg;
  r.target_offset = reinterpret_cast<uint64_t>(remote.data());
  r.length = local.size();
  if (absl::Status s = initiator.SubmitTransfer(*batch, {r}); !s.ok()) {
    return s;
  }
  auto st = initiator.WaitBatch(*batch, absl::Seconds(20));
  if (absl::Status s = initiator.FreeBatch(*batch); st.ok() && !s.ok()) {
    return s;
  }
  return st;
}

// On a RoCE NIC's GID table (link-local and RoCE v1 entries first; the
// "roce-1500" profile), Ferry picks the IPv4-mapped RoCE v2 entry by type
// and reaches a peer pinned to it (rdma.gid_index, as MC_GID_INDEX pins
// Mooncake). Picking by address alone takes the RoCE v1 twin, whose packets
// a v2 QP drops: every request would time out.
TEST(RdmaGidTest, PicksRoceV2ByTypeAndReachesAV2Peer) {
  const char* profile = std::getenv("FERRY_SOFTRNIC_PROFILE");
  if (profile == nullptr || std::string(profile) == "softrnic" ||
      std::string(profile) == "mlx5-ib") {
    GTEST_SKIP() << "needs a RoCE NIC's GID table (roce-1500, cx5-roce)";
  }
  EngineOptions t;
  t.local_segment_name = "v2-target";
  t.transports = {"rdma"};
  t.rdma.gid_index = 3;  // IPv4-mapped RoCE v2, set by hand.
  t.transfer_timeout = absl::Seconds(5);
  TransferEngine target, initiator;
  ASSERT_OK(target.Init(t));
  EngineOptions i = t;
  i.local_segment_name = "picking-initiator";
  i.metadata_endpoint = target.metadata_address();
  i.rdma.gid_index = -1;  // Ferry's own choice.
  ASSERT_OK(initiator.Init(i));
  std::vector<uint8_t> remote(1 << 20, 0), local(1 << 20);
  FillPattern(local.data(), local.size(), 0, 5);
  ASSERT_OK(target.RegisterLocalMemory(remote.data(), remote.size()));
  ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size()));
  ASSERT_OK_AND_ASSIGN(BatchStatus st,
                       WriteOnce(initiator, "v2-target", local, remote));
  EXPECT_EQ(st.completed, 1u) << st.first_error;
  EXPECT_EQ(remote, local);
}

// A pinned GID index is checked at Init: one past the table fails naming
// the index and the table's size (where it would otherwise show only as
// connections that never come up); a RoCE v1 entry is used, and the log
// says what it reaches.
TEST(RdmaGidTest, PinnedIndexIsCheckedAndExplained) {
  const char* profile = std::getenv("FERRY_SOFTRNIC_PROFILE");
  if (profile == nullptr || std::string(profile) == "softrnic" ||
      std::string(profile) == "mlx5-ib") {
    GTEST_SKIP() << "needs a RoCE NIC's GID table (roce-1500, cx5-roce)";
  }
  EngineOptions o;
  o.local_segment_name = "pinned";
  o.listen_host = "127.0.0.1";
  o.transports = {"rdma"};
  o.rdma.gid_index = 99;
  {
    TransferEngine e;
    absl::Status s = e.Init(o);
    EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("no GID index 99 (port 1 has 4 entries"),
              std::string::npos)
        << s;
  }
  LogCapture log;
  o.rdma.gid_index = 2;  // IPv4-mapped RoCE v1.
  {
    TransferEngine e;
    EXPECT_OK(e.Init(o));
  }
  EXPECT_TRUE(
      log.Has("GID index 2 (index 2 as configured, a RoCE v1 entry: "
              "it reaches only peers that also use RoCE v1"))
      << log.All();
}

// rdma.fork_safe calls ibv_fork_init before any registration; out of
// range addressing options are refused at Init, naming them.
TEST(RdmaOptionsTest, ForkSafeAndAddressingOptions) {
  EngineOptions o;
  o.local_segment_name = "opts";
  o.listen_host = "127.0.0.1";
  o.transports = {"rdma"};
  o.rdma.fork_safe = true;
  {
    TransferEngine e;
    ASSERT_OK(e.Init(o));
    std::vector<uint8_t> mem(1 << 16);
    EXPECT_OK(e.RegisterLocalMemory(mem.data(), mem.size()));
    EXPECT_OK(e.UnregisterLocalMemory(mem.data()));
  }
  for (auto spoil : std::vector<std::function<void(RdmaOptions*)>>{
           [](RdmaOptions* r) { r->traffic_class = 256; },
           [](RdmaOptions* r) { r->service_level = 16; },
           [](RdmaOptions* r) { r->hop_limit = 0; },
           [](RdmaOptions* r) { r->flow_label = 1 << 20; }}) {
    EngineOptions bad = o;
    spoil(&bad.rdma);
    TransferEngine e;
    absl::Status s = e.Init(bad);
    EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("rdma.traffic_class"), std::string::npos) << s;
  }
  for (auto [spoil, name] :
       std::vector<std::pair<std::function<void(RdmaOptions*)>, std::string>>{
           {[](RdmaOptions* r) { r->signal_every = 0; }, "rdma.signal_every"},
           {[](RdmaOptions* r) { r->signal_every = 33; }, "rdma.signal_every"},
           {[](RdmaOptions* r) { r->inline_bytes = -1; }, "rdma.inline_bytes"},
           {[](RdmaOptions* r) { r->inline_bytes = 1025; },
            "rdma.inline_bytes"}}) {
    EngineOptions bad = o;
    spoil(&bad.rdma);
    TransferEngine e;
    absl::Status s = e.Init(bad);
    EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(name), std::string::npos) << s;
  }
}

// What an operator needs is logged, through the host's sink when it sets
// one: the configuration at Init, connects with their rail, and a port
// going down with what happens to its slices.
TEST(RdmaLogTest, InitConnectsAndPortEventsAreLogged) {
  LogCapture log;
  {
    EngineOptions t;
    t.local_segment_name = "logged";
    t.listen_host = "127.0.0.1";
    t.transports = {"rdma"};
    TransferEngine target, initiator;
    ASSERT_OK(target.Init(t));
    EngineOptions i = t;
    i.local_segment_name = "logger";
    i.metadata_endpoint = target.metadata_address();
    ASSERT_OK(initiator.Init(i));
    std::vector<uint8_t> remote(1 << 20), local(1 << 20, 3);
    ASSERT_OK(target.RegisterLocalMemory(remote.data(), remote.size()));
    ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size()));
    ASSERT_OK_AND_ASSIGN(BatchStatus st,
                         WriteOnce(initiator, "logged", local, remote));
    EXPECT_EQ(st.completed, 1u) << st.first_error;
    ASSERT_EQ(softrnic::SetLink("softrnic1", false), 0);
    // The async event's thread logs it: wait for the line (up to 10 s), as
    // a fixed sleep can end first on a loaded machine.
    for (int k = 0; k < 200; ++k) {
      if (log.Has("rdma: port of softrnic1", "down")) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_EQ(softrnic::SetLink("softrnic1", true), 0);
  }
  EXPECT_TRUE(log.Has("engine: segment 'logged' up", "advertising 127.0.0.1"))
      << log.All();
  EXPECT_TRUE(log.Has("rdma: connected to 'logged' on softrnic", "QPs"))
      << log.All();
  // Each NIC's port, MTU and GID at Init, and the MTU a connection runs at.
  EXPECT_TRUE(log.Has("rdma: softrnic0: ", ", active MTU ")) << log.All();
  EXPECT_TRUE(log.Has("rdma: softrnic0: ", ", GID index ")) << log.All();
  EXPECT_TRUE(log.Has("rdma: connected to 'logged'", ", path MTU "))
      << log.All();
  EXPECT_TRUE(log.Has("rdma: port of softrnic1", "down")) << log.All();
}

// A NIC whose port is down at Init is left out for the run, and says so
// once, so that an operator knows why a rail carries nothing.
TEST(RdmaLogTest, NicDownAtInitIsLogged) {
  LogCapture log;
  ASSERT_EQ(softrnic::SetLink("softrnic1", false), 0);
  {
    EngineOptions o;
    o.local_segment_name = "half";
    o.listen_host = "127.0.0.1";
    o.transports = {"rdma"};
    TransferEngine e;
    EXPECT_OK(e.Init(o));
  }
  ASSERT_EQ(softrnic::SetLink("softrnic1", true), 0);
  EXPECT_EQ(log.Count("rdma: not using a NIC: softrnic1 port 1 is not ACTIVE",
                      "until the engine restarts"),
            1)
      << log.All();
}

}  // namespace
}  // namespace ferry
