// SegmentPublisher against an in-memory SegmentStore, both on one
// SimulatedClock: lease renewals, publishing again after the store lost
// the segment, and the wait for a name another run holds, in simulated
// time (no test here sleeps for what it checks).
#include "engine/segment_publisher.h"

#include <atomic>
#include <optional>
#include <thread>

#include "absl/time/clock.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/segment_store.h"
#include "metadata/store_testing.h"

namespace ferry {
namespace {

using metadata::PutOf;
using metadata::RemoveOf;
using metadata::SegmentStore;
using metadata::TestOwnerKey;
using metadata::TestSegment;

constexpr absl::Duration kTtl = absl::Seconds(3);

// Once a thread waits on `clock` for a moment still ahead (the publisher
// has finished what its last wake-up started), moves the clock there.
// False if `stop()` holds first, or if nothing waits within 10 s of real
// time.
template <typename Stop>
bool AdvanceToNextWake(SimulatedClock& clock, Stop stop) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!stop() && absl::Now() < give_up) {
    const std::optional<absl::Time> next = clock.NextDeadline();
    if (next.has_value() && *next > clock.Now()) {
      clock.AdvanceTo(*next);
      return true;
    }
    absl::SleepFor(absl::Microseconds(100));  // Polling, bounded above.
  }
  return false;
}

bool AdvanceToNextWake(SimulatedClock& clock) {
  return AdvanceToNextWake(clock, [] { return false; });
}

// The renewer keeps the lease for as long as it runs: after ten TTLs the
// segment is still published, while one put with the same lease and not
// renewed expired.
TEST(SegmentPublisherTest, RenewsTheLease) {
  SimulatedClock clock;  // Outlives the store and the publisher.
  SegmentStore store(&clock);
  SegmentPublisher publisher(&store, TestOwnerKey(7), kTtl, &clock);
  ASSERT_OK(publisher.Publish(TestSegment("renewed", 7, 2)));
  ASSERT_OK(store.Put(PutOf(TestSegment("unrenewed", 8, 1), kTtl)));
  const absl::Time start = clock.Now();
  int renewals = 0;
  while (clock.Now() - start < 10 * kTtl) {
    ASSERT_TRUE(AdvanceToNextWake(clock)) << "the renewer stopped";
    ++renewals;
  }
  // Every lease_ttl / 3.
  EXPECT_EQ(renewals, 30);
  ASSERT_TRUE(AdvanceToNextWake(clock));  // The last renewal ran.
  EXPECT_OK(store.Get("renewed"));
  EXPECT_STATUS(store.Get("unrenewed"), absl::StatusCode::kNotFound);
  EXPECT_EQ(publisher.republished(), 0u);
}

// The store lost the segment (a metadata_server restarted without its
// data): the next renewal publishes it again, with every buffer added
// since.
TEST(SegmentPublisherTest, PublishesAgainWhatTheStoreLost) {
  SimulatedClock clock;
  SegmentStore store(&clock);
  SegmentPublisher publisher(&store, TestOwnerKey(7), kTtl, &clock);
  ASSERT_OK(publisher.Publish(TestSegment("lost", 7, 2)));
  descriptor::Buffer added;
  added.set_addr(0x900000);
  added.set_length(0x1000);
  added.set_location("cpu:0");
  ASSERT_OK(publisher.AddBuffers({added}));
  ASSERT_OK(store.Remove(RemoveOf("lost", 7)));
  ASSERT_TRUE(AdvanceToNextWake(clock));  // The renewal that finds it gone.
  // Once it waits for the next one, the segment is back.
  ASSERT_TRUE(AdvanceToNextWake(clock));
  EXPECT_EQ(publisher.republished(), 1u);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor back, store.Get("lost"));
  EXPECT_EQ(back.buffers_size(), 3);
  EXPECT_EQ(back.incarnation(), 7u);
}

// Publish of a name another run holds asks again every kNameRetry: it
// gives up once name_wait has passed, and takes the name as soon as the
// holder's lease has run out within it.
// A store whose first puts fail Unavailable (a connection reset on the way).
class RefusingStore : public metadata::Store {
 public:
  RefusingStore(Clock* clock, int refusals)
      : store_(clock), refusals_(refusals) {}
  absl::StatusOr<uint64_t> Put(const metadata::PutSegmentRequest& r) override {
    if (refusals_.fetch_sub(1) > 0) {
      return absl::UnavailableError("connection reset");
    }
    return store_.Put(r);
  }
  absl::StatusOr<absl::Duration> KeepAlive(
      const metadata::KeepAliveRequest& r) override {
    return store_.KeepAlive(r);
  }
  absl::StatusOr<uint64_t> UpdateBuffers(
      const metadata::UpdateBuffersRequest& r) override {
    return store_.UpdateBuffers(r);
  }
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override {
    return store_.Get(name);
  }
  absl::Status Remove(const metadata::RemoveSegmentRequest& r) override {
    return store_.Remove(r);
  }
  absl::StatusOr<std::vector<std::string>> List() override {
    return store_.List();
  }
  std::string Describe() const override { return "refusing"; }

 private:
  SegmentStore store_;
  std::atomic<int> refusals_;
};

// A put refused at once is tried again, a few times; then Init's status.
TEST(SegmentPublisherTest, RetriesAQuickUnavailable) {
  for (int refusals : {SegmentPublisher::kUnavailableRetries,
                       SegmentPublisher::kUnavailableRetries + 1}) {
    SimulatedClock clock;
    RefusingStore store(&clock, refusals);
    SegmentPublisher publisher(&store, TestOwnerKey(7), absl::ZeroDuration(),
                               &clock);
    std::atomic<bool> returned{false};
    absl::Status s;
    std::thread caller([&] {
      s = publisher.Publish(TestSegment("flaky", 7, 1));
      returned = true;
    });
    while (AdvanceToNextWake(clock, [&] { return returned.load(); })) {
    }
    caller.join();
    if (refusals <= SegmentPublisher::kUnavailableRetries) {
      EXPECT_OK(s);
      EXPECT_OK(store.Get("flaky"));
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    }
  }
}

TEST(SegmentPublisherTest, WaitsForATakenNameUpToNameWait) {
  SimulatedClock clock;
  SegmentStore store(&clock);
  // Held by run 8 with a lease it will not renew.
  ASSERT_OK(store.Put(PutOf(TestSegment("taken", 8, 1), kTtl)));
  // Without a lease of its own, so that no renewer moves the clock once
  // it has the name: the caller's retries are all that waits on it.
  SegmentPublisher publisher(&store, TestOwnerKey(7), absl::ZeroDuration(),
                             &clock);

  auto publish = [&](absl::Duration name_wait, absl::Duration* took) {
    const absl::Time start = clock.Now();
    std::atomic<bool> returned{false};
    absl::Status s;
    std::thread caller([&] {
      s = publisher.Publish(TestSegment("taken", 7, 1), name_wait);
      *took = clock.Now() - start;
      returned = true;
    });
    while (AdvanceToNextWake(clock, [&] { return returned.load(); })) {
    }
    caller.join();
    return s;
  };

  absl::Duration took;
  absl::Status s = publish(absl::Seconds(1), &took);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_GE(took, absl::Seconds(1));
  EXPECT_LE(took, absl::Seconds(1) + SegmentPublisher::kNameRetry);

  // 1 s of the holder's 3 s lease is gone; the name frees up 2 s from now.
  s = publish(absl::Seconds(5), &took);
  EXPECT_OK(s);
  EXPECT_GE(took, kTtl - absl::Seconds(1));
  EXPECT_LE(took, kTtl - absl::Seconds(1) + SegmentPublisher::kNameRetry);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor now, store.Get("taken"));
  EXPECT_EQ(now.incarnation(), 7u);
}

}  // namespace
}  // namespace ferry
