#include "common/log.h"

#include <string>
#include <tuple>
#include <vector>

#include "common/mutex.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::log {
namespace {

struct Captured {
  Mutex mu;
  std::vector<std::tuple<Level, std::string, std::string>> lines
      ABSL_GUARDED_BY(mu);
};

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetClock(&clock_);
    SetLevel(Level::kInfo);
    SetSink([this](Level l, absl::string_view c, absl::string_view m) {
      MutexLock lock(&got_.mu);
      got_.lines.emplace_back(l, std::string(c), std::string(m));
    });
  }
  void TearDown() override {
    SetSink(nullptr);
    SetLevel(Level::kInfo);
    SetClock(nullptr);
  }
  std::vector<std::tuple<Level, std::string, std::string>> Lines() {
    MutexLock lock(&got_.mu);
    return got_.lines;
  }
  SimulatedClock clock_;
  Captured got_;
};

TEST_F(LogTest, HostSinkGetsLevelComponentAndMessage) {
  FERRY_LOG(kInfo, "rdma", "endpoint ", 7, " connected");
  FERRY_LOG(kDebug, "rdma", "not shown at info");
  FERRY_LOG(kError, "tcp", "peer refused");
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], std::make_tuple(Level::kInfo, std::string("rdma"),
                                      std::string("endpoint 7 connected")));
  EXPECT_EQ(std::get<1>(lines[1]), "tcp");
  EXPECT_EQ(std::get<0>(lines[1]), Level::kError);
}

TEST_F(LogTest, ArgumentsAreNotEvaluatedBelowTheLevel) {
  int evaluated = 0;
  auto costly = [&] {
    ++evaluated;
    return "x";
  };
  FERRY_LOG(kDebug, "engine", costly());
  EXPECT_EQ(evaluated, 0);
  FERRY_LOG(kWarn, "engine", costly());
  EXPECT_EQ(evaluated, 1);
}

TEST_F(LogTest, PerComponentLevels) {
  ASSERT_OK(SetLevels("warn,rdma=debug"));
  FERRY_LOG(kDebug, "rdma", "shown");
  FERRY_LOG(kInfo, "tcp", "hidden");
  FERRY_LOG(kWarn, "tcp", "shown too");
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(std::get<2>(lines[0]), "shown");
  EXPECT_EQ(std::get<2>(lines[1]), "shown too");
  EXPECT_STATUS(SetLevels("warn,rdma=loud"),
                absl::StatusCode::kInvalidArgument);
}

TEST_F(LogTest, RepeatedLinesAreRateLimitedAndCounted) {
  // One call site, on the simulated clock.
  auto peer_down = [] {
    FERRY_LOG_EVERY(kWarn, "tcp", absl::Seconds(10), "peer down");
  };
  for (int i = 0; i < 100; ++i) peer_down();
  EXPECT_EQ(Lines().size(), 1u);  // The other 99 within 10 s: dropped.
  clock_.Advance(absl::Seconds(10) - absl::Nanoseconds(1));
  peer_down();
  EXPECT_EQ(Lines().size(), 1u) << "a line before the interval ended";
  clock_.Advance(absl::Nanoseconds(1));
  peer_down();
  auto lines = Lines();
  ASSERT_EQ(lines.size(), 2u) << "no line once the interval ended";
  EXPECT_EQ(std::get<2>(lines[1]), "peer down (100 similar suppressed)");

  RateLimit limit;
  uint64_t dropped = 0;
  EXPECT_TRUE(limit.Allow(absl::Milliseconds(1), &dropped));
  EXPECT_FALSE(limit.Allow(absl::Hours(1), &dropped));
  EXPECT_FALSE(limit.Allow(absl::Hours(1), &dropped));
  clock_.Advance(absl::Microseconds(999));
  EXPECT_FALSE(limit.Allow(absl::Milliseconds(1), &dropped));
  clock_.Advance(absl::Microseconds(1));
  EXPECT_TRUE(limit.Allow(absl::Milliseconds(1), &dropped));
  EXPECT_EQ(dropped, 3u);  // Said on the next line that passes.
}

TEST(LogLevelTest, Parse) {
  for (const char* n :
       {"trace", "debug", "info", "warn", "warning", "error", "off", "INFO"}) {
    EXPECT_OK(ParseLevel(n)) << n;
  }
  EXPECT_STATUS(ParseLevel("loud"), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LevelName(Level::kWarn), "warn");
}

}  // namespace
}  // namespace ferry::log
