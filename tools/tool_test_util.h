// Helpers for tests that run the real tools (transfer_bench, metadata_server)
// as subprocesses and watch them from outside: start one under a lowered fd
// limit, wait for its "ready" line, and open raw TCP connections to its
// ports (testing/process_usage.h reads its threads, RSS and fds).
#ifndef FERRY_TOOLS_TOOL_TEST_UTIL_H_
#define FERRY_TOOLS_TOOL_TEST_UTIL_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/socket_util.h"
#include "testing/subprocess.h"

namespace ferry::testing {

// Starts `argv` (argv[0] a path). With fd_limit > 0 the child runs under
// `ulimit -n fd_limit` (soft and hard, as a shell sets it), so it cannot
// raise the limit back and sees it from its first instruction.
absl::StatusOr<std::unique_ptr<Subprocess>> StartTool(
    const std::vector<std::string>& argv, int fd_limit = 0);

// Reads the child's stdout until a line starting with `prefix` and returns
// the rest of that line. Other lines are skipped.
absl::StatusOr<std::string> WaitForLine(Subprocess& child,
                                        const std::string& prefix,
                                        absl::Duration timeout);

// True while `pid` exists and is not a zombie.
bool ProcessAlive(pid_t pid);

// Waits until `fd` is readable or hung up (data, EOF or reset). False on
// timeout.
bool WaitReadable(int fd, absl::Duration timeout);

// The HTTP/2 client connection preface followed by an empty SETTINGS frame:
// what a gRPC client sends first on a new connection.
std::string Http2ClientPreface();

}  // namespace ferry::testing

#endif  // FERRY_TOOLS_TOOL_TEST_UTIL_H_
