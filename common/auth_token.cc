#include "common/auth_token.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ferry {

absl::Status ValidateAuthToken(const std::string& token) {
  if (token.empty()) return absl::OkStatus();
  if (token.size() < 16 || token.size() > kMaxAuthTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("auth token: ", token.size(), " characters; 16..",
                     kMaxAuthTokenBytes, " needed"));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "auth token: printable characters without spaces only");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path) {
  // At most a token's length and a line end, and never a wait without end:
  // the path may name anything (a huge file, /dev/zero, a FIFO nobody
  // writes to, a pipe from a slow command). Non-blocking, so a FIFO with no
  // writer opens and reads as empty; a pipe gets kReadWait to say its line.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read an auth token from ", path, ": ", std::strerror(errno)));
  }
  constexpr absl::Duration kReadWait = absl::Seconds(2);
  const absl::Time deadline = absl::Now() + kReadWait;
  std::string buf;
  char chunk[kMaxAuthTokenBytes + 2];
  const size_t cap = sizeof(chunk);
  absl::Status error;
  while (buf.size() < cap && buf.find('\n') == std::string::npos) {
    const ssize_t n = ::read(fd, chunk, cap - buf.size());
    if (n > 0) {
      buf.append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) break;  // End of file (or a FIFO with no writer).
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      error = absl::InvalidArgumentError(absl::StrCat(
          "cannot read an auth token from ", path, ": ", std::strerror(errno)));
      break;
    }
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (left_ms <= 0 || ::poll(&p, 1, static_cast<int>(left_ms)) == 0) {
      error = absl::InvalidArgumentError(
          absl::StrCat("no auth token could be read from ", path, " within ",
                       absl::FormatDuration(kReadWait)));
      break;
    }
  }
  ::close(fd);
  if (!error.ok()) return error;
  std::string token = buf.substr(0, buf.find('\n'));
  if (!token.empty() && token.back() == '\r') token.pop_back();
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds no token"));
  }
  if (absl::Status s = ValidateAuthToken(token); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  return token;
}

absl::StatusOr<std::string> AuthTokenFromEnv() {
  const char* file = std::getenv(kAuthTokenFileEnv);
  const char* token = std::getenv(kAuthTokenEnv);
  const bool has_file = file != nullptr && *file != '\0';
  const bool has_token = token != nullptr && *token != '\0';
  if (has_file && has_token) {
    return absl::InvalidArgumentError(absl::StrCat("both ", kAuthTokenFileEnv,
                                                   " and ", kAuthTokenEnv,
                                                   " are set; set one"));
  }
  if (has_file) {
    auto t = ReadAuthTokenFile(file);
    if (!t.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kAuthTokenFileEnv, ": ", t.status().message()));
    }
    return t;
  }
  if (!has_token) return std::string();
  if (absl::Status s = ValidateAuthToken(token); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kAuthTokenEnv, ": ", s.message()));
  }
  return std::string(token);
}

}  // namespace ferry
