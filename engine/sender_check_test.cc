#include "engine/sender_check.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/identity.h"
#include "common/mutex.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

// A metadata store of descriptors by name that counts its reads and can be
// taken out of reach.
class FakeStore final : public metadata::Store {
 public:
  void Add(const std::string& name, const std::string& key,
           const std::string& rpc = "127.0.0.1:4000") {
    descriptor::SegmentDescriptor d;
    d.set_name(name);
    d.set_incarnation(1);
    d.set_rpc_address(rpc);
    d.set_identity_key(key);
    MutexLock lock(&mu_);
    segments_[name] = d;
  }
  void SetDown(bool down) { down_ = down; }
  int reads() const { return reads_; }
  // Reads from now on answer what they found only once Release() is
  // called (or 10 s passed): a slow or hung store. The gate is the
  // store's own: the check's reader threads may still be leaving it when
  // a test ends.
  void Hold() {
    MutexLock lock(&mu_);
    held_ = true;
  }
  void Release() {
    MutexLock lock(&mu_);
    held_ = false;
    released_.SignalAll();
  }

  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override {
    if (down_) {
      ++reads_;
      return absl::UnavailableError("the store is down");
    }
    absl::StatusOr<descriptor::SegmentDescriptor> found =
        absl::NotFoundError(name);
    {
      MutexLock lock(&mu_);
      if (auto it = segments_.find(name); it != segments_.end()) {
        found = it->second;
      }
    }
    // Counted once it has looked: a test that waits for a read to begin
    // may then change the store without the read seeing it.
    ++reads_;
    {
      MutexLock lock(&mu_);
      const absl::Time until = absl::Now() + absl::Seconds(10);
      while (held_ && !released_.WaitWithDeadline(&mu_, until)) {
      }
    }
    return found;
  }
  absl::StatusOr<uint64_t> Put(const metadata::PutSegmentRequest&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<absl::Duration> KeepAlive(
      const metadata::KeepAliveRequest&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<uint64_t> UpdateBuffers(
      const metadata::UpdateBuffersRequest&) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status Remove(const metadata::RemoveSegmentRequest&) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::vector<std::string>> List() override {
    return absl::UnimplementedError("fake");
  }
  std::string Describe() const override { return "fake"; }

 private:
  Mutex mu_;
  absl::flat_hash_map<std::string, descriptor::SegmentDescriptor> segments_
      ABSL_GUARDED_BY(mu_);
  std::atomic<bool> down_{false};
  std::atomic<int> reads_{0};
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  CondVar released_;
};

// The check's clock, moved by the tests (while checks run on other
// threads in some).
class FakeTime {
 public:
  explicit FakeTime(absl::Time t) { *this = t; }
  operator absl::Time() const {  // NOLINT: reads as the time it holds.
    return absl::FromUnixNanos(ns_.load());
  }
  FakeTime& operator=(absl::Time t) {
    ns_.store(absl::ToUnixNanos(t));
    return *this;
  }
  FakeTime& operator+=(absl::Duration d) {
    ns_.fetch_add(absl::ToInt64Nanoseconds(d));
    return *this;
  }

 private:
  std::atomic<int64_t> ns_{0};
};
FakeTime fake_now(absl::UnixEpoch() + absl::Hours(1));
absl::Time FakeNow() { return fake_now; }

class SenderCheckTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_now = absl::UnixEpoch() + absl::Hours(1);
    auto k = IdentityKey::Generate();
    ASSERT_OK(k);
    key_ = *k;
    store_.Add("prefill-0", key_->public_key());
  }

  absl::Status Check(const std::string& claimed, const std::string& caller,
                     const std::string& content,
                     std::optional<uint64_t> seq = std::nullopt) {
    auto sig = key_->Sign(content);
    EXPECT_OK(sig);
    return check_.Verify(claimed, caller, content, sig.ok() ? *sig : "", seq);
  }

  FakeStore store_;
  SenderCheck check_{&store_, absl::Seconds(10), &FakeNow};
  std::shared_ptr<const IdentityKey> key_;
};

TEST(BareCallerHostTest, AddressesAndGroups) {
  EXPECT_EQ(BareCallerHost("ipv4:10.0.0.7"), "10.0.0.7");
  EXPECT_EQ(BareCallerHost("ipv6:[fd00::7]"), "fd00::7");
  EXPECT_EQ(BareCallerHost("ipv6:[::ffff:10.0.0.7]"), "10.0.0.7");
  // A caller group, as lookup budgets are kept (metadata::AddressGroup).
  EXPECT_EQ(BareCallerHost("ipv6:[2001:db8::]/64"), "2001:db8::/64");
}

TEST_F(SenderCheckTest, SignedBySegmentsKey) {
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  EXPECT_EQ(store_.reads(), 1);
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.8", "n"));
  EXPECT_EQ(store_.reads(), 1) << "cached";
  const absl::Status s =
      check_.Verify("prefill-0", "ipv4:10.0.0.7", "m", std::string(64, 'x'));
  EXPECT_FALSE(s.ok()) << s;
  // A malformed signature costs no read.
  fake_now += absl::Seconds(5);
  const absl::Status bad =
      check_.Verify("prefill-0", "ipv4:10.0.0.7", "m", "short");
  EXPECT_EQ(bad.code(), absl::StatusCode::kPermissionDenied) << bad;
  EXPECT_EQ(store_.reads(), 1);
}

TEST_F(SenderCheckTest, RefusalOnAnOlderReadIsTryAgain) {
  ASSERT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  // Read 100 ms ago: not read again so soon; the caller may retry.
  fake_now += absl::Milliseconds(100);
  const std::string forged(kSignatureBytes, 'x');
  absl::Status s = check_.Verify("prefill-0", "ipv4:10.0.0.7", "m", forged);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(store_.reads(), 1);
  // Past kRecheckAfter: read again, and then the refusal stands.
  fake_now += SenderCheck::kRecheckAfter;
  s = check_.Verify("prefill-0", "ipv4:10.0.0.7", "m", forged);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_EQ(store_.reads(), 2);
}

// A check that joins a read begun before it (and before the sender
// restarted) must not take that read's answer for one made since: it
// reads again, and the new key is accepted.
TEST_F(SenderCheckTest, AReadIsAsOfWhenItBegan) {
  store_.Hold();
  fake_now += SenderCheck::kCacheFor;  // Nothing cached.
  absl::Status first_status;
  std::thread first(
      [&] { first_status = Check("prefill-0", "ipv4:10.0.0.7", "m"); });
  while (store_.reads() == 0) absl::SleepFor(absl::Milliseconds(1));
  // The sender restarts with a new key while that read is out.
  auto restarted = IdentityKey::Generate();
  ASSERT_OK(restarted);
  store_.Add("prefill-0", (*restarted)->public_key());
  fake_now += absl::Seconds(1);
  absl::Status joined;
  std::thread second([&] {
    const std::string content = "after the restart";
    auto sig = (*restarted)->Sign(content);
    ASSERT_OK(sig);
    joined = check_.Verify("prefill-0", "ipv4:10.0.0.8", content, *sig);
  });
  // It joins the read: both checks wait on it (the first one counts from
  // the start, so waiting for one would not wait for the second at all;
  // bounded: the held read gives up after 10 s).
  for (int i = 0; i < 1000 && check_.WaitingForTesting() < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const int waiting = check_.WaitingForTesting();
  store_.Release();
  first.join();
  second.join();
  EXPECT_EQ(waiting, 2);
  EXPECT_OK(joined);
  EXPECT_EQ(store_.reads(), 2);
  // The first check is accepted on the read it waited for -- or, if it
  // woke only after the second check's fresh read, refused on the
  // restarted sender's key, read since it began: a final answer either
  // way (seen both ways under the sanitizers), never "try again".
  EXPECT_TRUE(first_status.ok() ||
              first_status.code() == absl::StatusCode::kPermissionDenied)
      << first_status;
}

// A store that hangs holds a bounded number of checks, each for a bounded
// time: the threads that serve calls stay free for cached senders.
TEST_F(SenderCheckTest, ChecksWaitingOnOneReadAreBounded) {
  ASSERT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));  // Cached.
  store_.Add("prefill-1", key_->public_key());
  store_.Hold();
  std::vector<std::thread> threads;
  std::atomic<int> unavailable{0};
  for (int i = 0; i < SenderCheck::kMaxWaiting; ++i) {
    threads.emplace_back([&] {
      if (Check("prefill-1", "ipv4:10.0.0.7", "m").code() ==
          absl::StatusCode::kUnavailable) {
        ++unavailable;
      }
    });
  }
  for (int i = 0;
       i < 1000 && check_.WaitingForTesting() < SenderCheck::kMaxWaiting; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(check_.WaitingForTesting(), SenderCheck::kMaxWaiting);
  EXPECT_EQ(store_.reads(), 2) << "one read for all of them";
  const absl::Time start = absl::Now();
  const absl::Status over = Check("prefill-1", "ipv4:10.0.0.7", "m");
  EXPECT_EQ(over.code(), absl::StatusCode::kUnavailable) << over;
  EXPECT_NE(over.message().find("too many checks wait"), std::string::npos)
      << over;
  // A sender whose key is cached is checked while the store hangs.
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  EXPECT_LT(absl::Now() - start, SenderCheck::kReadWait) << "at once";
  // The waiters give up after kReadWait, while the read still hangs.
  for (int i = 0; i < 200 && unavailable < SenderCheck::kMaxWaiting; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(unavailable.load(), SenderCheck::kMaxWaiting);
  EXPECT_EQ(check_.WaitingForTesting(), 0);
  store_.Release();
  for (auto& t : threads) t.join();
  EXPECT_EQ(store_.reads(), 2);
}

// A storm of new senders beyond the checks that may wait: each is told to
// try again at once, but its read is queued, not dropped, and the next try
// passes on the answer it left, with no read of its own.
TEST_F(SenderCheckTest, ChecksBeyondTheWaitersAreQueuedNotLost) {
  constexpr int kSenders = 40;
  for (int i = 0; i < kSenders; ++i) {
    store_.Add(absl::StrCat("storm-", i), key_->public_key());
  }
  store_.Hold();
  std::vector<std::thread> waiters;
  for (int i = 0; i < SenderCheck::kMaxWaiting; ++i) {
    waiters.emplace_back([this, i] {
      EXPECT_OK(Check(absl::StrCat("storm-", i), "ipv4:10.0.0.7", "m"));
    });
  }
  for (int i = 0;
       i < 1000 && check_.WaitingForTesting() < SenderCheck::kMaxWaiting; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(check_.WaitingForTesting(), SenderCheck::kMaxWaiting);
  for (int i = SenderCheck::kMaxWaiting; i < kSenders; ++i) {
    const absl::Status s =
        Check(absl::StrCat("storm-", i), "ipv4:10.0.0.7", "m");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  }
  store_.Release();
  for (auto& t : waiters) t.join();
  // Every name was queued once; the reads finish in the background.
  for (int i = 0; i < 1000 && store_.reads() < kSenders; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(store_.reads(), kSenders);
  for (int i = SenderCheck::kMaxWaiting; i < kSenders; ++i) {
    EXPECT_OK(Check(absl::StrCat("storm-", i), "ipv4:10.0.0.7", "m")) << i;
  }
  EXPECT_EQ(store_.reads(), kSenders) << "the tries again read nothing";
}

// A segment restarted as a release without keys (a rollback) sends
// unsigned calls: refused as the other mismatches are, on a read made since
// the call, so the rollback is seen, not refused for the cache's 30 s.
TEST_F(SenderCheckTest, UnsignedCallsAreCheckedOnAFreshRead) {
  ASSERT_OK(Check("prefill-0", "ipv4:127.0.0.1", "m"));
  EXPECT_EQ(store_.reads(), 1);
  store_.Add("prefill-0", "");  // Rolled back: no key, published at 127.0.0.1.
  fake_now += absl::Seconds(1);
  EXPECT_OK(check_.Verify("prefill-0", "ipv4:127.0.0.1", "m", ""));
  EXPECT_EQ(store_.reads(), 2);
  // Keyed again, read again once the keyless answer expired: an unsigned
  // call is refused for good on that read.
  store_.Add("prefill-0", key_->public_key());
  fake_now += SenderCheck::kCacheFor;
  const absl::Status s = check_.Verify("prefill-0", "ipv4:127.0.0.1", "m", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("not signed"), std::string::npos) << s;
}

TEST_F(SenderCheckTest, EachCallerReadsAtABoundedRate) {
  const int burst = static_cast<int>(SenderCheck::kLookupBurst);
  for (int i = 0; i < burst; ++i) {
    const absl::Status s =
        Check(absl::StrCat("made-up-", i), "ipv4:10.6.6.6", "m");
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  }
  EXPECT_EQ(store_.reads(), burst);
  absl::Status s = Check("made-up-x", "ipv4:10.6.6.6", "m");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(store_.reads(), burst) << "over its budget: no read";
  // Another caller is not held to that one's budget.
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  // And the budget comes back with time (the made-up names are read
  // again once their answers are older than kAbsentFor).
  fake_now += absl::Seconds(1);
  s = Check("made-up-y", "ipv4:10.6.6.6", "m");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
}

// A host that starts many engines at once (a handshake storm) makes this
// engine read each new segment once: reads for checks that pass cost the
// caller nothing; reads for real names with forged signatures still drain
// its budget.
TEST_F(SenderCheckTest, ReadsForChecksThatPassAreFree) {
  const int burst = static_cast<int>(SenderCheck::kLookupBurst);
  for (int i = 0; i < 4 * burst; ++i) {
    const std::string name = absl::StrCat("storm-", i);
    store_.Add(name, key_->public_key());
    EXPECT_OK(Check(name, "ipv4:10.6.6.6", "m")) << name;
  }
  EXPECT_EQ(store_.reads(), 4 * burst);
  ASSERT_OK_AND_ASSIGN(auto other, IdentityKey::Generate());
  for (int i = 0; i <= burst; ++i) {
    const std::string name = absl::StrCat("forged-", i);
    store_.Add(name, other->public_key());  // Real, but not key_'s.
    const absl::Status s = Check(name, "ipv4:10.6.6.6", "m");
    EXPECT_EQ(s.code(), i < burst ? absl::StatusCode::kPermissionDenied
                                  : absl::StatusCode::kUnavailable)
        << i << ": " << s;
  }
  EXPECT_EQ(store_.reads(), 5 * burst) << "over its budget: no read";
}

// A replayed call verifies (its signature is real) but is refused as a
// replay: it must not give back the token of a read a forged call caused,
// or a host could make reads for ever by alternating the two.
TEST_F(SenderCheckTest, ReplayedCallsRefundNothing) {
  ASSERT_OK(Check("prefill-0", "ipv4:10.6.6.6", "m", 1));
  // Past kRecheckAfter (the budget full again), a forged call makes a
  // fresh read: with the clock held from here, it takes the last token.
  fake_now += SenderCheck::kRecheckAfter;
  const int burst = static_cast<int>(SenderCheck::kLookupBurst);
  for (int i = 0; i < burst - 1; ++i) {  // One token left.
    const absl::Status s =
        Check(absl::StrCat("made-up-", i), "ipv4:10.6.6.6", "m");
    ASSERT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  }
  ASSERT_OK_AND_ASSIGN(auto other, IdentityKey::Generate());
  ASSERT_OK_AND_ASSIGN(std::string forged, other->Sign("m"));
  const int reads = store_.reads();
  absl::Status s = check_.Verify("prefill-0", "ipv4:10.6.6.6", "m", forged);
  ASSERT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  ASSERT_EQ(store_.reads(), reads + 1);
  // The call numbered 1 again: signed by the key, refused as a replay.
  s = Check("prefill-0", "ipv4:10.6.6.6", "m", 1);
  ASSERT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  // No token came back: the next read is refused.
  s = Check("made-up-last", "ipv4:10.6.6.6", "m");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(store_.reads(), reads + 1);
}

TEST_F(SenderCheckTest, MadeUpNamesDoNotPushOutRealOnes) {
  ASSERT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  const int reads = store_.reads();
  // Many made-up names, from as many callers (each within its budget).
  for (size_t i = 0; i < SenderCheck::kMaxCached + 10; ++i) {
    (void)Check(absl::StrCat("made-up-", i), absl::StrCat("ipv4:10.7.", i),
                "m");
  }
  const int after = store_.reads();
  EXPECT_GT(after, reads);
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  EXPECT_EQ(store_.reads(), after) << "prefill-0 is still cached";
}

TEST_F(SenderCheckTest, AnOutageUsesTheKeyLastRead) {
  ASSERT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  store_.SetDown(true);
  fake_now += SenderCheck::kCacheFor + absl::Seconds(1);
  // Read again (its answer is old), which fails: the key last read, within
  // the grace (10 s here past the cache time).
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
  const int reads = store_.reads();
  // No new read while the store is marked down.
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "n"));
  const absl::Status unknown = Check("prefill-9", "ipv4:10.0.0.7", "m");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnavailable) << unknown;
  EXPECT_EQ(store_.reads(), reads);
  // Past the grace: Unavailable.
  fake_now += absl::Seconds(10);
  ASSERT_GT(absl::Time(fake_now) - absl::Hours(1) - absl::UnixEpoch(),
            SenderCheck::kCacheFor + absl::Seconds(10));
  const absl::Status late = Check("prefill-0", "ipv4:10.0.0.7", "m");
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << late;
  store_.SetDown(false);
  fake_now += SenderCheck::kStoreDownFor;
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m"));
}

TEST_F(SenderCheckTest, NumberedCallsAreAcceptedOnce) {
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m", 5));
  absl::Status s = Check("prefill-0", "ipv4:10.0.0.7", "m", 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_OK(Check("prefill-0", "ipv4:10.0.0.7", "m", 4));
  EXPECT_OK(
      Check("prefill-0", "ipv4:10.0.0.7", "m", 5 + ReplayWindows::kWindow));
  // Too old to tell from a replay: sent again it would get a new number.
  s = Check("prefill-0", "ipv4:10.0.0.7", "m", 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(SenderCheckTest, KeylessSegmentsAreHeldToTheirHost) {
  store_.Add("old", "", "10.0.0.9:4000");
  EXPECT_OK(check_.Verify("old", "ipv4:10.0.0.9", "m", ""));
  const absl::Status s = check_.Verify("old", "ipv4:10.0.0.7", "m", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  // Where the caller asks for no host check (Exchange), they pass.
  EXPECT_OK(check_.Verify("old", "ipv4:10.0.0.7", "m", "", std::nullopt,
                          /*check_host=*/false));
}

// P2P with no host check (Exchange): the claimed address is read for its
// key wherever it is, but never a wildcard, nor loopback for a remote
// caller (that would have the engine call its own host's services on a
// stranger's say-so).
TEST(SenderCheckP2pTest, ExchangesAreCheckedByTheClaimedAddressesKey) {
  auto key = IdentityKey::Generate();
  ASSERT_OK(key);
  FakeStore store;
  store.Add("10.0.0.9:4000", (*key)->public_key(), "10.0.0.9:4000");
  store.Add("127.0.0.1:4000", (*key)->public_key(), "127.0.0.1:4000");
  SenderCheck check(&store, absl::Seconds(10), &FakeNow, /*p2p=*/true);
  ASSERT_OK_AND_ASSIGN(std::string sig, (*key)->Sign("m"));
  auto exchange = [&](const std::string& claimed, const std::string& caller,
                      const std::string& signature) {
    return check.Verify(claimed, caller, "m", signature, std::nullopt,
                        /*check_host=*/false);
  };
  // From another address of the host (several interfaces, NAT): read and
  // checked, not refused for the host.
  EXPECT_OK(exchange("10.0.0.9:4000", "ipv4:10.0.0.8", sig));
  absl::Status s = exchange("10.0.0.9:4000", "ipv4:10.0.0.8", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  const int reads = store.reads();
  for (const char* claimed :
       {"127.0.0.1:4000", "0.0.0.0:4000", "nonsense", "localhost:4000",
        "127.1:4000", "2130706433:4000", "0:4000", "[::]:4000", "[::1]:4000",
        "[::ffff:7f00:1]:4000", "[::ffff:127.0.0.1]:4000",
        "[::ffff:0.0.0.0]:4000"}) {
    s = exchange(claimed, "ipv4:10.0.0.8", sig);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  }
  EXPECT_EQ(store.reads(), reads) << "read an address it should not dial";
  EXPECT_OK(exchange("127.0.0.1:4000", "ipv4:127.0.0.1", sig));
}

}  // namespace
}  // namespace ferry
