#include "metadata/segment_store.h"

#include <malloc.h>

#include <optional>

#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/store_testing.h"

namespace ferry::metadata {
namespace {

descriptor::SegmentDescriptor MakeSegment(const std::string& name,
                                          uint64_t incarnation) {
  descriptor::SegmentDescriptor seg;
  seg.set_name(name);
  seg.set_incarnation(incarnation);
  seg.set_rpc_address("127.0.0.1:1");
  descriptor::Buffer* b = seg.add_buffers();
  b->set_addr(0x1000);
  b->set_length(0x1000);
  b->set_location("cpu:0");
  return seg;
}

TEST(SegmentStoreTest, PutGetRemove) {
  SegmentStore store;
  auto v1 = store.Put(PutOf(MakeSegment("a", 7)));
  ASSERT_OK(v1);
  auto got = store.Get("a");
  ASSERT_OK(got);
  EXPECT_EQ(got->incarnation(), 7u);
  EXPECT_EQ(got->version(), *v1);
  EXPECT_EQ(*store.List(), std::vector<std::string>{"a"});
  EXPECT_EQ(store.Remove(RemoveOf("a", 8)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(store.Remove(RemoveOf("a", 7)));
  EXPECT_EQ(store.Get("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Remove(RemoveOf("a", 7)).code(), absl::StatusCode::kNotFound);
  // Only the owner's run removes a segment: knowing its name and
  // incarnation (both in the descriptor) is not enough.
  ASSERT_OK(store.Put(PutOf(MakeSegment("b", 9))).status());
  RemoveSegmentRequest forged = RemoveOf("b", 9);
  forged.set_owner_key(TestOwnerKey(10));
  EXPECT_EQ(store.Remove(forged).code(), absl::StatusCode::kFailedPrecondition);
  forged.clear_owner_key();
  EXPECT_EQ(store.Remove(forged).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(store.Get("b").status());
}

// The probe of issue 11: a client that read a live segment's descriptor
// puts it back with its own listener and the same incarnation. Refused,
// and the owner's entry is untouched; after the owner's lease ends the
// name is free.
TEST(SegmentStoreTest, ALiveSegmentCannotBeTakenOver) {
  SimulatedClock clock;
  SegmentStore store(&clock);
  ASSERT_OK(store.Put(PutOf(MakeSegment("victim", 7), absl::Seconds(10))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor seen, store.Get("victim"));
  seen.set_rpc_address("10.6.6.6:666");
  absl::Status s =
      store.Put(PutOf(seen, absl::Seconds(10), /*owner=*/666)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_NE(s.message().find("lease ends in 10s"), std::string::npos) << s;
  UpdateBuffersRequest inject;
  inject.set_name("victim");
  inject.set_incarnation(7);
  inject.set_owner_key(TestOwnerKey(666));
  *inject.add_add() = seen.buffers(0);
  inject.mutable_add(0)->set_addr(0x900000);
  EXPECT_EQ(store.UpdateBuffers(inject).status().code(),
            absl::StatusCode::kFailedPrecondition);
  KeepAliveRequest renew = KeepAliveOf("victim", 666);
  EXPECT_EQ(store.KeepAlive(renew).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor now, store.Get("victim"));
  EXPECT_EQ(now.rpc_address(), "127.0.0.1:1");
  EXPECT_EQ(now.buffers_size(), 1);
  // Keys are required, and bounded.
  PutSegmentRequest keyless = PutOf(MakeSegment("other", 1));
  keyless.clear_owner_key();
  EXPECT_EQ(store.Put(keyless).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The owner dies: after its lease the name is free for a new run.
  clock.Advance(absl::Seconds(10));
  EXPECT_OK(store.Put(PutOf(seen, absl::Seconds(10), /*owner=*/8)));
}

// A segment published without a lease is held until its owner removes it.
TEST(SegmentStoreTest, AnUnleasedNameIsHeldUntilRemoved) {
  SimulatedClock clock;
  SegmentStore store(&clock);
  ASSERT_OK(store.Put(PutOf(MakeSegment("a", 1))));
  clock.Advance(absl::Hours(10));
  absl::Status s = store.Put(PutOf(MakeSegment("a", 2))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_NE(s.message().find("without a lease"), std::string::npos) << s;
  ASSERT_OK(store.Remove(RemoveOf("a", 1)));
  EXPECT_OK(store.Put(PutOf(MakeSegment("a", 2))));
}

TEST(SegmentStoreTest, LeasedSegmentGoesAwayAfterItsTtl) {
  SimulatedClock clock;
  SegmentStore store(&clock);
  ASSERT_OK(
      store.Put(PutOf(MakeSegment("leased", 1), absl::Seconds(10))).status());
  ASSERT_OK(store.Put(PutOf(MakeSegment("forever", 2))).status());
  clock.Advance(absl::Seconds(9));
  EXPECT_OK(store.Get("leased").status());
  clock.Advance(absl::Seconds(1));
  EXPECT_EQ(store.Get("leased").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*store.List(), std::vector<std::string>{"forever"});
  // Gone for good: a renewal cannot bring it back, only a new Put.
  EXPECT_EQ(store.KeepAlive(KeepAliveOf("leased", 1)).status().code(),
            absl::StatusCode::kNotFound);
  clock.Advance(absl::Hours(100));
  EXPECT_OK(store.Get("forever").status());
}

TEST(SegmentStoreTest, KeepAliveAndUpdatesRenewTheLease) {
  SimulatedClock clock;
  SegmentStore store(&clock);
  ASSERT_OK(store.Put(PutOf(MakeSegment("a", 5), absl::Seconds(3))).status());
  for (int i = 0; i < 5; ++i) {
    clock.Advance(absl::Seconds(2));
    ASSERT_OK_AND_ASSIGN(absl::Duration ttl,
                         store.KeepAlive(KeepAliveOf("a", 5)));
    EXPECT_EQ(ttl, absl::Seconds(3));
  }
  EXPECT_EQ(store.KeepAlive(KeepAliveOf("a", 6)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  clock.Advance(absl::Seconds(2));
  UpdateBuffersRequest req;
  req.set_name("a");
  req.set_incarnation(5);
  req.set_owner_key(TestOwnerKey(5));
  descriptor::Buffer* b = req.add_add();
  b->set_addr(0x10000);
  b->set_length(0x1000);
  b->set_location("cpu:0");
  ASSERT_OK(store.UpdateBuffers(req).status());
  clock.Advance(absl::Seconds(2));
  EXPECT_OK(store.Get("a").status()) << "the update renewed the lease";
  clock.Advance(absl::Seconds(1));
  EXPECT_EQ(store.Get("a").status().code(), absl::StatusCode::kNotFound);
}

TEST(SegmentStoreTest, ReplacingALeasedSegmentKeepsOneExpiry) {
  SimulatedClock clock;
  SegmentStore store(&clock);
  ASSERT_OK(store.Put(PutOf(MakeSegment("a", 1), absl::Seconds(1))).status());
  // The owner publishes again without a lease: the old expiry must not
  // remove it.
  ASSERT_OK(store
                .Put(PutOf(MakeSegment("a", 2), absl::ZeroDuration(),
                           /*owner=*/1))
                .status());
  clock.Advance(absl::Seconds(5));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store.Get("a"));
  EXPECT_EQ(got.incarnation(), 2u);
  EXPECT_OK(store.Remove(RemoveOf("a", 1)));
  EXPECT_EQ(
      store.Put(PutOf(MakeSegment("a", 3), absl::Hours(2))).status().code(),
      absl::StatusCode::kInvalidArgument);
}

descriptor::Buffer MakeBuffer(uint64_t addr, uint64_t length) {
  descriptor::Buffer b;
  b.set_addr(addr);
  b.set_length(length);
  b.set_location("cpu:0");
  return b;
}

// An update that fails part-way (its third change overlaps) leaves the
// segment as it was: the removal before it is undone, the addition too.
TEST(SegmentStoreTest, FailedUpdateChangesNothing) {
  SegmentStore store;
  ASSERT_OK(store.Put(PutOf(MakeSegment("a", 1))).status());  // 0x1000+0x1000.
  UpdateBuffersRequest add;
  add.set_name("a");
  add.set_incarnation(1);
  add.set_owner_key(TestOwnerKey(1));
  *add.add_add() = MakeBuffer(0x4000, 0x1000);
  ASSERT_OK(store.UpdateBuffers(add).status());
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor before, store.Get("a"));

  UpdateBuffersRequest bad;
  bad.set_name("a");
  bad.set_incarnation(1);
  bad.set_owner_key(TestOwnerKey(1));
  bad.add_remove_addrs(0x1000);
  *bad.add_add() = MakeBuffer(0x8000, 0x100);
  *bad.add_add() = MakeBuffer(0x3800, 0x1000);  // Overlaps 0x4000.
  absl::Status s = store.UpdateBuffers(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("overlaps the buffer at 0x4000"),
            std::string::npos)
      << s;
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor after, store.Get("a"));
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());

  // Removing one that is not there: NotFound, nothing removed either.
  UpdateBuffersRequest missing;
  missing.set_name("a");
  missing.set_incarnation(1);
  missing.set_owner_key(TestOwnerKey(1));
  missing.add_remove_addrs(0x4000);
  missing.add_remove_addrs(0x9000);
  EXPECT_EQ(store.UpdateBuffers(missing).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(after, store.Get("a"));
  EXPECT_EQ(after.buffers_size(), 2);
}

// What a reader gets follows every change (readers share an assembled
// copy of the descriptor, which each change must drop).
TEST(SegmentStoreTest, ReadersSeeEveryChange) {
  SegmentStore store;
  ASSERT_OK(store.Put(PutOf(MakeSegment("a", 1))).status());
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d, store.Get("a"));
  EXPECT_EQ(d.buffers_size(), 1);
  UpdateBuffersRequest add;
  add.set_name("a");
  add.set_incarnation(1);
  add.set_owner_key(TestOwnerKey(1));
  *add.add_add() = MakeBuffer(0x8000, 0x100);
  ASSERT_OK(store.UpdateBuffers(add).status());
  ASSERT_OK_AND_ASSIGN(d, store.Get("a"));
  EXPECT_EQ(d.buffers_size(), 2);
  ASSERT_OK(
      store.Put(PutOf(MakeSegment("a", 2), absl::ZeroDuration(), /*owner=*/1))
          .status());
  ASSERT_OK_AND_ASSIGN(d, store.Get("a"));
  EXPECT_EQ(d.incarnation(), 2u);
  EXPECT_EQ(d.buffers_size(), 1);
}

// Many buffers, added one at a time, come back in address order, each
// once, and an overlap with any of them is found.
TEST(SegmentStoreTest, ThousandsOfBuffersOneByOne) {
  SegmentStore store;
  descriptor::SegmentDescriptor seg = MakeSegment("big", 1);
  seg.clear_buffers();
  ASSERT_OK(store.Put(PutOf(seg)).status());
  constexpr int kBuffers = 5000;
  for (int i = kBuffers - 1; i >= 0; --i) {
    UpdateBuffersRequest r;
    r.set_name("big");
    r.set_incarnation(1);
    r.set_owner_key(TestOwnerKey(1));
    *r.add_add() =
        MakeBuffer(0x100000 + static_cast<uint64_t>(i) * 0x2000, 0x1000);
    ASSERT_OK(store.UpdateBuffers(r).status()) << i;
  }
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store.Get("big"));
  ASSERT_EQ(got.buffers_size(), kBuffers);
  for (int i = 0; i < kBuffers; ++i) {
    EXPECT_EQ(got.buffers(i).addr(),
              0x100000 + static_cast<uint64_t>(i) * 0x2000);
  }
  UpdateBuffersRequest r;
  r.set_name("big");
  r.set_incarnation(1);
  r.set_owner_key(TestOwnerKey(1));
  *r.add_add() = MakeBuffer(0x100000 + 2500 * 0x2000 + 0xfff, 0x10);
  EXPECT_EQ(store.UpdateBuffers(r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The probe of issue 26: with a watcher, 150 updates that remove every
// buffer and add them back grew the server by 1.95 GB, the change log
// keeping each (here, 20 such updates would keep 20 times the segment).
// It holds at most the descriptor's size now (or 64 KiB); a watcher that
// fell behind what is kept gets the whole descriptor, and one that is up
// to the change before a small one still gets just that.
TEST(SegmentStoreTest, TheChangeLogCostsNoMoreThanTheSegment) {
  SegmentStore store;
  descriptor::SegmentDescriptor seg = MakeSegment("churn", 1);
  seg.clear_buffers();
  constexpr int kBuffers = 5000;
  for (int i = 0; i < kBuffers; ++i) {
    *seg.add_buffers() =
        MakeBuffer(0x100000 + static_cast<uint64_t>(i) * 0x2000, 0x1000);
  }
  ASSERT_OK_AND_ASSIGN(const uint64_t first, store.Put(PutOf(seg)));
  const uint64_t sub = store.Subscribe("churn", [] {});
  uint64_t last = first;
  for (int round = 0; round < 20; ++round) {
    UpdateBuffersRequest r;
    r.set_name("churn");
    r.set_incarnation(1);
    r.set_owner_key(TestOwnerKey(1));
    for (const descriptor::Buffer& b : seg.buffers()) {
      r.add_remove_addrs(b.addr());
      *r.add_add() = b;
    }
    ASSERT_OK_AND_ASSIGN(last, store.UpdateBuffers(r));
  }
  const uint64_t segment_bytes = store.bytes();
  EXPECT_GT(segment_bytes, SegmentStore::kMinChangeLogBytes);
  EXPECT_LE(store.ChangeLogBytesForTesting("churn"), segment_bytes);

  std::optional<SegmentEvent> ev = store.EventSince("churn", first);
  ASSERT_TRUE(ev.has_value());
  EXPECT_TRUE(ev->has_full());
  EXPECT_EQ(ev->version(), last);
  EXPECT_EQ(ev->full().buffers_size(), kBuffers);
  UpdateBuffersRequest small;
  small.set_name("churn");
  small.set_incarnation(1);
  small.set_owner_key(TestOwnerKey(1));
  *small.add_add() = MakeBuffer(0x80000, 0x1000);
  ASSERT_OK_AND_ASSIGN(const uint64_t newest, store.UpdateBuffers(small));
  ev = store.EventSince("churn", last);
  ASSERT_TRUE(ev.has_value());
  EXPECT_FALSE(ev->has_full());
  EXPECT_EQ(ev->version(), newest);
  EXPECT_EQ(ev->add_size(), 1);
  store.Unsubscribe(sub);
}

TEST(SegmentStoreTest, RejectsBadDescriptors) {
  SegmentStore store;
  EXPECT_EQ(store.Put(PutOf(MakeSegment("", 1))).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Put(PutOf(MakeSegment("has space", 1))).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      store.Put(PutOf(MakeSegment(std::string(300, 'x'), 1))).status().code(),
      absl::StatusCode::kInvalidArgument);
  descriptor::SegmentDescriptor zero = MakeSegment("z", 1);
  zero.mutable_buffers(0)->set_length(0);
  EXPECT_EQ(store.Put(PutOf(zero)).status().code(),
            absl::StatusCode::kInvalidArgument);
  descriptor::SegmentDescriptor wrap = MakeSegment("w", 1);
  wrap.mutable_buffers(0)->set_addr(~0ull - 10);
  EXPECT_EQ(store.Put(PutOf(wrap)).status().code(),
            absl::StatusCode::kInvalidArgument);
  descriptor::SegmentDescriptor overlap = MakeSegment("o", 1);
  descriptor::Buffer* b = overlap.add_buffers();
  b->set_addr(0x1800);
  b->set_length(0x100);
  EXPECT_EQ(store.Put(PutOf(overlap)).status().code(),
            absl::StatusCode::kInvalidArgument);
  descriptor::SegmentDescriptor badgid = MakeSegment("g", 1);
  auto* t = badgid.add_transports();
  t->set_transport("rdma");
  auto* d = t->add_devices();
  d->set_name("nic0");
  d->set_gid("short");
  EXPECT_EQ(store.Put(PutOf(badgid)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store.List()->empty());
}

TEST(SegmentStoreTest, UpdateBuffersIsAtomicAndChecksIncarnation) {
  SegmentStore store;
  ASSERT_OK(store.Put(PutOf(MakeSegment("a", 5))));
  UpdateBuffersRequest add;
  add.set_name("a");
  add.set_incarnation(5);
  add.set_owner_key(TestOwnerKey(5));
  descriptor::Buffer* nb = add.add_add();
  nb->set_addr(0x4000);
  nb->set_length(0x10);
  auto v = store.UpdateBuffers(add);
  ASSERT_OK(v);
  EXPECT_EQ(store.Get("a")->buffers_size(), 2);

  UpdateBuffersRequest stale = add;
  stale.set_incarnation(4);
  stale.set_owner_key(TestOwnerKey(4));
  EXPECT_EQ(store.UpdateBuffers(stale).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // Overlapping add plus a valid removal: nothing changes.
  UpdateBuffersRequest bad;
  bad.set_name("a");
  bad.set_incarnation(5);
  bad.set_owner_key(TestOwnerKey(5));
  bad.add_remove_addrs(0x1000);
  descriptor::Buffer* ob = bad.add_add();
  ob->set_addr(0x4008);
  ob->set_length(0x10);
  EXPECT_EQ(store.UpdateBuffers(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Get("a")->buffers_size(), 2);

  UpdateBuffersRequest missing;
  missing.set_name("a");
  missing.set_incarnation(5);
  missing.set_owner_key(TestOwnerKey(5));
  missing.add_remove_addrs(0x9999);
  EXPECT_EQ(store.UpdateBuffers(missing).status().code(),
            absl::StatusCode::kNotFound);

  UpdateBuffersRequest remove;
  remove.set_name("a");
  remove.set_incarnation(5);
  remove.set_owner_key(TestOwnerKey(5));
  remove.add_remove_addrs(0x1000);
  ASSERT_OK(store.UpdateBuffers(remove));
  auto seg = store.Get("a");
  ASSERT_EQ(seg->buffers_size(), 1);
  EXPECT_EQ(seg->buffers(0).addr(), 0x4000u);
  EXPECT_GT(seg->version(), *v);
}

}  // namespace
}  // namespace ferry::metadata

namespace ferry::metadata {
namespace {

descriptor::SegmentDescriptor Sized(const std::string& name,
                                    uint64_t incarnation, int buffers) {
  return TestSegment(name, incarnation, buffers);
}

// One client cannot fill the server: its bytes and segments are capped,
// others still get in, and what it removes is given back.
TEST(SegmentStoreQuotaTest, PerClientAndTotalLimits) {
  SegmentStore store;
  SegmentStore::Limits limits;
  limits.max_client_bytes = 1 << 20;
  limits.max_client_segments = 3;
  limits.max_bytes = 3 << 20;
  store.SetLimits(limits);
  // ~40 KiB of memory each: three fit, the fourth segment is over the
  // count.
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(store.PutFrom(PutOf(Sized(absl::StrCat("s", i), i + 1, 100)),
                            "ipv4:10.0.0.66"));
  }
  absl::Status s =
      store.PutFrom(PutOf(Sized("s3", 4, 100)), "ipv4:10.0.0.66").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("10.0.0.66"), std::string::npos) << s;
  // Bytes: a segment of 5,000 buffers (~2 MiB of memory) is over 1 MiB.
  s = store.PutFrom(PutOf(Sized("big", 9, 5000)), "ipv4:10.0.0.77").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Another client still gets in.
  ASSERT_OK(store.PutFrom(PutOf(Sized("other", 10, 100)), "ipv4:10.0.0.77"));
  // Updates count too, and a refused one changes nothing.
  UpdateBuffersRequest grow;
  grow.set_name("other");
  grow.set_owner_key(TestOwnerKey(10));
  for (int i = 0; i < 4000; ++i) {
    descriptor::Buffer* b = grow.add_add();
    b->set_addr(0x1000000000ull + 0x10000ull * i);
    b->set_length(0x100);
    b->set_location("cpu:0");
  }
  EXPECT_EQ(store.UpdateBuffers(grow).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.Get("other")->buffers_size(), 100);
  // Removing gives the count back.
  ASSERT_OK(store.Remove(RemoveOf("s0", 1)));
  EXPECT_OK(store.PutFrom(PutOf(Sized("s3", 4, 100)), "ipv4:10.0.0.66"));
  // The total: local callers (no client) are bound by it too.
  s = store.Put(PutOf(Sized("huge", 20, 12000))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("limit"), std::string::npos) << s;
}

// Put charges a segment's buffers at their exact encoded size, and
// UpdateBuffers refunds the same: 1,000 small buffers put and then
// unregistered one update at a time leave nothing behind (a refund larger
// than the charge made the byte count wrap and refuse every later Put).
// The probe of issue 26: a PutSegment held about 12 times its encoded
// size in memory while quotas counted the encoding, so a client within
// its quota held 3.2 GB. Quotas now count what the store holds: measured
// by the allocator around a Put and a Get (which builds the copy readers
// share), the charge covers it, and is not far above it.
TEST(SegmentStoreQuotaTest, QuotasCountTheMemoryHeld) {
  SegmentStore store;
  descriptor::SegmentDescriptor d = Sized("mem", 1, 0);
  descriptor::TransportEndpoint* t = d.add_transports();
  t->set_transport("rdma");
  for (int n = 0; n < 4; ++n) {
    descriptor::Device* dev = t->add_devices();
    dev->set_name(absl::StrCat("mlx5_", n));
    dev->set_gid(std::string(16, '\1'));
  }
  for (int i = 0; i < 4000; ++i) {
    descriptor::Buffer* b = d.add_buffers();
    b->set_addr(0x100000ull * (i + 1));
    b->set_length(0x1000);
    b->set_location("cuda:0");
    for (const descriptor::Device& dev : t->devices()) {
      descriptor::NicKey* k = b->add_keys();
      k->set_nic(dev.name());
      k->set_rkey(0x1000 + i);
    }
  }
  const PutSegmentRequest put = PutOf(d);
  d.Clear();
  const size_t before = mallinfo2().uordblks;
  ASSERT_OK(store.Put(put));
  { ASSERT_OK(store.Get("mem")); }  // The shared copy stays with the store.
  const size_t after = mallinfo2().uordblks;
  if (before == 0 && after == 0) {
    GTEST_SKIP() << "no allocator statistics (a sanitizer's allocator)";
  }
  const uint64_t held = after - before;
  EXPECT_GT(held, 8 * put.segment().ByteSizeLong()) << "encoded is not held";
  EXPECT_GE(store.bytes(), held * 9 / 10);
  EXPECT_LE(store.bytes(), held * 2);
  ASSERT_OK(store.Remove(RemoveOf("mem", 1)));
  EXPECT_EQ(store.bytes(), 0u);
}

TEST(SegmentStoreQuotaTest, ChargesAndRefundsMatch) {
  SegmentStore store;
  SegmentStore::Limits limits;
  limits.max_bytes = 1 << 20;
  store.SetLimits(limits);
  ASSERT_OK(store.PutFrom(PutOf(Sized("a", 1, 1000)), "ipv4:10.0.0.1"));
  for (int i = 0; i < 1000; ++i) {
    UpdateBuffersRequest rm;
    rm.set_name("a");
    rm.set_owner_key(TestOwnerKey(1));
    rm.add_remove_addrs(0x100000ull * (i + 1));
    ASSERT_OK(store.UpdateBuffers(rm)) << i;
  }
  // What is held is what "a" (now without buffers) takes, twice (the
  // entry and the copy readers share); a refund larger than the charge
  // would have wrapped around zero.
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor a, store.Get("a"));
  EXPECT_GT(store.bytes(), 0u);
  EXPECT_LE(store.bytes(), 2 * a.SpaceUsedLong() + 1024);
  ASSERT_OK(store.Remove(RemoveOf("a", 1)));
  EXPECT_EQ(store.bytes(), 0u);
}

// A descriptor must fit one GetSegment answer: updates that would grow it
// past that are refused (keys are what make buffers large).
TEST(SegmentStoreQuotaTest, ADescriptorStaysWithinOneAnswer) {
  SegmentStore store;
  SegmentStore::Limits limits;
  limits.max_client_bytes = limits.max_bytes;
  store.SetLimits(limits);
  descriptor::SegmentDescriptor d = Sized("wide", 1, 0);
  descriptor::TransportEndpoint* t = d.add_transports();
  t->set_transport("rdma");
  for (int n = 0; n < 64; ++n) {
    descriptor::Device* dev = t->add_devices();
    dev->set_name(
        absl::StrCat("nic-with-a-long-name-", n, std::string(40, 'x')));
    dev->set_gid(std::string(16, '\1'));
  }
  ASSERT_OK(store.Put(PutOf(d)));
  absl::Status last;
  int batches = 0;
  for (; batches < 20 && last.ok(); ++batches) {
    UpdateBuffersRequest add;
    add.set_name("wide");
    add.set_owner_key(TestOwnerKey(1));
    for (int i = 0; i < 1000; ++i) {
      descriptor::Buffer* b = add.add_add();
      b->set_addr(0x100000ull * (batches * 1000 + i + 1));
      b->set_length(0x1000);
      b->set_location("cpu:0");
      for (const descriptor::Device& dev : t->devices()) {
        descriptor::NicKey* k = b->add_keys();
        k->set_nic(dev.name());
        k->set_rkey(i);
      }
    }
    last = store.UpdateBuffers(add).status();
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_NE(last.message().find("bytes encoded"), std::string::npos) << last;
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store.Get("wide"));
  EXPECT_LE(got.ByteSizeLong(), SegmentStore::kMaxDescriptorBytes);
  EXPECT_GT(got.ByteSizeLong(), SegmentStore::kMaxDescriptorBytes / 2);
}

}  // namespace
}  // namespace ferry::metadata
