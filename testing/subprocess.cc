#include "testing/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

namespace ferry::testing {

std::string RunfilePath(const std::string& rel) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return rel;
  return absl::StrCat(srcdir, "/", ws != nullptr ? ws : "ferry", "/", rel);
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(
    const std::vector<std::string>& argv) {
  int in_pipe[2], out_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0 || pipe2(out_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(in_pipe[0], 0);
    dup2(out_pipe[1], 1);
    execv(args[0], args.data());
    _exit(127);
  }
  close(in_pipe[0]);
  close(out_pipe[1]);
  std::unique_ptr<Subprocess> p(new Subprocess());
  p->pid_ = pid;
  p->in_fd_ = in_pipe[1];
  p->out_fd_ = out_pipe[0];
  return p;
}

Subprocess::~Subprocess() {
  Kill();
  if (in_fd_ >= 0) close(in_fd_);
  if (out_fd_ >= 0) close(out_fd_);
}

absl::StatusOr<std::string> Subprocess::ReadLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t nl = buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("child sent no line in time");
    }
    pollfd pfd{out_fd_, POLLIN, 0};
    int n =
        poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    char buf[4096];
    ssize_t r = read(out_fd_, buf, sizeof(buf));
    if (r <= 0) return absl::OutOfRangeError("child closed its stdout");
    buffered_.append(buf, static_cast<size_t>(r));
  }
}

absl::Status Subprocess::WriteLine(const std::string& line) {
  std::string data = line + "\n";
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = write(in_fd_, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError("child's stdin is closed");
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Subprocess::Ask(const std::string& line,
                                            absl::Duration timeout) {
  FERRY_RETURN_IF_ERROR(WriteLine(line));
  return ReadLine(timeout);
}

absl::StatusOr<std::vector<std::string>> Subprocess::AskOk(
    const std::string& line, absl::Duration timeout) {
  auto answer = Ask(line, timeout);
  if (!answer.ok()) {
    return absl::Status(answer.status().code(),
                        absl::StrCat(line, ": ", answer.status().message()));
  }
  std::vector<std::string> words =
      absl::StrSplit(*answer, ' ', absl::SkipEmpty());
  if (words.empty() || words[0] != "ok") {
    return absl::UnknownError(absl::StrCat(line, " -> ", *answer));
  }
  words.erase(words.begin());
  return words;
}

void Subprocess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

absl::StatusOr<int> Subprocess::Finish(absl::Duration timeout) {
  if (in_fd_ >= 0) {
    close(in_fd_);
    in_fd_ = -1;
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  Kill();
  return absl::DeadlineExceededError("child did not exit in time");
}

}  // namespace ferry::testing
