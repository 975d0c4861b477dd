// Notifications without a peer service or a network: admission within the
// queue's limits, addressing, and what the sender check's answer makes of
// a notification, all on the caller's thread.
#include "engine/notifications.h"

#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/grpc_status.h"

namespace ferry {
namespace {

constexpr uint64_t kIncarnation = 42;

metadata::NotifyRequest Request(const std::string& name,
                                const std::string& message = "m") {
  metadata::NotifyRequest r;
  r.set_from_segment("peer");
  r.set_name(name);
  r.set_message(message);
  return r;
}

// Addressed to `segment`'s run `incarnation`.
metadata::NotifyRequest AddressedTo(const std::string& segment,
                                    uint64_t incarnation) {
  metadata::NotifyRequest r = Request("n");
  r.set_to_segment(segment);
  r.set_to_incarnation(incarnation);
  return r;
}

// Refused, the sender told to read the receiver's descriptor again.
void ExpectToldToRefresh(const absl::Status& s) {
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(metadata::HintOf(s), metadata::Hint::kRefreshReceiver) << s;
}

class NotificationsTest : public ::testing::Test {
 protected:
  // Limits: 4 notifications, 100 bytes; 2 and 50 per sender.
  void Configure(bool refuse_unverified = true) {
    notifications_.Configure(
        {4, 100, 2, 50}, "me", kIncarnation, refuse_unverified,
        [this](const metadata::NotifyRequest&, const std::string&) {
          ++verifications_;
          return verdict_;
        });
  }

  Notifications notifications_;
  absl::Status verdict_;
  int verifications_ = 0;
};

TEST_F(NotificationsTest, QueuesInOrderUntilTaken) {
  Configure();
  ASSERT_OK(notifications_.Receive(Request("a"), "ipv4:10.0.0.1"));
  ASSERT_OK(notifications_.Receive(Request("b"), "ipv4:10.0.0.2"));
  EXPECT_EQ(notifications_.stats().queued, 2u);
  // from_segment, name and message count: "peer" + "a" + "m".
  EXPECT_EQ(notifications_.stats().bytes, 12u);

  const std::vector<Notification> got = notifications_.Take();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].name, "a");
  EXPECT_EQ(got[0].from_segment, "peer");
  EXPECT_EQ(got[0].sender_address, "ipv4:10.0.0.1");
  EXPECT_TRUE(got[0].sender_verified);
  EXPECT_EQ(got[1].name, "b");
  EXPECT_EQ(notifications_.stats().queued, 0u);
  EXPECT_EQ(notifications_.stats().bytes, 0u);
  EXPECT_TRUE(notifications_.Take().empty());
}

TEST_F(NotificationsTest, ASenderHasItsShare) {
  Configure();
  ASSERT_OK(notifications_.Receive(Request("1"), "flood"));
  ASSERT_OK(notifications_.Receive(Request("2"), "flood"));
  // Refused before the sender check: a flood costs no lookups.
  EXPECT_STATUS(notifications_.Receive(Request("3"), "flood"),
                absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(verifications_, 2);
  // Others still get in.
  EXPECT_OK(notifications_.Receive(Request("4"), "quiet"));
  EXPECT_EQ(notifications_.stats().refused, 1u);
  // Taking the queue frees the shares.
  notifications_.Take();
  EXPECT_OK(notifications_.Receive(Request("5"), "flood"));
}

TEST_F(NotificationsTest, ASenderHasItsShareOfBytes) {
  Configure();
  EXPECT_STATUS(
      notifications_.Receive(Request("big", std::string(50, 'x')), "s"),
      absl::StatusCode::kResourceExhausted);
  EXPECT_OK(notifications_.Receive(Request("small"), "s"));
}

TEST_F(NotificationsTest, TheQueueIsBounded) {
  Configure();
  for (const char* sender : {"a", "a", "b", "b"}) {
    ASSERT_OK(notifications_.Receive(Request("n"), sender));
  }
  EXPECT_STATUS(notifications_.Receive(Request("n"), "d"),
                absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(notifications_.stats().queued, 4u);
  EXPECT_EQ(notifications_.stats().refused, 1u);
}

// An IPv6 sender is its /64: addresses within one share one share.
TEST_F(NotificationsTest, AnIpv6SenderIsItsSlash64) {
  Configure();
  ASSERT_OK(notifications_.Receive(Request("n"), "ipv6:[fd00::1]"));
  ASSERT_OK(notifications_.Receive(Request("n"), "ipv6:[fd00::2]"));
  EXPECT_STATUS(notifications_.Receive(Request("n"), "ipv6:[fd00::3]"),
                absl::StatusCode::kResourceExhausted);
  EXPECT_OK(notifications_.Receive(Request("n"), "ipv6:[fd00:0:0:1::1]"));
}

TEST_F(NotificationsTest, AnotherSegmentsNotificationIsRefused) {
  // Whatever refuse_unverified says.
  Configure(/*refuse_unverified=*/false);
  ExpectToldToRefresh(
      notifications_.Receive(AddressedTo("someone-else", kIncarnation), "s"));
  EXPECT_EQ(verifications_, 0);
  EXPECT_EQ(notifications_.stats().refused, 1u);
  EXPECT_EQ(notifications_.stats().queued, 0u);
}

TEST_F(NotificationsTest, AnEarlierRunsNotificationIsRefused) {
  Configure(/*refuse_unverified=*/false);
  ExpectToldToRefresh(
      notifications_.Receive(AddressedTo("me", kIncarnation - 1), "s"));
  EXPECT_EQ(verifications_, 0);
  EXPECT_OK(notifications_.Receive(AddressedTo("me", kIncarnation), "s"));
  EXPECT_EQ(verifications_, 1);
}

TEST_F(NotificationsTest, ASignatureMustNameItsReceiver) {
  Configure(/*refuse_unverified=*/true);
  metadata::NotifyRequest r = Request("n");
  r.set_signature("sig");
  EXPECT_STATUS(notifications_.Receive(r, "s"),
                absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(verifications_, 0);
  EXPECT_EQ(notifications_.stats().refused, 1u);
}

TEST_F(NotificationsTest, UnverifiedIsQueuedAsSuchWhenAllowed) {
  Configure(/*refuse_unverified=*/false);
  verdict_ = absl::PermissionDeniedError("not its key");
  ASSERT_OK(notifications_.Receive(Request("n"), "s"));
  const std::vector<Notification> got = notifications_.Take();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_FALSE(got[0].sender_verified);
  EXPECT_EQ(notifications_.stats().refused, 0u);
}

TEST_F(NotificationsTest, UnverifiedIsRefusedWhenNot) {
  Configure(/*refuse_unverified=*/true);
  verdict_ = absl::PermissionDeniedError("not its key");
  const absl::Status refused = notifications_.Receive(Request("n"), "s");
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_FALSE(metadata::IsRetryLater(refused)) << refused;
  // A check that cannot be made now is one to try again.
  verdict_ = absl::UnavailableError("metadata down");
  const absl::Status later = notifications_.Receive(Request("n"), "s");
  EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable) << later;
  EXPECT_TRUE(metadata::IsRetryLater(later)) << later;
  EXPECT_EQ(notifications_.stats().refused, 2u);
  EXPECT_EQ(notifications_.stats().queued, 0u);
}

}  // namespace
}  // namespace ferry
