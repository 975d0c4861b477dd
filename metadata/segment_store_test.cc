#include "metadata/segment_store.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::metadata {
namespace {

SegmentDescriptor MakeSegment(const std::string& name, uint64_t incarnation) {
  SegmentDescriptor seg;
  seg.set_name(name);
  seg.set_incarnation(incarnation);
  seg.set_rpc_address("127.0.0.1:1");
  Buffer* b = seg.add_buffers();
  b->set_addr(0x1000);
  b->set_length(0x1000);
  b->set_location("cpu:0");
  return seg;
}

TEST(SegmentStoreTest, PutGetRemove) {
  SegmentStore store;
  auto v1 = store.Put(MakeSegment("a", 7));
  ASSERT_OK(v1);
  auto got = store.Get("a");
  ASSERT_OK(got);
  EXPECT_EQ(got->incarnation(), 7u);
  EXPECT_EQ(got->version(), *v1);
  EXPECT_EQ(store.List(), std::vector<std::string>{"a"});
  EXPECT_EQ(store.Remove("a", 8).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(store.Remove("a", 7));
  EXPECT_EQ(store.Get("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Remove("a", 7).code(), absl::StatusCode::kNotFound);
  // Only the owner's run removes a segment: no wildcard.
  ASSERT_OK(store.Put(MakeSegment("b", 9)).status());
  EXPECT_EQ(store.Remove("b", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_OK(store.Get("b").status());
}

// A clock the test moves by hand.
class FakeClock {
 public:
  absl::Time Now() const { return now_; }
  void Advance(absl::Duration d) { now_ += d; }
  SegmentStore::Clock AsClock() {
    return [this] { return Now(); };
  }

 private:
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

TEST(SegmentStoreTest, LeasedSegmentGoesAwayAfterItsTtl) {
  FakeClock clock;
  SegmentStore store(clock.AsClock());
  ASSERT_OK(store.Put(MakeSegment("leased", 1), absl::Seconds(10)).status());
  ASSERT_OK(store.Put(MakeSegment("forever", 2)).status());
  clock.Advance(absl::Seconds(9));
  EXPECT_OK(store.Get("leased").status());
  clock.Advance(absl::Seconds(1));
  EXPECT_EQ(store.Get("leased").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.List(), std::vector<std::string>{"forever"});
  // Gone for good: a renewal cannot bring it back, only a new Put.
  EXPECT_EQ(store.KeepAlive("leased", 1).status().code(),
            absl::StatusCode::kNotFound);
  clock.Advance(absl::Hours(100));
  EXPECT_OK(store.Get("forever").status());
}

TEST(SegmentStoreTest, KeepAliveAndUpdatesRenewTheLease) {
  FakeClock clock;
  SegmentStore store(clock.AsClock());
  ASSERT_OK(store.Put(MakeSegment("a", 5), absl::Seconds(3)).status());
  for (int i = 0; i < 5; ++i) {
    clock.Advance(absl::Seconds(2));
    ASSERT_OK_AND_ASSIGN(absl::Duration ttl, store.KeepAlive("a", 5));
    EXPECT_EQ(ttl, absl::Seconds(3));
  }
  EXPECT_EQ(store.KeepAlive("a", 6).status().code(),
            absl::StatusCode::kFailedPrecondition);
  clock.Advance(absl::Seconds(2));
  UpdateBuffersRequest req;
  req.set_name("a");
  req.set_incarnation(5);
  Buffer* b = req.add_add();
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
  FakeClock clock;
  SegmentStore store(clock.AsClock());
  ASSERT_OK(store.Put(MakeSegment("a", 1), absl::Seconds(1)).status());
  // A new run of the engine, without a lease: the old expiry must not
  // remove it.
  ASSERT_OK(store.Put(MakeSegment("a", 2)).status());
  clock.Advance(absl::Seconds(5));
  ASSERT_OK_AND_ASSIGN(SegmentDescriptor got, store.Get("a"));
  EXPECT_EQ(got.incarnation(), 2u);
  EXPECT_OK(store.Remove("a", 2));
  EXPECT_EQ(store.Put(MakeSegment("a", 3), absl::Hours(2)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

Buffer MakeBuffer(uint64_t addr, uint64_t length) {
  Buffer b;
  b.set_addr(addr);
  b.set_length(length);
  b.set_location("cpu:0");
  return b;
}

// An update that fails part-way (its third change overlaps) leaves the
// segment as it was: the removal before it is undone, the addition too.
TEST(SegmentStoreTest, FailedUpdateChangesNothing) {
  SegmentStore store;
  ASSERT_OK(store.Put(MakeSegment("a", 1)).status());  // 0x1000+0x1000.
  UpdateBuffersRequest add;
  add.set_name("a");
  add.set_incarnation(1);
  *add.add_add() = MakeBuffer(0x4000, 0x1000);
  ASSERT_OK(store.UpdateBuffers(add).status());
  ASSERT_OK_AND_ASSIGN(SegmentDescriptor before, store.Get("a"));

  UpdateBuffersRequest bad;
  bad.set_name("a");
  bad.set_incarnation(1);
  bad.add_remove_addrs(0x1000);
  *bad.add_add() = MakeBuffer(0x8000, 0x100);
  *bad.add_add() = MakeBuffer(0x3800, 0x1000);  // Overlaps 0x4000.
  absl::Status s = store.UpdateBuffers(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("overlaps the buffer at 0x4000"),
            std::string::npos)
      << s;
  ASSERT_OK_AND_ASSIGN(SegmentDescriptor after, store.Get("a"));
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());

  // Removing one that is not there: NotFound, nothing removed either.
  UpdateBuffersRequest missing;
  missing.set_name("a");
  missing.set_incarnation(1);
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
  ASSERT_OK(store.Put(MakeSegment("a", 1)).status());
  ASSERT_OK_AND_ASSIGN(SegmentDescriptor d, store.Get("a"));
  EXPECT_EQ(d.buffers_size(), 1);
  UpdateBuffersRequest add;
  add.set_name("a");
  add.set_incarnation(1);
  *add.add_add() = MakeBuffer(0x8000, 0x100);
  ASSERT_OK(store.UpdateBuffers(add).status());
  ASSERT_OK_AND_ASSIGN(d, store.Get("a"));
  EXPECT_EQ(d.buffers_size(), 2);
  ASSERT_OK(store.Put(MakeSegment("a", 2)).status());
  ASSERT_OK_AND_ASSIGN(d, store.Get("a"));
  EXPECT_EQ(d.incarnation(), 2u);
  EXPECT_EQ(d.buffers_size(), 1);
}

// Many buffers, added one at a time, come back in address order, each
// once, and an overlap with any of them is found.
TEST(SegmentStoreTest, ThousandsOfBuffersOneByOne) {
  SegmentStore store;
  SegmentDescriptor seg = MakeSegment("big", 1);
  seg.clear_buffers();
  ASSERT_OK(store.Put(seg).status());
  constexpr int kBuffers = 5000;
  for (int i = kBuffers - 1; i >= 0; --i) {
    UpdateBuffersRequest r;
    r.set_name("big");
    r.set_incarnation(1);
    *r.add_add() =
        MakeBuffer(0x100000 + static_cast<uint64_t>(i) * 0x2000, 0x1000);
    ASSERT_OK(store.UpdateBuffers(r).status()) << i;
  }
  ASSERT_OK_AND_ASSIGN(SegmentDescriptor got, store.Get("big"));
  ASSERT_EQ(got.buffers_size(), kBuffers);
  for (int i = 0; i < kBuffers; ++i) {
    EXPECT_EQ(got.buffers(i).addr(),
              0x100000 + static_cast<uint64_t>(i) * 0x2000);
  }
  UpdateBuffersRequest r;
  r.set_name("big");
  r.set_incarnation(1);
  *r.add_add() = MakeBuffer(0x100000 + 2500 * 0x2000 + 0xfff, 0x10);
  EXPECT_EQ(store.UpdateBuffers(r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SegmentStoreTest, RejectsBadDescriptors) {
  SegmentStore store;
  EXPECT_EQ(store.Put(MakeSegment("", 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Put(MakeSegment("has space", 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Put(MakeSegment(std::string(300, 'x'), 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  SegmentDescriptor zero = MakeSegment("z", 1);
  zero.mutable_buffers(0)->set_length(0);
  EXPECT_EQ(store.Put(zero).status().code(),
            absl::StatusCode::kInvalidArgument);
  SegmentDescriptor wrap = MakeSegment("w", 1);
  wrap.mutable_buffers(0)->set_addr(~0ull - 10);
  EXPECT_EQ(store.Put(wrap).status().code(),
            absl::StatusCode::kInvalidArgument);
  SegmentDescriptor overlap = MakeSegment("o", 1);
  Buffer* b = overlap.add_buffers();
  b->set_addr(0x1800);
  b->set_length(0x100);
  EXPECT_EQ(store.Put(overlap).status().code(),
            absl::StatusCode::kInvalidArgument);
  SegmentDescriptor badgid = MakeSegment("g", 1);
  auto* t = badgid.add_transports();
  t->set_transport("rdma");
  auto* d = t->add_devices();
  d->set_name("nic0");
  d->set_gid("short");
  EXPECT_EQ(store.Put(badgid).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store.List().empty());
}

TEST(SegmentStoreTest, UpdateBuffersIsAtomicAndChecksIncarnation) {
  SegmentStore store;
  ASSERT_OK(store.Put(MakeSegment("a", 5)));
  UpdateBuffersRequest add;
  add.set_name("a");
  add.set_incarnation(5);
  Buffer* nb = add.add_add();
  nb->set_addr(0x4000);
  nb->set_length(0x10);
  auto v = store.UpdateBuffers(add);
  ASSERT_OK(v);
  EXPECT_EQ(store.Get("a")->buffers_size(), 2);

  UpdateBuffersRequest stale = add;
  stale.set_incarnation(4);
  EXPECT_EQ(store.UpdateBuffers(stale).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // Overlapping add plus a valid removal: nothing changes.
  UpdateBuffersRequest bad;
  bad.set_name("a");
  bad.set_incarnation(5);
  bad.add_remove_addrs(0x1000);
  Buffer* ob = bad.add_add();
  ob->set_addr(0x4008);
  ob->set_length(0x10);
  EXPECT_EQ(store.UpdateBuffers(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Get("a")->buffers_size(), 2);

  UpdateBuffersRequest missing;
  missing.set_name("a");
  missing.set_incarnation(5);
  missing.add_remove_addrs(0x9999);
  EXPECT_EQ(store.UpdateBuffers(missing).status().code(),
            absl::StatusCode::kNotFound);

  UpdateBuffersRequest remove;
  remove.set_name("a");
  remove.set_incarnation(5);
  remove.add_remove_addrs(0x1000);
  ASSERT_OK(store.UpdateBuffers(remove));
  auto seg = store.Get("a");
  ASSERT_EQ(seg->buffers_size(), 1);
  EXPECT_EQ(seg->buffers(0).addr(), 0x4000u);
  EXPECT_GT(seg->version(), *v);
}

}  // namespace
}  // namespace ferry::metadata
