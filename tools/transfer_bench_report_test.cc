// transfer_bench's counting and report figures without an engine: the
// latency percentiles, the --report_unit conversions, and ErrorLog's
// grouping of failed requests by status (what a failing peer prints).
#include "tools/transfer_bench_report.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace ferry::transfer_bench {
namespace {

// Everything written to `f` so far.
std::string Contents(FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  char buf[256];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fseek(f, 0, SEEK_END);  // Later lines append.
  return out;
}

TEST(ReportUnitBytesTest, MooncakesUnits) {
  EXPECT_EQ(ReportUnitBytes("GB"), 1e9);
  EXPECT_EQ(ReportUnitBytes("MB"), 1e6);
  EXPECT_EQ(ReportUnitBytes("KB"), 1e3);
  EXPECT_EQ(ReportUnitBytes("GiB"), 1 << 30);
  EXPECT_EQ(ReportUnitBytes("MiB"), 1 << 20);
  EXPECT_EQ(ReportUnitBytes("KiB"), 1 << 10);
  EXPECT_EQ(ReportUnitBytes("Gb"), 1e9 / 8);
  EXPECT_EQ(ReportUnitBytes("Mb"), 1e6 / 8);
  EXPECT_EQ(ReportUnitBytes("Kb"), 1e3 / 8);
}

TEST(ReportUnitBytesTest, UnknownIsZero) {
  EXPECT_EQ(ReportUnitBytes(""), 0);
  EXPECT_EQ(ReportUnitBytes("gb"), 0);  // Case matters: b is bits.
  EXPECT_EQ(ReportUnitBytes("TB"), 0);
}

TEST(RateTest, UnitAndPrecision) {
  EXPECT_EQ(Rate(1.5e9, "GB", 2), "1.50 GB/s");
  EXPECT_EQ(Rate(1e9, "Gb", 1), "8.0 Gb/s");
  EXPECT_EQ(Rate(3 << 20, "MiB", 0), "3 MiB/s");
  EXPECT_EQ(Rate(0, "KB", 3), "0.000 KB/s");
}

TEST(ErrorLogTest, StatusesDifferingInNumbersCountAsOne) {
  FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    ErrorLog log(out);
    log.Add(absl::UnavailableError("peer 10.0.0.1:5000 refused, retry 1.5s"),
            3);
    log.Add(absl::UnavailableError("peer 10.0.0.2:6001 refused, retry 20s"), 2);
    log.Add(absl::DeadlineExceededError("request 7 timed out"), 1);
    log.PrintSummary();
  }
  // The first of each status at once, then the counts.
  EXPECT_EQ(Contents(out),
            "transfer failed: UNAVAILABLE: peer 10.0.0.1:5000 refused, retry "
            "1.5s\n"
            "transfer failed: DEADLINE_EXCEEDED: request 7 timed out\n"
            "5 requests failed: UNAVAILABLE: peer 10.0.0.1:5000 refused, "
            "retry 1.5s\n"
            "1 requests failed: DEADLINE_EXCEEDED: request 7 timed out\n");
  std::fclose(out);
}

TEST(ErrorLogTest, StatusesPastTheLimitAreCountedTogether) {
  FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    ErrorLog log(out);
    // Statuses differing in letters are distinct; the numbers do not count.
    std::string expected;
    std::string summary;
    for (size_t i = 0; i < kMaxDistinctErrors; ++i) {
      const std::string msg =
          absl::StrCat("failure ", std::string(i + 1, 'x'), " at ", i);
      log.Add(absl::InternalError(msg), 1);
      absl::StrAppend(&expected, "transfer failed: INTERNAL: ", msg, "\n");
      absl::StrAppend(&summary, "1 requests failed: INTERNAL: ", msg, "\n");
    }
    log.Add(absl::InternalError("one more"), 4);
    log.Add(absl::AbortedError("and another"), 2);
    // Differing from a known status only in numbers, it counts there.
    log.Add(absl::InternalError("failure x at 99"), 1);
    EXPECT_EQ(Contents(out), expected);
    log.PrintSummary();
    summary.replace(0, 1, "2");
    EXPECT_EQ(Contents(out),
              absl::StrCat(expected, summary,
                           "6 requests failed with other statuses\n"));
  }
  std::fclose(out);
}

TEST(ErrorLogTest, NothingFailedPrintsNothing) {
  FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    ErrorLog log(out);
    log.PrintSummary();
  }
  EXPECT_EQ(Contents(out), "");
  std::fclose(out);
}

}  // namespace
}  // namespace ferry::transfer_bench
