#include "tools/tool_test_util.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ferry::testing {

absl::StatusOr<std::unique_ptr<Subprocess>> StartTool(
    const std::vector<std::string>& argv, int fd_limit) {
  if (fd_limit <= 0) return Subprocess::Start(argv);
  // sh's `ulimit -n` sets the soft and the hard limit; exec keeps them.
  std::vector<std::string> wrapped = {
      "/bin/sh", "-c", absl::StrCat("ulimit -n ", fd_limit, R"( && exec "$@")"),
      "sh"};
  wrapped.insert(wrapped.end(), argv.begin(), argv.end());
  return Subprocess::Start(wrapped);
}

absl::StatusOr<std::string> WaitForLine(Subprocess& child,
                                        const std::string& prefix,
                                        absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto line = child.ReadLine(deadline - absl::Now());
    if (!line.ok()) {
      return absl::Status(line.status().code(),
                          absl::StrCat("waiting for a line \"", prefix,
                                       "...\": ", line.status().message()));
    }
    if (absl::StartsWith(*line, prefix)) {
      return std::string(absl::StripPrefix(*line, prefix));
    }
  }
}

bool ProcessAlive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)),
                   std::istreambuf_iterator<char>());
  // The state follows the parenthesised command name.
  size_t close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() &&
         text[close + 2] != 'Z' && text[close + 2] != 'X';
}

bool WaitReadable(int fd, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p{fd, POLLIN, 0};
    int n = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (n < 0 && errno == EINTR) continue;
    if (n > 0) return true;
  }
}

std::string Http2ClientPreface() {
  std::string s = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  // SETTINGS frame: length 0, type 4, flags 0, stream 0.
  const char settings[9] = {0, 0, 0, 4, 0, 0, 0, 0, 0};
  s.append(settings, sizeof(settings));
  return s;
}

}  // namespace ferry::testing
