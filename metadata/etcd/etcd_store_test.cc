// The etcd store against real etcd servers on loopback: the shared store
// suite, namespaces, segments larger than one transaction, two clients on
// one cluster, and a 3-member cluster that loses a member mid-run.
#include "metadata/etcd/etcd_store.h"

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/etcd/etcd_testing.h"
#include "metadata/store_conformance.h"
#include "metadata/store_over_grpc.h"
#include "metadata/store_testing.h"
#include "rpc.grpc.pb.h"

namespace ferry::metadata {
namespace {

// One single-member cluster for the whole suite; each store gets a key
// prefix of its own, so each test starts empty.
EtcdCluster* SharedCluster() {
  static EtcdCluster* cluster = [] {
    auto c = EtcdCluster::Start(1);
    if (!c.ok()) {
      ADD_FAILURE() << c.status();
      return static_cast<EtcdCluster*>(nullptr);
    }
    return c->release();
  }();
  return cluster;
}

absl::StatusOr<std::unique_ptr<EtcdStore>> FreshStore(
    const std::vector<std::string>& endpoints, int max_txn_ops = 120) {
  static std::atomic<int> n{0};
  EtcdOptions o;
  o.endpoints = endpoints;
  o.prefix = absl::StrCat("test-", n.fetch_add(1), "/");
  o.max_txn_ops = max_txn_ops;
  return EtcdStore::Create(o);
}

absl::StatusOr<std::shared_ptr<Store>> Etcd() {
  EtcdCluster* c = SharedCluster();
  if (c == nullptr) return absl::UnavailableError("no etcd");
  auto s = FreshStore(c->endpoints());
  if (!s.ok()) return s.status();
  return std::shared_ptr<Store>(std::move(*s));
}

// Small transactions, so that the suite's segments also take the path of
// changes written in several.
absl::StatusOr<std::shared_ptr<Store>> EtcdSmallTxns() {
  EtcdCluster* c = SharedCluster();
  if (c == nullptr) return absl::UnavailableError("no etcd");
  auto s = FreshStore(c->endpoints(), 8);
  if (!s.ok()) return s.status();
  return std::shared_ptr<Store>(std::move(*s));
}

// etcd leases are whole seconds, at least its minimum (1 s with the test
// members' timers), and run on etcd's clock: real time.
INSTANTIATE_TEST_SUITE_P(
    Etcd, StoreConformanceTest,
    ::testing::Values(
        StoreBackend{"Etcd", [](Clock*) { return Etcd(); }, absl::Seconds(1),
                     /*pushes=*/true},
        StoreBackend{"EtcdSmallTxns", [](Clock*) { return EtcdSmallTxns(); },
                     absl::Seconds(1), /*pushes=*/true},
        // A metadata_server on etcd, as engines see it.
        StoreBackend{"GrpcEtcd",
                     [](Clock*) { return testing::OverGrpc(Etcd()); },
                     absl::Seconds(1), /*pushes=*/true}),
    BackendName);

descriptor::SegmentDescriptor Seg(const std::string& name, uint64_t incarnation,
                                  int buffers) {
  return TestSegment(name, incarnation, buffers);
}

TEST(EtcdStoreTest, NamespacesShareOneCluster) {
  ASSERT_NE(SharedCluster(), nullptr);
  ASSERT_OK_AND_ASSIGN(auto a, FreshStore(SharedCluster()->endpoints()));
  ASSERT_OK_AND_ASSIGN(auto b, FreshStore(SharedCluster()->endpoints()));
  // The same name, two owners, two clusters' namespaces: no conflict.
  ASSERT_OK(a->Put(PutOf(Seg("prefill-0", 1, 1))));
  ASSERT_OK(b->Put(PutOf(Seg("prefill-0", 2, 2))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor in_a, a->Get("prefill-0"));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor in_b, b->Get("prefill-0"));
  EXPECT_EQ(in_a.incarnation(), 1u);
  EXPECT_EQ(in_b.incarnation(), 2u);
  EXPECT_EQ(in_b.buffers_size(), 2);
  // Names with '/' and '%' stay apart from their look-alikes.
  ASSERT_OK(a->Put(PutOf(Seg("x/y", 3, 1))));
  ASSERT_OK(a->Put(PutOf(Seg("x%2Fy", 4, 2))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor slash, a->Get("x/y"));
  EXPECT_EQ(slash.buffers_size(), 1);
  ASSERT_OK_AND_ASSIGN(auto names, a->List());
  EXPECT_EQ(names, (std::vector<std::string>{"prefill-0", "x%2Fy", "x/y"}));
}

// A segment of 1,000 buffers and a batch of 500 more: many transactions
// each, read back whole.
TEST(EtcdStoreTest, LargeSegmentsAndBatches) {
  ASSERT_NE(SharedCluster(), nullptr);
  ASSERT_OK_AND_ASSIGN(auto s, FreshStore(SharedCluster()->endpoints()));
  ASSERT_OK(s->Put(PutOf(Seg("big", 1, 1000), absl::Seconds(30))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d, s->Get("big"));
  EXPECT_EQ(d.buffers_size(), 1000);
  UpdateBuffersRequest add;
  add.set_name("big");
  add.set_owner_key(TestOwnerKey(1));
  for (int i = 0; i < 500; ++i) {
    descriptor::Buffer* b = add.add_add();
    b->set_addr(0x100000ull * 2000 + 0x10000ull * i);
    b->set_length(0x100);
    b->set_location("cpu:0");
  }
  ASSERT_OK(s->UpdateBuffers(add));
  ASSERT_OK_AND_ASSIGN(d, s->Get("big"));
  EXPECT_EQ(d.buffers_size(), 1500);
  UpdateBuffersRequest rm;
  rm.set_name("big");
  rm.set_owner_key(TestOwnerKey(1));
  for (const descriptor::Buffer& b : add.add()) rm.add_remove_addrs(b.addr());
  ASSERT_OK(s->UpdateBuffers(rm));
  ASSERT_OK_AND_ASSIGN(d, s->Get("big"));
  EXPECT_EQ(d.buffers_size(), 1000);
  EXPECT_OK(s->Remove(RemoveOf("big", 1)));
}

// A segment whose buffers are as large as validation allows (a key on
// each of 64 NICs with 60-byte names, about 4.6 KiB each): `buffers` of
// them.
descriptor::SegmentDescriptor FatSegment(const std::string& name, int buffers) {
  descriptor::SegmentDescriptor d = Seg(name, 1, 0);
  descriptor::TransportEndpoint* t = d.add_transports();
  t->set_transport("rdma");
  for (int n = 0; n < 64; ++n) {
    descriptor::Device* dev = t->add_devices();
    dev->set_name(absl::StrCat("nic-", n, "-", std::string(52, 'x')));
    dev->set_gid(std::string(16, '\1'));
  }
  for (int i = 0; i < buffers; ++i) {
    descriptor::Buffer* b = d.add_buffers();
    b->set_addr(0x100000ull * (i + 1));
    b->set_length(0x1000);
    b->set_location("cpu:0");
    for (const descriptor::Device& dev : t->devices()) {
      descriptor::NicKey* k = b->add_keys();
      k->set_nic(dev.name());
      k->set_rkey(static_cast<uint32_t>(0x80000000u + i));
    }
  }
  return d;
}

// Whether `got` (as a store returns it) is `want`, its version aside.
void ExpectSameSegment(descriptor::SegmentDescriptor got,
                       const descriptor::SegmentDescriptor& want) {
  got.clear_version();
  ASSERT_EQ(got.buffers_size(), want.buffers_size());
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
}

// etcd refuses a request larger than its --max-request-bytes (1.5 MiB by
// default). A descriptor larger than that (600 buffers of 4.6 KiB, 2.7 MiB
// encoded) is written in several transactions, each under it, and reads
// back intact; so does an update as large. One larger than validation
// allows (100,000 buffers; at most 65,536) is refused before etcd is asked.
TEST(EtcdStoreTest, DescriptorsLargerThanOneEtcdRequest) {
  ASSERT_NE(SharedCluster(), nullptr);
  ASSERT_OK_AND_ASSIGN(auto s, FreshStore(SharedCluster()->endpoints()));
  const descriptor::SegmentDescriptor fat = FatSegment("fat", 600);
  ASSERT_GT(fat.ByteSizeLong(), size_t{3} << 19);
  ASSERT_OK(s->Put(PutOf(fat, absl::Seconds(30))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, s->Get("fat"));
  ExpectSameSegment(got, fat);

  const descriptor::SegmentDescriptor more = FatSegment("fat", 1000);
  UpdateBuffersRequest add;
  add.set_name("fat");
  add.set_owner_key(TestOwnerKey(1));
  for (int i = 600; i < 1000; ++i) *add.add_add() = more.buffers(i);
  ASSERT_GT(add.ByteSizeLong(), size_t{3} << 19);
  ASSERT_OK(s->UpdateBuffers(add));
  ASSERT_OK_AND_ASSIGN(got, s->Get("fat"));
  ExpectSameSegment(got, more);

  absl::Status too_many = s->Put(PutOf(Seg("huge", 1, 100000))).status();
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument) << too_many;
  EXPECT_TRUE(
      absl::StrContains(too_many.message(), "100000 entries; at most 65536"))
      << too_many;
  EXPECT_STATUS(s->Get("huge"), absl::StatusCode::kNotFound);
}

// A segment is read whole in one reply (one gRPC message, 32 MiB): one
// that would not fit is refused before anything is written, whether put
// whole or grown by an update, so that etcd never holds a segment no one
// can read back (8,000 buffers of 4.6 KiB: 35 MB).
TEST(EtcdStoreTest, SegmentsTooLargeToReadBackAreRefused) {
  ASSERT_NE(SharedCluster(), nullptr);
  ASSERT_OK_AND_ASSIGN(auto s, FreshStore(SharedCluster()->endpoints()));
  const descriptor::SegmentDescriptor huge = FatSegment("fat", 8000);
  absl::Status put = s->Put(PutOf(huge, absl::Seconds(30))).status();
  EXPECT_EQ(put.code(), absl::StatusCode::kResourceExhausted) << put;
  EXPECT_TRUE(absl::StrContains(put.message(), "to read whole from etcd"))
      << put;
  EXPECT_STATUS(s->Get("fat"), absl::StatusCode::kNotFound);

  ASSERT_OK(s->Put(PutOf(FatSegment("fat", 1), absl::Seconds(30))));
  UpdateBuffersRequest add;
  add.set_name("fat");
  add.set_owner_key(TestOwnerKey(1));
  for (int i = 1; i < 8000; ++i) *add.add_add() = huge.buffers(i);
  absl::Status grow = s->UpdateBuffers(add).status();
  EXPECT_EQ(grow.code(), absl::StatusCode::kResourceExhausted) << grow;
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, s->Get("fat"));
  EXPECT_EQ(got.buffers_size(), 1);
}

// Operation counts alone do not bound a transaction's bytes: with etcd
// run at --max-txn-ops=1000 and a store that uses them, 600 of the
// largest buffers would be one 2.7 MiB request, which etcd refuses (its
// --max-request-bytes is the default). Transactions are cut by bytes too.
TEST(EtcdStoreTest, TransactionsAreCutByBytes) {
  ASSERT_OK_AND_ASSIGN(auto cluster,
                       EtcdCluster::Start(1, {"--max-txn-ops=1000"}));
  ASSERT_OK_AND_ASSIGN(auto s, FreshStore(cluster->endpoints(), 1000));
  const descriptor::SegmentDescriptor fat = FatSegment("fat", 600);
  ASSERT_OK(s->Put(PutOf(fat, absl::Seconds(30))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, s->Get("fat"));
  ExpectSameSegment(got, fat);
}

// An update reads only a window below each address it adds, as wide as
// the segment's longest buffer: a long buffer far below is still found,
// and so is one behind more small buffers than the window reads.
TEST(EtcdStoreTest, OverlapsAreFoundFarBelow) {
  ASSERT_NE(SharedCluster(), nullptr);
  ASSERT_OK_AND_ASSIGN(auto s, FreshStore(SharedCluster()->endpoints()));
  descriptor::SegmentDescriptor d = Seg("a", 1, 0);
  descriptor::Buffer* big = d.add_buffers();
  big->set_addr(uint64_t{1} << 40);
  big->set_length(uint64_t{1} << 30);
  big->set_location("cpu:0");
  ASSERT_OK(s->Put(PutOf(d)));
  auto add = [&](uint64_t addr, uint64_t len) {
    UpdateBuffersRequest u;
    u.set_name("a");
    u.set_owner_key(TestOwnerKey(1));
    descriptor::Buffer* b = u.add_add();
    b->set_addr(addr);
    b->set_length(len);
    b->set_location("cpu:0");
    return s->UpdateBuffers(u).status();
  };
  // Inside the 1 GiB buffer, 512 MiB above its start.
  EXPECT_STATUS(add((uint64_t{1} << 40) + (uint64_t{1} << 29), 4096),
                absl::StatusCode::kInvalidArgument);
  // A long buffer that reaches past a new address, and 100 small ones
  // below it, inside the window: the window is cut short before the long
  // one, and the whole segment is read.
  const uint64_t base = uint64_t{1} << 42;
  ASSERT_OK(add(base, uint64_t{1} << 30));
  for (int i = 0; i < 100; ++i) {
    ASSERT_OK(add(base - 16 * (i + 1), 16)) << i;
  }
  EXPECT_STATUS(add(base + (uint64_t{1} << 30) - 4096, 4096),
                absl::StatusCode::kInvalidArgument);
  EXPECT_OK(add(base + (uint64_t{1} << 30), 4096));  // Just past its end.
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, s->Get("a"));
  EXPECT_EQ(got.buffers_size(), 1 + 1 + 100 + 1);
}

// Two clients (two metadata servers, or two engines) on one cluster and
// prefix see one table, and ownership holds across them.
TEST(EtcdStoreTest, TwoClientsShareOneTable) {
  ASSERT_NE(SharedCluster(), nullptr);
  EtcdOptions o;
  o.endpoints = SharedCluster()->endpoints();
  o.prefix = "shared-table/";
  ASSERT_OK_AND_ASSIGN(auto one, EtcdStore::Create(o));
  ASSERT_OK_AND_ASSIGN(auto two, EtcdStore::Create(o));
  ASSERT_OK(one->Put(PutOf(Seg("decode-3", 7, 2), absl::Seconds(30))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d, two->Get("decode-3"));
  EXPECT_EQ(d.incarnation(), 7u);
  EXPECT_STATUS(two->Put(PutOf(Seg("decode-3", 8, 1), absl::Seconds(30))),
                absl::StatusCode::kAlreadyExists);
  EXPECT_STATUS(two->Remove(RemoveOf("decode-3", 8)),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_OK(two->Remove(RemoveOf("decode-3", 7)));  // With the owner's key.
  EXPECT_STATUS(one->Get("decode-3"), absl::StatusCode::kNotFound);
}

// High availability: a 3-member cluster loses its leader mid-run (a new
// one must be elected). Registration, lookup and leases go on.
// A change too large to list in the meta (over 8,192 addresses) is pushed
// whole.
TEST(EtcdStoreTest, HugeChangesArePushedWhole) {
  ASSERT_NE(SharedCluster(), nullptr);
  ASSERT_OK_AND_ASSIGN(auto store, FreshStore(SharedCluster()->endpoints()));
  ASSERT_OK_AND_ASSIGN(uint64_t v0, store->Put(PutOf(Seg("huge", 1, 1))));
  std::atomic<int> whole{0}, buffers{0};
  ASSERT_OK_AND_ASSIGN(
      auto watch, store->WatchSegment("huge", v0, [&](const SegmentEvent& ev) {
        if (!ev.has_full()) return;
        buffers = ev.full().buffers_size();
        whole++;
      }));
  UpdateBuffersRequest batch;
  batch.set_name("huge");
  batch.set_owner_key(TestOwnerKey(1));
  for (int i = 0; i < 9000; ++i) {
    descriptor::Buffer* b = batch.add_add();
    b->set_addr(0x10000000ull + 0x10000ull * i);
    b->set_length(0x1000);
    b->set_location("cpu:0");
  }
  ASSERT_OK(store->UpdateBuffers(batch));
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (buffers.load() != 9001 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(buffers.load(), 9001);
  EXPECT_EQ(whole.load(), 1);
}

// A watcher whose version etcd compacted away (a segment unchanged for a
// long time, opened after auto-compaction) gets on: its watch is created
// from the compaction point, and the next change is pushed.
TEST(EtcdStoreTest, WatchesSurviveCompaction) {
  ASSERT_NE(SharedCluster(), nullptr);
  ASSERT_OK_AND_ASSIGN(auto store, FreshStore(SharedCluster()->endpoints()));
  ASSERT_OK_AND_ASSIGN(uint64_t v0, store->Put(PutOf(Seg("still", 1, 1))));
  for (int i = 0; i < 5; ++i) {  // Revisions move on elsewhere.
    ASSERT_OK(store->Put(PutOf(Seg(absl::StrCat("busy", i), 2 + i, 1))));
  }
  ASSERT_OK_AND_ASSIGN(int64_t compacted, SharedCluster()->Compact());
  ASSERT_GT(compacted, static_cast<int64_t>(v0) + 1);
  std::atomic<int> events{0}, added{0};
  ASSERT_OK_AND_ASSIGN(
      auto watch, store->WatchSegment("still", v0, [&](const SegmentEvent& ev) {
        events++;
        added += ev.add_size();
      }));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(events.load(), 0) << "it had the current version already";
  UpdateBuffersRequest add;
  add.set_name("still");
  add.set_owner_key(TestOwnerKey(1));
  descriptor::Buffer* b = add.add_add();
  b->set_addr(0x7000000);
  b->set_length(0x1000);
  b->set_location("cpu:0");
  ASSERT_OK(store->UpdateBuffers(add));
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (added.load() == 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(added.load(), 1) << "the change after the compaction was pushed";
  EXPECT_EQ(events.load(), 1);
}

// The probe of issue 26: 40,000 segments from one address were never
// refused, etcd hit its quota, and its NOSPACE alarm stopped every Put in
// the cluster. Quotas now hold per client and in all, counted from the
// records in etcd, so a second metadata_server sharing the prefix sees
// the same counts; a refused write changes nothing, and a removal gives
// its share back.
TEST(EtcdStoreTest, QuotasHoldAcrossStoresSharingEtcd) {
  EtcdCluster* c = SharedCluster();
  ASSERT_NE(c, nullptr);
  EtcdOptions o;
  o.endpoints = c->endpoints();
  o.prefix = "quota-test/";
  o.max_client_segments = 3;
  o.max_client_bytes = 16384;
  o.max_bytes = 12000;
  o.usage_refresh = absl::ZeroDuration();
  ASSERT_OK_AND_ASSIGN(auto a, EtcdStore::Create(o));
  ASSERT_OK_AND_ASSIGN(auto b, EtcdStore::Create(o));
  // About 1.2 KB each in etcd (keys included).
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(a->PutFrom(LeasedPutOf(Seg(absl::StrCat("s", i), i + 1, 20)),
                         "ipv4:10.0.0.66"));
  }
  absl::Status s =
      b->PutFrom(LeasedPutOf(Seg("s3", 4, 20)), "ipv4:10.0.0.66").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "10.0.0.66")) << s;
  // Bytes: 400 buffers are over one client's 16 KiB.
  s = b->PutFrom(LeasedPutOf(Seg("big", 9, 400)), "ipv4:10.0.0.77").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  // Updates count too, and a refused one changes nothing.
  ASSERT_OK(b->PutFrom(LeasedPutOf(Seg("grow", 10, 1)), "ipv4:10.0.0.77"));
  UpdateBuffersRequest grow;
  grow.set_name("grow");
  grow.set_incarnation(10);
  grow.set_owner_key(TestOwnerKey(10));
  for (int i = 0; i < 400; ++i) {
    descriptor::Buffer* buf = grow.add_add();
    buf->set_addr(0x1000000000ull + 0x10000ull * i);
    buf->set_length(0x100);
    buf->set_location("cpu:0");
  }
  EXPECT_STATUS(a->UpdateBuffers(grow), absl::StatusCode::kResourceExhausted);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, a->Get("grow"));
  EXPECT_EQ(got.buffers_size(), 1);
  // The total binds every client, those of engines on etcd directly too.
  absl::Status last;
  int more = 0;
  for (; more < 20 && last.ok(); ++more) {
    last = a->PutFrom(LeasedPutOf(Seg(absl::StrCat("t", more), 100 + more, 20)),
                      absl::StrCat("ipv4:10.0.1.", more))
               .status();
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_TRUE(absl::StrContains(last.message(), "its limit")) << last;
  EXPECT_STATUS(a->Put(LeasedPutOf(Seg("direct", 300, 20))),
                absl::StatusCode::kResourceExhausted);
  // A removal gives the share back, as another store counts it.
  ASSERT_OK(a->Remove(RemoveOf("s0", 1)));
  ASSERT_OK(a->Remove(RemoveOf("t0", 100)));
  EXPECT_OK(b->PutFrom(LeasedPutOf(Seg("s3", 4, 20)), "ipv4:10.0.0.66"));
}

// A read of the keys under `prefix` as of `revision`, straight from etcd:
// refused ("compacted") once the store compacted that history away.
grpc::Status ReadAtRevision(EtcdCluster* c, const std::string& prefix,
                            int64_t revision) {
  auto kv = etcdserverpb::KV::NewStub(grpc::CreateChannel(
      "ipv4:" + c->endpoints()[0], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  etcdserverpb::RangeRequest req;
  req.set_key(prefix);
  req.set_revision(revision);
  etcdserverpb::RangeResponse resp;
  return kv->Range(&ctx, req, &resp);
}

// etcd keeps every revision until it is compacted, so updates alone
// would fill its quota. A store compacts what is compact_after old.
TEST(EtcdStoreTest, HistoryIsCompacted) {
  EtcdCluster* c = SharedCluster();
  ASSERT_NE(c, nullptr);
  EtcdOptions o;
  o.endpoints = c->endpoints();
  o.prefix = "compact-test/";
  o.compact_after = absl::Milliseconds(300);
  ASSERT_OK_AND_ASSIGN(auto store, EtcdStore::Create(o));
  ASSERT_OK_AND_ASSIGN(const uint64_t first,
                       store->Put(LeasedPutOf(Seg("c", 1, 2))));
  absl::SleepFor(absl::Milliseconds(400));  // Ages the first write.
  UpdateBuffersRequest r;
  r.set_name("c");
  r.set_incarnation(1);
  r.set_owner_key(TestOwnerKey(1));
  *r.add_add() = TestSegment("x", 1, 3).buffers(2);
  ASSERT_OK(store->UpdateBuffers(r));
  // History before the first write is gone: a read there is refused.
  const grpc::Status g =
      ReadAtRevision(c, "compact-test/", static_cast<int64_t>(first) - 1);
  EXPECT_FALSE(g.ok()) << "revision " << first - 1 << " still readable";
  EXPECT_TRUE(absl::StrContains(g.error_message(), "compacted"))
      << g.error_message();
}

// A client inside its quota that rewrites its records again and again
// writes history faster than compact_after ages it (64 rewrites of 32 MiB
// would fill etcd's 2 GiB quota): a store also compacts, at the current
// revision, once it has written a quarter of max_bytes since the last
// compaction. compact_after is an hour here, so age cannot be the cause.
TEST(EtcdStoreTest, HistoryIsCompactedByVolume) {
  EtcdCluster* c = SharedCluster();
  ASSERT_NE(c, nullptr);
  EtcdOptions o;
  o.endpoints = c->endpoints();
  o.prefix = "volume-compact-test/";
  o.compact_after = absl::Hours(1);
  o.max_bytes = 16384;  // Compacts after 4 KiB: some 15 publications.
  ASSERT_OK_AND_ASSIGN(auto store, EtcdStore::Create(o));
  const auto read_at = [c](int64_t revision) {
    return ReadAtRevision(c, "volume-compact-test/", revision);
  };
  ASSERT_OK_AND_ASSIGN(const uint64_t first,
                       store->Put(LeasedPutOf(Seg("v", 1, 2))));
  const int64_t first_rev = static_cast<int64_t>(first);
  grpc::Status g = read_at(first_rev);
  ASSERT_TRUE(g.ok()) << "one small write compacted: " << g.error_message();
  // The same segment published again, well within every quota, until the
  // history of its first publication is gone.
  int rewrites = 0;
  while (g.ok() && rewrites < 200) {
    ASSERT_OK(store->Put(LeasedPutOf(Seg("v", 1, 2))));
    ++rewrites;
    g = read_at(first_rev);
  }
  EXPECT_FALSE(g.ok()) << "revision " << first << " still readable after "
                       << rewrites << " rewrites";
  EXPECT_TRUE(absl::StrContains(g.error_message(), "compacted"))
      << g.error_message();
  // Not on every write: two publications (under 1 KiB) are far from 4 KiB.
  EXPECT_GT(rewrites, 1);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d, store->Get("v"));
  EXPECT_EQ(d.buffers_size(), 2);
}

TEST(EtcdStoreTest, ThreeMembersSurviveLosingOne) {
  ASSERT_OK_AND_ASSIGN(auto cluster, EtcdCluster::Start(3));
  EtcdOptions o;
  o.endpoints = cluster->endpoints();
  o.prefix = "ha/";
  o.rpc_timeout = absl::Seconds(5);
  ASSERT_OK_AND_ASSIGN(auto store, EtcdStore::Create(o));
  const absl::Duration lease = absl::Seconds(2);
  ASSERT_OK(store->Put(PutOf(Seg("alive", 1, 1), lease)));
  ASSERT_OK(store->Put(PutOf(Seg("dead", 2, 1), lease)));
  // Watches across the loss: the buffer added after it is pushed, and the
  // unrenewed segment's end.
  std::atomic<int> alive_added{0}, dead_gone{0};
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor alive0,
                       store->Get("alive"));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor dead0, store->Get("dead"));
  ASSERT_OK_AND_ASSIGN(
      auto alive_watch,
      store->WatchSegment("alive", alive0.version(),
                          [&](const SegmentEvent& ev) {
                            alive_added.fetch_add(ev.add_size());
                          }));
  ASSERT_OK_AND_ASSIGN(
      auto dead_watch,
      store->WatchSegment("dead", dead0.version(), [&](const SegmentEvent& ev) {
        if (ev.gone()) dead_gone++;
      }));
  std::atomic<bool> stop{false};
  std::atomic<int> renewals{0}, renewal_errors{0};
  std::thread renewer([&] {
    while (!stop.load()) {
      if (store->KeepAlive(KeepAliveOf("alive", 1)).ok()) {
        renewals.fetch_add(1);
      } else {
        renewal_errors.fetch_add(1);
      }
      absl::SleepFor(absl::Milliseconds(400));
    }
  });
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_OK_AND_ASSIGN(int leader, cluster->LeaderIndex());
  cluster->Kill(leader);
  const int renewals_before_loss = renewals.load();
  // Registration and lookup through the survivors.
  ASSERT_OK(store->Put(PutOf(Seg("after", 3, 4), lease)));
  UpdateBuffersRequest add;
  add.set_name("alive");
  add.set_owner_key(TestOwnerKey(1));
  descriptor::Buffer* b = add.add_add();
  b->set_addr(0x7000000);
  b->set_length(0x1000);
  b->set_location("cpu:0");
  ASSERT_OK(store->UpdateBuffers(add));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor after,
                       store->Get("after"));
  EXPECT_EQ(after.buffers_size(), 4);
  // Leases: the renewed one lives past 2 TTLs, the other one expires.
  absl::SleepFor(3 * lease);
  stop.store(true);
  renewer.join();
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor alive,
                       store->Get("alive"));
  EXPECT_EQ(alive.buffers_size(), 2);
  EXPECT_STATUS(store->Get("dead"), absl::StatusCode::kNotFound);
  EXPECT_EQ(alive_added.load(), 1) << "the update after the loss was pushed";
  EXPECT_EQ(dead_gone.load(), 1) << "the expired lease was pushed";
  // Renewals went on through the survivors (about 15 over these 6 s when
  // idle; a slow machine makes fewer, so the bound is loose).
  EXPECT_GE(renewals.load() - renewals_before_loss, 3)
      << renewals.load() << " renewals, " << renewals_before_loss
      << " before the leader was lost";
  ASSERT_OK_AND_ASSIGN(auto names, store->List());
  EXPECT_EQ(names, (std::vector<std::string>{"alive"}))
      << "'after' was put with a lease nobody renewed";
  std::printf("renewals %d, failed while the member died %d\n", renewals.load(),
              renewal_errors.load());
}

}  // namespace
}  // namespace ferry::metadata
