// Subprocess: starts a helper process for cross-process tests, talks to it
// over its stdin/stdout, and guarantees it dies with the test (SIGKILL on
// destruction, and PR_SET_PDEATHSIG if the test itself dies).
#ifndef FERRY_TESTING_SUBPROCESS_H_
#define FERRY_TESTING_SUBPROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ferry::testing {

class Subprocess {
 public:
  // Starts argv[0] with the arguments.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(
      const std::vector<std::string>& argv);
  ~Subprocess();

  // Reads one line of the child's stdout (without the newline), failing
  // with DeadlineExceeded after `timeout` or OutOfRange on EOF.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  // Writes `line` and a newline to the child's stdin.
  absl::Status WriteLine(const std::string& line);
  // Sends a command and returns its one-line answer.
  absl::StatusOr<std::string> Ask(const std::string& line,
                                  absl::Duration timeout = absl::Seconds(30));
  // Ask, for a child that answers "ok [words...]" or "err reason": the
  // words after "ok", or an error naming the command and the answer.
  absl::StatusOr<std::vector<std::string>> AskOk(
      const std::string& line, absl::Duration timeout = absl::Seconds(30));

  // SIGKILLs the child and reaps it.
  void Kill();
  // Closes stdin and waits up to `timeout` for a clean exit; returns the
  // exit status, or kills the child and returns DeadlineExceeded.
  absl::StatusOr<int> Finish(absl::Duration timeout);
  pid_t pid() const { return pid_; }

 private:
  Subprocess() = default;
  pid_t pid_ = -1;
  int in_fd_ = -1;   // Child's stdin.
  int out_fd_ = -1;  // Child's stdout.
  std::string buffered_;
};

// Path of a binary built by Bazel and listed in the test's data.
std::string RunfilePath(const std::string& workspace_relative);

}  // namespace ferry::testing

#endif  // FERRY_TESTING_SUBPROCESS_H_
