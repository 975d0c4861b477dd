// What a test reads about a process from /proc -- its threads, RSS and open
// fds, and what they are when a bound is exceeded -- and WaitUntil, for
// tests that wait for such a count (or any condition) to settle.
#ifndef FERRY_TESTING_PROCESS_USAGE_H_
#define FERRY_TESTING_PROCESS_USAGE_H_

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ferry::testing {

struct ProcessUsage {
  int threads = 0;
  int64_t rss_kb = 0;
  int64_t hwm_kb = 0;  // Peak RSS (VmHWM).
  int open_fds = 0;
};

// Reads /proc/<pid>/status and /proc/<pid>/fd. NotFound if the process is
// gone. For the calling process, open_fds counts the descriptor used to
// read the fd table too.
absl::StatusOr<ProcessUsage> ReadProcessUsage(pid_t pid);

// The calling process's threads and open fds (not counting the one used to
// count them); -1 if /proc cannot be read.
int ThreadCount();
int OpenFds();

// "name xN, ..." of the process's threads (/proc/<pid>/task/*/comm) and
// "kind xN, ..." of its open fds (socket, pipe, anon_inode:..., file), most
// frequent first: what to print when a bound on either is exceeded.
std::string DescribeThreads(pid_t pid);
std::string DescribeFds(pid_t pid);

// Polls `cond` every 10 ms until it holds or `timeout` passes; returns its
// last value. For conditions another thread or process makes true.
template <typename F>
bool WaitUntil(F cond, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!cond()) {
    if (absl::Now() > deadline) return cond();
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

}  // namespace ferry::testing

#endif  // FERRY_TESTING_PROCESS_USAGE_H_
