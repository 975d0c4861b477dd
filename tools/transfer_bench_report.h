// What transfer_bench counts and how it prints it: per-thread batch
// latencies, the run's totals, failed requests grouped by status, and the
// throughput and latency figures of its reports. Pure logic, no engine:
// tested by transfer_bench_report_test.cc.
//
// Thread-safety: Totals' counters are atomics and ErrorLog takes its own
// lock, so every initiator thread updates them at once; a ThreadStats is
// written by its thread and read under its lock at the end.
#ifndef FERRY_TOOLS_TRANSFER_BENCH_REPORT_H_
#define FERRY_TOOLS_TRANSFER_BENCH_REPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/mutex.h"

namespace ferry::transfer_bench {

// Distinct failure statuses remembered with their counts; more are counted
// under one line.
constexpr size_t kMaxDistinctErrors = 16;

struct ThreadStats {
  Mutex mu;
  std::vector<double> batch_us ABSL_GUARDED_BY(mu);
};

// Failed requests by status: the first of each status is printed at once,
// the counts at the end, so a failing peer gives a few lines, not a storm.
// Statuses that differ only in numbers (a back-off delay, a port, a
// request index) count as one; the first one seen is what gets printed.
class ErrorLog {
 public:
  // `out` takes every line (a test passes its own file).
  explicit ErrorLog(FILE* out = stderr) : out_(out) {}

  void Add(const absl::Status& status, uint64_t count);
  void PrintSummary();

 private:
  struct Entry {
    std::string key;
    std::string text;
    uint64_t count;
  };

  static std::string WithoutNumbers(const std::string& text);

  FILE* const out_;
  Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t other_ ABSL_GUARDED_BY(mu_) = 0;
};

struct Totals {
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> transfers{0};
  // Failed requests (transfer errors), and requests whose bytes differed.
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> verify_failures{0};
  // Failed requests since the last completed one, over all threads.
  std::atomic<uint64_t> consecutive_errors{0};
  std::atomic<bool> gave_up{false};
  ErrorLog error_log;
};

// Bytes per --report_unit, Mooncake's units (b: bits); 0 if unknown.
double ReportUnitBytes(const std::string& unit);

// A throughput as `unit`/s (a --report_unit) with `precision` decimals.
std::string Rate(double bytes_per_second, const std::string& unit,
                 int precision);

}  // namespace ferry::transfer_bench

#endif  // FERRY_TOOLS_TRANSFER_BENCH_REPORT_H_
