// The RDMA transport's endpoints and memory under stress, engines in one
// process on softrnic (softrnic_test_main: softrnic0 on 127.0.0.1,
// softrnic1 on 127.0.0.2), every byte verified, no sleeps ordering events
// (conditions are awaited with a deadline):
//   - simultaneous connects from both sides resolve to one endpoint;
//   - the endpoint store bounds the endpoints a target accepts, evicting
//     idle ones without losing work;
//   - rail choice follows the topology, observed through the per-NIC stats;
//   - handshakes to a dead peer back off instead of storming;
//   - registering and unregistering while transfers run: local buffers wait
//     for their transfers, remote buffers are never written after their
//     unregistration returned, and stale descriptors are refreshed.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "absl/synchronization/notification.h"
#include "common/pattern.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"
#include "testing/process_usage.h"

namespace ferry {
namespace {

using ::ferry::testing::WaitUntil;

constexpr size_t kBuffer = 8 << 20;

// An engine with one remote-accessible buffer.
struct Node {
  // Memory first: it outlives the engine, whose peers may access it until
  // the engine has shut down.
  std::unique_ptr<uint8_t[]> mem{new uint8_t[kBuffer]};
  TransferEngine engine;

  absl::Status Start(const std::string& name, const std::string& metadata,
                     EngineOptions o = {}) {
    o.local_segment_name = name;
    o.metadata_endpoint = metadata;
    o.transports = {"rdma"};
    o.transfer_timeout = absl::Seconds(20);
    if (absl::Status s = engine.Init(o); !s.ok()) return s;
    std::memset(mem.get(), 0, kBuffer);
    return engine.RegisterLocalMemory(mem.get(), kBuffer);
  }
  uint64_t addr(size_t off = 0) const {
    return reinterpret_cast<uint64_t>(mem.get()) + off;
  }
  const TransportStats stats() const {
    auto all = engine.GetTransportStats();
    return all.empty() ? TransportStats{} : all[0];
  }
};

// Polls `cond` (which the transports' threads make true) until it holds or
// `timeout` passes.
// `n` WRITEs of `each` bytes: source + i * each -> dst + i * each on `seg`.
std::vector<TransferRequest> Writes(const uint8_t* source, SegmentHandle seg,
                                    uint64_t dst, size_t each, int n = 1) {
  std::vector<TransferRequest> reqs(n);
  for (int i = 0; i < n; ++i) {
    reqs[i].opcode = OpCode::kWrite;
    reqs[i].source = const_cast<uint8_t*>(source) + i * each;
    reqs[i].target_id = seg;
    reqs[i].target_offset = dst + i * each;
    reqs[i].length = each;
  }
  return reqs;
}

// Runs `reqs` as one batch (allocate, submit, wait, free) and returns its
// status; an error if it could not be submitted or waited for.
absl::StatusOr<BatchStatus> RunBatch(TransferEngine& e,
                                     const std::vector<TransferRequest>& reqs) {
  auto batch = e.AllocateBatch(reqs.size());
  if (!batch.ok()) return batch.status();
  absl::Status submitted = e.SubmitTransfer(*batch, reqs);
  absl::StatusOr<BatchStatus> st =
      submitted.ok() ? e.WaitBatch(*batch, absl::Seconds(60)) : submitted;
  if (absl::Status s = e.FreeBatch(*batch); !s.ok() && st.ok()) st = s;
  return st;
}

// Writes [off, off + len) of `from`'s buffer to the same range of `to`'s,
// as `n` requests in one batch; returns the batch's status.
BatchStatus Write(Node* from, SegmentHandle to, const Node& target, size_t off,
                  size_t len, int n = 1) {
  auto st = RunBatch(from->engine, Writes(from->mem.get() + off, to,
                                          target.addr(off), len / n, n));
  return st.ok() ? *st : BatchStatus{};
}

TEST(RdmaEndpointTest, SimultaneousConnectsResolveToOneEndpoint) {
  // One NIC each, so there is one rail: both engines need it at the same
  // moment. Whichever way each round goes, the rail ends up with exactly
  // one connection, used by both directions.
  uint64_t races = 0;
  for (int round = 0; round < 12; ++round) {
    SCOPED_TRACE(round);
    EngineOptions o;
    o.rdma.devices = {"softrnic0"};
    Node a, b;
    ASSERT_OK(a.Start("a", "embedded", o));
    ASSERT_OK(b.Start("b", a.engine.metadata_address(), o));
    auto to_b = a.engine.OpenSegment("b");
    auto to_a = b.engine.OpenSegment("a");
    ASSERT_TRUE(to_b.ok() && to_a.ok());
    FillPattern(a.mem.get(), kBuffer / 2, 0, 10 + round);
    FillPattern(b.mem.get() + kBuffer / 2, kBuffer / 2, kBuffer / 2,
                20 + round);
    absl::Barrier* start = new absl::Barrier(2);
    BatchStatus from_a, from_b;
    std::thread ta([&] {
      if (start->Block()) delete start;
      from_a = Write(&a, *to_b, b, 0, kBuffer / 2, 8);
    });
    std::thread tb([&] {
      if (start->Block()) delete start;
      from_b = Write(&b, *to_a, a, kBuffer / 2, kBuffer / 2, 8);
    });
    ta.join();
    tb.join();
    ASSERT_EQ(from_a.state, TransferState::kCompleted) << from_a.first_error;
    ASSERT_EQ(from_b.state, TransferState::kCompleted) << from_b.first_error;
    ASSERT_EQ(CheckPattern(b.mem.get(), kBuffer / 2, 0, 10 + round),
              kBuffer / 2);
    ASSERT_EQ(CheckPattern(a.mem.get() + kBuffer / 2, kBuffer / 2, kBuffer / 2,
                           20 + round),
              kBuffer / 2);
    const TransportStats sa = a.stats(), sb = b.stats();
    EXPECT_EQ(sa.endpoints, 1u);
    EXPECT_EQ(sb.endpoints, 1u);
    // One side accepted the other's connect, once: one connection.
    EXPECT_EQ(sa.connects_accepted + sb.connects_accepted, 1u);
    EXPECT_EQ(sa.connect_failures + sb.connect_failures, 0u);
    races += sa.connect_races + sb.connect_races;
  }
  // The rounds start both sides together, so connects do cross; were they
  // all serialized, this test would not have exercised the tie-break.
  EXPECT_GT(races, 0u);
}

TEST(RdmaEndpointTest, TransfersToItsOwnSegmentWork) {
  // An engine opening its own segment connects to itself: the accepting
  // end must be a separate endpoint (adopting would join a QP to itself).
  for (int nics : {1, 2}) {
    SCOPED_TRACE(nics);
    EngineOptions o;
    if (nics == 1) o.rdma.devices = {"softrnic0"};
    Node self;
    ASSERT_OK(self.Start("self", "embedded", o));
    auto seg = self.engine.OpenSegment("self");
    ASSERT_OK(seg);
    FillPattern(self.mem.get(), kBuffer / 2, 0, 60 + nics);
    // The first half onto the second half of the same buffer.
    auto st = RunBatch(
        self.engine,
        Writes(self.mem.get(), *seg, self.addr(kBuffer / 2), kBuffer / 8, 4));
    ASSERT_OK(st);
    EXPECT_EQ(st->state, TransferState::kCompleted) << st->first_error;
    EXPECT_EQ(
        CheckPattern(self.mem.get() + kBuffer / 2, kBuffer / 2, 0, 60 + nics),
        kBuffer / 2);
  }
}

// Whether any byte of [p, p + len) lies in memory registered with `e`:
// registering its pages is refused as overlapping exactly then (else the
// probe registers and unregisters them again).

TEST(RdmaEndpointTest, MrCacheRegistersSourcesOnEveryNicAndEvicts) {
  // Unregistered sources under the MR cache: each is registered (on both
  // NICs) on first use, older ones are unregistered to stay near the
  // budget, and a source used again after its eviction is registered
  // again -- with every WRITE landing. Sources 0 and 1 are cut from the
  // allocation back to back at odd offsets, so they share a page and
  // their registrations must be merged; the others are a page apart.
  constexpr size_t kSource = (256 << 10) + 100;
  constexpr size_t kStride = kSource + 2 * 4096;
  std::vector<uint8_t> arena(6 * kStride + 4096);
  auto source = [&](int k) {
    return arena.data() + 1000 + (k == 0 ? 0 : kSource + (k - 1) * kStride);
  };
  for (int k = 0; k < 6; ++k) std::memset(source(k), 0x20 + k, kSource);
  Node target;
  ASSERT_OK(target.Start("target", "embedded"));
  EngineOptions o;
  o.mr_cache_bytes = 600 << 10;  // About two of the sources.
  TransferEngine initiator;
  o.local_segment_name = "initiator";
  o.metadata_endpoint = target.engine.metadata_address();
  o.transports = {"rdma"};
  ASSERT_OK(initiator.Init(o));
  auto seg = initiator.OpenSegment("target");
  ASSERT_OK(seg);
  for (int round = 0; round < 2; ++round) {
    for (int k = 0; k < 6; ++k) {
      auto st = RunBatch(initiator, Writes(source(k), *seg,
                                           target.addr(k * kSource), kSource));
      ASSERT_OK(st) << round << " " << k;
      ASSERT_EQ(st->state, TransferState::kCompleted) << st->first_error;
      ASSERT_EQ(
          std::count(target.mem.get() + k * kSource,
                     target.mem.get() + (k + 1) * kSource, uint8_t(0x20 + k)),
          static_cast<std::ptrdiff_t>(kSource))
          << round << " " << k;
      // Never far over the budget: at most one cover (the one just made,
      // up to two sources when 0 and 1 merge) beyond it.
      const EngineStats es = initiator.GetEngineStats();
      ASSERT_GE(es.mr_cache_registrations, 1u) << round << " " << k;
      ASSERT_LE(es.mr_cache_bytes, (600u << 10) + 2 * kStride)
          << round << " " << k;
    }
  }
  // Evictions happened: 6 sources (five registrations, 0 and 1 merged)
  // do not fit in a budget of about two, twice over.
  const EngineStats es = initiator.GetEngineStats();
  EXPECT_GE(es.mr_cache_evictions, 5u);
  EXPECT_LE(es.mr_cache_registrations, 3u);
  // Both NICs carried the cached registrations' slices.
  auto nics = initiator.GetTransportStats()[0].nics;
  EXPECT_GT(nics[0].slices, 0u);
  EXPECT_GT(nics[1].slices, 0u);
  initiator.Shutdown();  // Before the arena goes.
}

// Advances `clock` in `step`s until `done()` (true) or `limit` (false),
// letting what fell due at each step be done first (AdvanceAndSettle).
template <typename F>
bool StepUntil(SimulatedClock& clock, F done, absl::Duration limit,
               absl::Duration step) {
  const absl::Time end = clock.Now() + limit;
  while (!done()) {
    if (clock.Now() >= end) return false;
    clock.AdvanceAndSettle(step);
  }
  return true;
}

TEST(RdmaEndpointTest, TargetStoreBoundsAcceptedEndpointsWithoutLosingWork) {
  // The target keeps at most one endpoint; two initiators take turns. Each
  // turn evicts the other's idle endpoint (closed with its owner, which
  // reconnects on its next transfer), and no byte goes missing. The target
  // runs on a SimulatedClock, so that an evicted endpoint's linger (when
  // its peer's DISCONNECT answer did not say it was drained) passes when
  // the test moves time, not in real time.
  SimulatedClock clock;
  EngineOptions small;
  small.rdma.devices = {"softrnic0"};
  small.rdma.max_endpoints = 1;
  small.clock = &clock;
  EngineOptions one_nic;
  one_nic.rdma.devices = {"softrnic0"};
  Node target, i1, i2;
  ASSERT_OK(target.Start("target", "embedded", small));
  ASSERT_OK(i1.Start("i1", target.engine.metadata_address(), one_nic));
  ASSERT_OK(i2.Start("i2", target.engine.metadata_address(), one_nic));
  auto s1 = i1.engine.OpenSegment("target");
  auto s2 = i2.engine.OpenSegment("target");
  ASSERT_TRUE(s1.ok() && s2.ok());
  // An evicted endpoint lingers at most R / 2 (R: rpc_timeout, 3 s) plus
  // 100 ms, then goes at the next housekeeping (rdma_transport.h).
  const absl::Duration kLinger = absl::Milliseconds(1500 + 100 + 50);
  for (int round = 0; round < 8; ++round) {
    Node* from = round % 2 == 0 ? &i1 : &i2;
    const SegmentHandle seg = round % 2 == 0 ? *s1 : *s2;
    const size_t off = static_cast<size_t>(round) * (kBuffer / 8);
    FillPattern(from->mem.get() + off, kBuffer / 8, off, 50 + round);
    BatchStatus st = Write(from, seg, target, off, kBuffer / 8, 4);
    ASSERT_EQ(st.state, TransferState::kCompleted) << round << st.first_error;
    ASSERT_EQ(
        CheckPattern(target.mem.get() + off, kBuffer / 8, off, 50 + round),
        kBuffer / 8)
        << round;
    // The other initiator's endpoint was evicted for this one (from round
    // 1 on): it lets go of it once the target's DISCONNECT has reached it,
    // and that travels in real time. Waited for here, not taken from the
    // target's store: with the test moving the target's clock, the linger
    // could run out (and the store let go) before the notice arrived, and
    // the evicted side then kept writing on its old connection (whose QPs
    // the target still held for the notice) without reconnecting.
    const Node& other = round % 2 == 0 ? i2 : i1;
    EXPECT_TRUE(WaitUntil([&] { return other.stats().endpoints == 0; },
                          absl::Seconds(30)))
        << round << ": " << other.stats().endpoints;
    // The evicted endpoint goes once its peer has let go of it: at once
    // when it had nothing posted on it (its DISCONNECT answer says so),
    // else after the linger.
    EXPECT_TRUE(StepUntil(
        clock, [&] { return target.stats().endpoints <= 1; }, kLinger,
        absl::Milliseconds(50)))
        << round << ": " << target.stats().endpoints;
  }
  EXPECT_GT(target.stats().evictions, 0u);
  // The evicted side reconnected each time it was its turn again.
  EXPECT_GT(i1.stats().connects_started, 1u);
  EXPECT_GT(i2.stats().connects_started, 1u);
  target.engine.Shutdown();  // Before the clock goes.
}

TEST(RdmaEndpointTest, RailChoiceFollowsTheTopology) {
  // Buffers on cpu:0 prefer softrnic1. At low load (one request at a
  // time) every slice takes softrnic1; a large request stripes over both.
  EngineOptions o;
  o.rdma.topology_json = R"({"cpu:0": [["softrnic1"], ["softrnic0"]]})";
  std::vector<uint8_t> remote(kBuffer), local(kBuffer);  // Outlive engines.
  TransferEngine target, initiator;
  o.local_segment_name = "t";
  o.transports = {"rdma"};
  ASSERT_OK(target.Init(o));
  EngineOptions i = o;
  i.local_segment_name = "i";
  i.metadata_endpoint = target.metadata_address();
  ASSERT_OK(initiator.Init(i));
  FillPattern(local.data(), local.size(), 0, 3);
  ASSERT_OK(target.RegisterLocalMemory(remote.data(), remote.size(), "cpu:0"));
  ASSERT_OK(initiator.RegisterLocalMemory(local.data(), local.size(), "cpu:0"));
  auto seg = initiator.OpenSegment("t");
  ASSERT_OK(seg);
  auto run = [&](size_t off, size_t len) {
    auto st =
        RunBatch(initiator,
                 Writes(local.data() + off, *seg,
                        reinterpret_cast<uint64_t>(remote.data()) + off, len));
    EXPECT_TRUE(st.ok() && st->state == TransferState::kCompleted);
  };
  for (int k = 0; k < 20; ++k) run(k * 4096, 4096);
  auto nics = initiator.GetTransportStats()[0].nics;
  ASSERT_EQ(nics.size(), 2u);
  ASSERT_EQ(nics[0].name, "softrnic0");
  EXPECT_EQ(nics[0].slices, 0u);
  EXPECT_EQ(nics[1].slices, 20u);
  run(0, 4 << 20);  // 64 slices of 64 KiB: both NICs take a share.
  nics = initiator.GetTransportStats()[0].nics;
  EXPECT_GT(nics[0].slices, 0u);
  EXPECT_GT(nics[1].slices, 20u);
  EXPECT_EQ(nics[0].slices + nics[1].slices, 20u + 64u);
  EXPECT_EQ(CheckPattern(remote.data(), 4 << 20, 0, 3), size_t{4 << 20});
}

TEST(RdmaEndpointTest, HandshakesToADeadPeerBackOff) {
  Node initiator;
  ASSERT_OK(initiator.Start("initiator", "embedded"));
  auto peer = std::make_unique<Node>();
  ASSERT_OK(peer->Start("peer", initiator.engine.metadata_address()));
  auto seg = initiator.engine.OpenSegment("peer");
  ASSERT_OK(seg);
  const uint64_t peer_addr = peer->addr();
  // Gone: its descriptor is still cached, its peer service does not answer.
  peer.reset();
  const uint64_t before = initiator.stats().connects_started;
  // Two seconds of requests, as fast as they fail.
  int requests = 0;
  const absl::Time end = absl::Now() + absl::Seconds(2);
  while (absl::Now() < end) {
    auto st = RunBatch(initiator.engine,
                       Writes(initiator.mem.get(), *seg, peer_addr, 65536, 4));
    ASSERT_OK(st);
    EXPECT_EQ(st->state, TransferState::kFailed);
    EXPECT_FALSE(st->first_error.ok());
    requests += 4;
  }
  const uint64_t handshakes = initiator.stats().connects_started - before;
  // Backoff 50 ms doubling to 1.6 s allows about six rounds of handshakes
  // (one per rail) in two seconds; without it, every request would start
  // its own.
  EXPECT_GT(requests, 40);
  EXPECT_LE(handshakes, 6u * 4u) << requests << " requests";
}

TEST(RdmaEndpointTest, UnregisteringALocalBufferWaitsForItsTransfers) {
  Node target, initiator;
  ASSERT_OK(target.Start("target", "embedded"));
  ASSERT_OK(initiator.Start("initiator", target.engine.metadata_address()));
  auto seg = initiator.engine.OpenSegment("target");
  ASSERT_OK(seg);
  // A second local buffer, registered and unregistered while a batch from
  // it is in flight.
  std::unique_ptr<uint8_t[]> extra(new uint8_t[kBuffer]);
  FillPattern(extra.get(), kBuffer, 0, 77);
  for (int round = 0; round < 5; ++round) {
    ASSERT_OK(
        initiator.engine.RegisterLocalMemory(extra.get(), kBuffer, "*", false));
    auto batch = initiator.engine.AllocateBatch(16);
    const auto reqs =
        Writes(extra.get(), *seg, target.addr(), kBuffer / 16, 16);
    ASSERT_OK(initiator.engine.SubmitTransfer(*batch, reqs));
    // Returns only once the batch no longer uses the buffer.
    ASSERT_OK(initiator.engine.UnregisterLocalMemory(extra.get()));
    auto st = initiator.engine.GetBatchStatus(*batch);
    ASSERT_OK(st);
    EXPECT_EQ(st->state, TransferState::kCompleted) << st->first_error;
    ASSERT_OK(initiator.engine.FreeBatch(*batch));
    ASSERT_EQ(CheckPattern(target.mem.get(), kBuffer, 0, 77), kBuffer);
    std::memset(target.mem.get(), 0, kBuffer);
    // Gone: a new request from it is refused at submission.
    auto again = initiator.engine.AllocateBatch(1);
    EXPECT_EQ(initiator.engine.SubmitTransfer(*again, {reqs[0]}).code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_OK(initiator.engine.FreeBatch(*again));
  }
}

TEST(RdmaEndpointTest, RemoteBufferIsNeverWrittenAfterItsUnregistration) {
  Node target, initiator;
  ASSERT_OK(target.Start("target", "embedded"));
  ASSERT_OK(initiator.Start("initiator", target.engine.metadata_address()));
  // A second target buffer that the initiator keeps writing into.
  std::unique_ptr<uint8_t[]> victim(new uint8_t[kBuffer]);
  std::memset(victim.get(), 0, kBuffer);
  ASSERT_OK(target.engine.RegisterLocalMemory(victim.get(), kBuffer));
  auto seg = initiator.engine.OpenSegment("target");
  ASSERT_OK(seg);
  FillPattern(initiator.mem.get(), kBuffer, 0, 91);
  std::atomic<int> ok_batches{0}, failed_batches{0};
  std::atomic<bool> stop{false};
  absl::Status last_error;
  absl::Notification writing;
  std::thread writer([&] {
    while (!stop.load()) {
      auto st = RunBatch(
          initiator.engine,
          Writes(initiator.mem.get(), *seg,
                 reinterpret_cast<uint64_t>(victim.get()), kBuffer / 8, 8));
      if (st.ok() && st->state == TransferState::kCompleted) {
        ok_batches.fetch_add(1);
      } else {
        failed_batches.fetch_add(1);
        last_error = st.ok() ? st->first_error : st.status();
      }
      if (ok_batches.load() >= 2 && !writing.HasBeenNotified()) {
        writing.Notify();
      }
    }
  });
  ASSERT_TRUE(writing.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_OK(target.engine.UnregisterLocalMemory(victim.get()));
  // From here on nothing may touch the buffer.
  std::memset(victim.get(), 0xee, kBuffer);
  const int failed_before = failed_batches.load();
  // A few more batches, each refused, while nothing may change the buffer.
  EXPECT_TRUE(
      WaitUntil([&] { return failed_batches.load() >= failed_before + 3; },
                absl::Seconds(30)));
  stop.store(true);
  writer.join();
  EXPECT_EQ(std::count(victim.get(), victim.get() + kBuffer, uint8_t{0xee}),
            static_cast<std::ptrdiff_t>(kBuffer))
      << "bytes written after the unregistration returned";
  // The initiator was refused with a clear error, not hung: first by the
  // target (stale descriptor), then at submission once refreshed.
  EXPECT_GT(failed_batches.load(), failed_before);
  EXPECT_EQ(last_error.code(), absl::StatusCode::kInvalidArgument)
      << last_error;
}

}  // namespace
}  // namespace ferry
