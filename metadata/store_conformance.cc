#include "metadata/store_conformance.h"

#include <map>
#include <set>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/mutex.h"
#include "common/status_testing.h"
#include "metadata/store_testing.h"

namespace ferry::metadata {

void StoreConformanceTest::SetUp() {
  auto store = GetParam().make(GetParam().simulated ? &clock_ : nullptr);
  ASSERT_OK(store);
  store_ = *store;
}

void StoreConformanceTest::PassTime(absl::Duration d) {
  if (GetParam().simulated) {
    clock_.Advance(d);
  } else {
    absl::SleepFor(d);
  }
}

std::string BackendName(const testing::TestParamInfo<StoreBackend>& info) {
  return info.param.name;
}

namespace {

constexpr uint64_t kStride = 0x100000;

descriptor::Buffer BufferAt(uint64_t i) {
  descriptor::Buffer b;
  b.set_addr(0x10000000 + i * kStride);
  b.set_length(0x1000);
  b.set_location("cpu:0");
  return b;
}

descriptor::SegmentDescriptor Seg(const std::string& name, uint64_t incarnation,
                                  int buffers = 1) {
  descriptor::SegmentDescriptor s;
  s.set_name(name);
  s.set_incarnation(incarnation);
  s.set_rpc_address("127.0.0.1:1");
  descriptor::TransportEndpoint* t = s.add_transports();
  t->set_transport("tcp");
  t->set_address("127.0.0.1:2");
  // Out of address order on purpose: Get returns them sorted.
  for (int i = buffers - 1; i >= 0; --i) *s.add_buffers() = BufferAt(i);
  return s;
}

UpdateBuffersRequest UpdateOf(const std::string& name, uint64_t owner) {
  UpdateBuffersRequest r;
  r.set_name(name);
  r.set_incarnation(owner);
  r.set_owner_key(TestOwnerKey(owner));
  return r;
}

TEST_P(StoreConformanceTest, PutGetListRemove) {
  ASSERT_OK_AND_ASSIGN(uint64_t v1, store_->Put(PutOf(Seg("a", 7, 3))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store_->Get("a"));
  EXPECT_EQ(got.incarnation(), 7u);
  EXPECT_EQ(got.version(), v1);
  ASSERT_EQ(got.buffers_size(), 3);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(got.buffers(i).addr(), BufferAt(i).addr());
  EXPECT_EQ(got.transports(0).address(), "127.0.0.1:2");
  ASSERT_OK(store_->Put(PutOf(Seg("b", 8))));
  ASSERT_OK_AND_ASSIGN(auto names, store_->List());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b"}));
  EXPECT_OK(store_->Remove(RemoveOf("a", 7)));
  EXPECT_STATUS(store_->Get("a"), absl::StatusCode::kNotFound);
  EXPECT_STATUS(store_->Remove(RemoveOf("a", 7)), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(names, store_->List());
  EXPECT_EQ(names, std::vector<std::string>{"b"});
}

TEST_P(StoreConformanceTest, OnlyTheOwnerChangesASegment) {
  const absl::Duration lease = absl::Seconds(30);
  ASSERT_OK(store_->Put(PutOf(Seg("a", 7), lease)));
  // Another run, with everything a reader of the descriptor knows.
  absl::Status s = store_->Put(PutOf(Seg("a", 7), lease, /*owner=*/8)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  UpdateBuffersRequest u = UpdateOf("a", 8);
  *u.add_add() = BufferAt(5);
  EXPECT_STATUS(store_->UpdateBuffers(u),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(store_->KeepAlive(KeepAliveOf("a", 8)),
                absl::StatusCode::kFailedPrecondition);
  EXPECT_STATUS(store_->Remove(RemoveOf("a", 8)),
                absl::StatusCode::kFailedPrecondition);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store_->Get("a"));
  EXPECT_EQ(got.buffers_size(), 1);
  // The owner itself publishes again (a re-publication) freely.
  ASSERT_OK(store_->Put(PutOf(Seg("a", 9, 2), lease, /*owner=*/7)));
  ASSERT_OK_AND_ASSIGN(got, store_->Get("a"));
  EXPECT_EQ(got.incarnation(), 9u);
  EXPECT_EQ(got.buffers_size(), 2);
  EXPECT_OK(store_->Remove(RemoveOf("a", 7)));
  // Free again: anyone may take it.
  EXPECT_OK(store_->Put(PutOf(Seg("a", 8), lease)));
}

TEST_P(StoreConformanceTest, UpdatesAreIncrementalAndAllOrNothing) {
  ASSERT_OK_AND_ASSIGN(uint64_t v0, store_->Put(PutOf(Seg("a", 1))));
  UpdateBuffersRequest add = UpdateOf("a", 1);
  *add.add_add() = BufferAt(2);
  *add.add_add() = BufferAt(1);
  ASSERT_OK_AND_ASSIGN(uint64_t v1, store_->UpdateBuffers(add));
  EXPECT_GT(v1, v0);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store_->Get("a"));
  ASSERT_EQ(got.buffers_size(), 3);
  EXPECT_EQ(got.version(), v1);
  EXPECT_EQ(got.buffers(1).addr(), BufferAt(1).addr());
  // A removal plus an overlapping add: neither happens.
  UpdateBuffersRequest bad = UpdateOf("a", 1);
  bad.add_remove_addrs(BufferAt(0).addr());
  descriptor::Buffer overlap = BufferAt(2);
  overlap.set_addr(overlap.addr() + 0x800);
  *bad.add_add() = overlap;
  EXPECT_STATUS(store_->UpdateBuffers(bad), absl::StatusCode::kInvalidArgument);
  UpdateBuffersRequest missing = UpdateOf("a", 1);
  missing.add_remove_addrs(BufferAt(0).addr());
  missing.add_remove_addrs(0x999);
  EXPECT_STATUS(store_->UpdateBuffers(missing), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(got, store_->Get("a"));
  EXPECT_EQ(got.buffers_size(), 3);
  EXPECT_EQ(got.version(), v1) << "a failed update changes nothing";
  UpdateBuffersRequest rm = UpdateOf("a", 1);
  rm.add_remove_addrs(BufferAt(0).addr());
  rm.add_remove_addrs(BufferAt(2).addr());
  ASSERT_OK(store_->UpdateBuffers(rm));
  ASSERT_OK_AND_ASSIGN(got, store_->Get("a"));
  ASSERT_EQ(got.buffers_size(), 1);
  EXPECT_EQ(got.buffers(0).addr(), BufferAt(1).addr());
  EXPECT_STATUS(store_->UpdateBuffers(UpdateOf("nobody", 1)),
                absl::StatusCode::kNotFound);
}

// Unregistering and registering again at the same address, in one
// update (a buffer re-registered with new keys): every backend takes it.
TEST_P(StoreConformanceTest, AnAddressRemovedAndAddedInOneUpdate) {
  ASSERT_OK(store_->Put(PutOf(Seg("a", 1, 2))));
  UpdateBuffersRequest again = UpdateOf("a", 1);
  again.add_remove_addrs(BufferAt(1).addr());
  descriptor::Buffer b = BufferAt(1);
  b.set_length(0x800);
  *again.add_add() = b;
  ASSERT_OK(store_->UpdateBuffers(again));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store_->Get("a"));
  ASSERT_EQ(got.buffers_size(), 2);
  EXPECT_EQ(got.buffers(1).length(), 0x800u);
}

TEST_P(StoreConformanceTest, LeasesExpireUnlessRenewed) {
  const absl::Duration lease = GetParam().min_lease;
  // "kept" last: nothing else (a durable write's fsync) runs between its
  // Put and its first renewal.
  ASSERT_OK(store_->Put(PutOf(Seg("forever", 3))));
  ASSERT_OK(store_->Put(PutOf(Seg("gone", 1), lease)));
  ASSERT_OK(store_->Put(PutOf(Seg("kept", 2), lease)));
  if (GetParam().simulated) {
    // Exactly: there until the moment its lease ends, gone from then on.
    PassTime(lease - absl::Milliseconds(1));
    EXPECT_OK(store_->Get("gone")) << "expired before its lease ended";
    ASSERT_OK(store_->KeepAlive(KeepAliveOf("kept", 2)));
    PassTime(absl::Milliseconds(1));
    EXPECT_STATUS(store_->Get("gone"), absl::StatusCode::kNotFound);
  }
  for (int i = 0; i < 15; ++i) {  // Three leases, renewing "kept".
    PassTime(lease / 5);
    ASSERT_OK_AND_ASSIGN(absl::Duration ttl,
                         store_->KeepAlive(KeepAliveOf("kept", 2)));
    EXPECT_GE(ttl, lease);
  }
  EXPECT_STATUS(store_->Get("gone"), absl::StatusCode::kNotFound);
  EXPECT_STATUS(store_->KeepAlive(KeepAliveOf("gone", 1)),
                absl::StatusCode::kNotFound);
  EXPECT_OK(store_->Get("kept"));
  EXPECT_OK(store_->Get("forever"));
  ASSERT_OK_AND_ASSIGN(auto names, store_->List());
  EXPECT_EQ(names, (std::vector<std::string>{"forever", "kept"}));
  // The expired name is free for a new run.
  EXPECT_OK(store_->Put(PutOf(Seg("gone", 4), lease)));
}

TEST_P(StoreConformanceTest, BadRequestsAreRefusedAndChangeNothing) {
  PutSegmentRequest keyless = PutOf(Seg("a", 1));
  keyless.clear_owner_key();
  EXPECT_STATUS(store_->Put(keyless), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(store_->Put(PutOf(Seg("has space", 1))),
                absl::StatusCode::kInvalidArgument);
  descriptor::SegmentDescriptor overlap = Seg("a", 1, 2);
  overlap.mutable_buffers(0)->set_addr(overlap.buffers(1).addr() + 1);
  EXPECT_STATUS(store_->Put(PutOf(overlap)),
                absl::StatusCode::kInvalidArgument);
  descriptor::SegmentDescriptor wrap = Seg("a", 1);
  wrap.mutable_buffers(0)->set_addr(~uint64_t{0} - 10);
  EXPECT_STATUS(store_->Put(PutOf(wrap)), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(store_->Get(""), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(store_->Get(std::string(300, 'x')),
                absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(auto names, store_->List());
  EXPECT_TRUE(names.empty());
}

// What a watcher builds from the events it is pushed: the whole
// descriptor, then deltas applied in order; `gone` when it went.
class Follower {
 public:
  Store::EventFn Fn() {
    return [this](const SegmentEvent& ev) {
      MutexLock lock(&mu_);
      ++events_;
      if (ev.gone()) {
        gone_ = true;
      } else if (ev.has_full()) {
        gone_ = false;
        copy_ = ev.full();
      } else {
        std::map<uint64_t, descriptor::Buffer> bufs;
        for (const descriptor::Buffer& b : copy_.buffers()) bufs[b.addr()] = b;
        for (uint64_t a : ev.remove_addrs()) bufs.erase(a);
        for (const descriptor::Buffer& b : ev.add()) bufs[b.addr()] = b;
        copy_.clear_buffers();
        for (auto& [a, b] : bufs) *copy_.add_buffers() = b;
        ++deltas_;
      }
      copy_.set_version(ev.version());
      cv_.SignalAll();
    };
  }
  // Waits up to 10 s until the copy is `want` (buffers and version).
  bool WaitFor(const descriptor::SegmentDescriptor& want) {
    MutexLock lock(&mu_);
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (!SameLocked(want) && !cv_.WaitWithDeadline(&mu_, end)) {
    }
    return SameLocked(want);
  }
  bool WaitGone() {
    MutexLock lock(&mu_);
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (!gone_ && !cv_.WaitWithDeadline(&mu_, end)) {
    }
    return gone_;
  }
  int events() {
    MutexLock lock(&mu_);
    return events_;
  }
  int deltas() {
    MutexLock lock(&mu_);
    return deltas_;
  }

 private:
  bool SameLocked(const descriptor::SegmentDescriptor& want)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (gone_ || copy_.version() != want.version() ||
        copy_.buffers_size() != want.buffers_size()) {
      return false;
    }
    for (int i = 0; i < want.buffers_size(); ++i) {
      if (copy_.buffers(i).SerializeAsString() !=
          want.buffers(i).SerializeAsString()) {
        return false;
      }
    }
    return true;
  }

  Mutex mu_;
  CondVar cv_;
  descriptor::SegmentDescriptor copy_ ABSL_GUARDED_BY(mu_);
  bool gone_ ABSL_GUARDED_BY(mu_) = false;
  int events_ ABSL_GUARDED_BY(mu_) = 0;
  int deltas_ ABSL_GUARDED_BY(mu_) = 0;
};

// A watcher that opened the segment sees every later change pushed to it,
// as deltas (registrations, unregistrations, a batch larger than one
// etcd transaction), then its removal; a watcher from version 0 gets the
// whole segment first; an ended watch gets nothing more.
TEST_P(StoreConformanceTest, WatchesPushEveryChange) {
  ASSERT_OK(store_->Put(PutOf(Seg("w", 3, 2))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor opened, store_->Get("w"));
  Follower f;
  auto watch = store_->WatchSegment("w", opened.version(), f.Fn());
  if (watch.status().code() == absl::StatusCode::kUnimplemented) {
    ASSERT_FALSE(GetParam().pushes) << GetParam().name << " must push";
    GTEST_SKIP() << GetParam().name << " cannot push: " << watch.status();
  }
  ASSERT_OK(watch);
  {
    SegmentEvent seed;
    seed.set_version(opened.version());
    *seed.mutable_full() = opened;
    f.Fn()(seed);  // What the opener read.
  }
  UpdateBuffersRequest add = UpdateOf("w", 3);
  *add.add_add() = BufferAt(7);
  ASSERT_OK(store_->UpdateBuffers(add));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor now, store_->Get("w"));
  EXPECT_TRUE(f.WaitFor(now)) << "a registration after the open is pushed";
  UpdateBuffersRequest rm = UpdateOf("w", 3);
  rm.add_remove_addrs(BufferAt(0).addr());
  ASSERT_OK(store_->UpdateBuffers(rm));
  ASSERT_OK_AND_ASSIGN(now, store_->Get("w"));
  EXPECT_TRUE(f.WaitFor(now)) << "an unregistration is pushed";
  UpdateBuffersRequest batch = UpdateOf("w", 3);
  for (int i = 0; i < 150; ++i) *batch.add_add() = BufferAt(100 + i);
  ASSERT_OK(store_->UpdateBuffers(batch));
  ASSERT_OK_AND_ASSIGN(now, store_->Get("w"));
  EXPECT_TRUE(f.WaitFor(now)) << "a batch is pushed";
  // The first change may come whole: a watch is set up asynchronously,
  // and a store may keep changes only for segments watched at the time.
  // Once the first arrived, the watch is there: the others are deltas.
  EXPECT_GE(f.deltas(), 2) << "changes come as deltas, not whole";

  Follower late;
  ASSERT_OK_AND_ASSIGN(auto from_zero, store_->WatchSegment("w", 0, late.Fn()));
  EXPECT_TRUE(late.WaitFor(now)) << "from version 0: the whole segment";

  ASSERT_OK(store_->Remove(RemoveOf("w", 3)));
  EXPECT_TRUE(f.WaitGone());
  EXPECT_TRUE(late.WaitGone());
  watch->reset();
  const int seen = f.events();
  ASSERT_OK(store_->Put(PutOf(Seg("w", 4, 1), absl::ZeroDuration(), 4)));
  ASSERT_OK_AND_ASSIGN(now, store_->Get("w"));
  EXPECT_TRUE(late.WaitFor(now)) << "a publication after gone is pushed whole";
  EXPECT_EQ(f.events(), seen) << "an ended watch is called no more";
}

// Several writers on one segment at once: every change lands, each with
// its own version. (Also the TSan stage's view of each backend.)
TEST_P(StoreConformanceTest, ConcurrentUpdatesAllLand) {
  ASSERT_OK(store_->Put(PutOf(Seg("a", 1))));
  constexpr int kThreads = 4, kEach = 25;
  std::vector<std::vector<uint64_t>> versions(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        UpdateBuffersRequest u = UpdateOf("a", 1);
        *u.add_add() = BufferAt(1 + t * kEach + i);
        auto v = store_->UpdateBuffers(u);
        EXPECT_OK(v);
        if (v.ok()) versions[t].push_back(*v);
        EXPECT_OK(store_->Get("a"));
      }
    });
  }
  for (auto& t : threads) t.join();
  std::set<uint64_t> all;
  for (const auto& v : versions) all.insert(v.begin(), v.end());
  EXPECT_EQ(all.size(), size_t{kThreads * kEach});
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, store_->Get("a"));
  EXPECT_EQ(got.buffers_size(), 1 + kThreads * kEach);
  EXPECT_EQ(got.version(), *all.rbegin());
}

}  // namespace
}  // namespace ferry::metadata
