#include "metadata/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::metadata {
namespace {

std::string WriteFile(const std::string& name, const std::string& content) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

TEST(AuthTest, TokensAreBoundedPrintableWords) {
  EXPECT_OK(ValidateAuthToken(""));
  EXPECT_OK(ValidateAuthToken("0123456789abcdef"));
  EXPECT_STATUS(ValidateAuthToken("short"), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(ValidateAuthToken("0123456789 abcdef"),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(ValidateAuthToken(std::string(kMaxAuthTokenBytes + 1, 'a')),
                absl::StatusCode::kInvalidArgument);
}

TEST(AuthTest, TokenFilesAreReadBoundedAndChecked) {
  ASSERT_OK_AND_ASSIGN(std::string t, ReadAuthTokenFile(WriteFile(
                                          "t1", "cluster-secret-1234\nx\n")));
  EXPECT_EQ(t, "cluster-secret-1234");
  ASSERT_OK_AND_ASSIGN(
      t, ReadAuthTokenFile(WriteFile("t2", "cluster-secret-1234\r\n")));
  EXPECT_EQ(t, "cluster-secret-1234");
  for (const std::string& bad :
       {WriteFile("t3", ""), WriteFile("t4", "\n"), WriteFile("t5", "tiny\n"),
        WriteFile("t6", std::string(1 << 20, 'a')), std::string("/nonexistent"),
        // Endless: the read must stop at a token's length.
        std::string("/dev/zero")}) {
    EXPECT_STATUS(ReadAuthTokenFile(bad), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

// Fair shares are per host: an IPv6 caller counts by its /64.
TEST(AuthTest, AddressGroupsCutIpv6ToItsSlash64) {
  EXPECT_EQ(AddressGroup("ipv4:10.0.0.7"), "ipv4:10.0.0.7");
  EXPECT_EQ(AddressGroup("ipv6:[2001:db8:1:2::5]"), "ipv6:[2001:db8:1:2::]/64");
  EXPECT_EQ(AddressGroup("ipv6:[2001:db8:1:2:ffff::9]"),
            AddressGroup("ipv6:[2001:db8:1:2::5]"));
  EXPECT_NE(AddressGroup("ipv6:[2001:db8:1:3::5]"),
            AddressGroup("ipv6:[2001:db8:1:2::5]"));
  EXPECT_EQ(AddressGroup("ipv6:[::1]"), "ipv6:[::]/64");
  EXPECT_EQ(AddressGroup("unix:/tmp/x"), "unix:/tmp/x");
  EXPECT_EQ(AddressGroup("ipv6:[garbage]"), "ipv6:[garbage]");
}

// A FIFO nobody writes to hung the read (and, in softrnic, every thread
// that asked for the token); one that a command writes to is read.
TEST(AuthTest, TokenFifosNeverHang) {
  const std::string fifo = WriteFile("fifo-dir-marker", "") + ".fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const absl::Time start = absl::Now();
  EXPECT_STATUS(ReadAuthTokenFile(fifo), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  std::thread writer([&] {
    const int fd = ::open(fifo.c_str(), O_WRONLY);  // Waits for the reader.
    if (fd < 0) return;
    const char kLine[] = "cluster-secret-1234\n";
    EXPECT_EQ(::write(fd, kLine, sizeof(kLine) - 1),
              static_cast<ssize_t>(sizeof(kLine) - 1));
    ::close(fd);
  });
  // The reader opens first only if it wins the race; retry until the
  // writer's line arrives (each try is bounded).
  absl::StatusOr<std::string> got;
  for (int i = 0; i < 200; ++i) {
    got = ReadAuthTokenFile(fifo);
    if (got.ok()) break;
    absl::SleepFor(absl::Milliseconds(10));  // Retry pace, not ordering.
  }
  // A writer still waiting for a reader (had every try missed it) is let go.
  const int release = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  writer.join();
  if (release >= 0) ::close(release);
  ASSERT_OK(got);
  EXPECT_EQ(*got, "cluster-secret-1234");
}

// The way Mooncake-style callers, which cannot pass a token, get one.
TEST(AuthTest, TokenFromTheEnvironment) {
  ::unsetenv(kAuthTokenFileEnv);
  ::unsetenv(kAuthTokenEnv);
  ASSERT_OK_AND_ASSIGN(std::string none, AuthTokenFromEnv());
  EXPECT_EQ(none, "");

  ::setenv(kAuthTokenEnv, "env-token-0123456789", 1);
  ASSERT_OK_AND_ASSIGN(std::string direct, AuthTokenFromEnv());
  EXPECT_EQ(direct, "env-token-0123456789");

  ::setenv(kAuthTokenFileEnv,
           WriteFile("env_token", "file-token-0123456789\n").c_str(), 1);
  absl::Status both = AuthTokenFromEnv().status();
  EXPECT_STATUS(both, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(both.message().find("set one"), std::string::npos) << both;

  ::unsetenv(kAuthTokenEnv);
  ASSERT_OK_AND_ASSIGN(std::string from_file, AuthTokenFromEnv());
  EXPECT_EQ(from_file, "file-token-0123456789");

  ::setenv(kAuthTokenFileEnv, "/nonexistent/token", 1);
  absl::Status missing = AuthTokenFromEnv().status();
  EXPECT_STATUS(missing, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find(kAuthTokenFileEnv), std::string::npos)
      << missing;

  ::unsetenv(kAuthTokenFileEnv);
  ::setenv(kAuthTokenEnv, "short", 1);
  absl::Status bad = AuthTokenFromEnv().status();
  EXPECT_STATUS(bad, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find(kAuthTokenEnv), std::string::npos) << bad;
  ::unsetenv(kAuthTokenEnv);
}

TEST(AuthTest, AnOpenServerIsWarnedAboutOncePerProcess) {
  std::vector<std::string> lines;
  log::SetSink([&lines](log::Level level, absl::string_view component,
                        absl::string_view message) {
    if (level == log::Level::kWarn && component == "auth") {
      lines.emplace_back(message);
    }
  });
  WarnOpenServer("engine-x", "[::]:4000");
  WarnOpenServer("engine-x", "[::]:4000");
  WarnOpenServer("metadata_server", "[::]:12050");
  log::SetSink(nullptr);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("engine-x listens on [::]:4000 with no auth token"),
            std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find(kAuthTokenFileEnv), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("metadata_server"), std::string::npos) << lines[1];
}

TEST(AuthTest, WhatListensBeyondLoopback) {
  EXPECT_TRUE(ListensBeyondLoopback(""));
  EXPECT_TRUE(ListensBeyondLoopback("::"));
  EXPECT_TRUE(ListensBeyondLoopback("0.0.0.0"));
  EXPECT_TRUE(ListensBeyondLoopback("10.0.0.7"));
  EXPECT_FALSE(ListensBeyondLoopback("127.0.0.1"));
  EXPECT_FALSE(ListensBeyondLoopback("::1"));
}

}  // namespace
}  // namespace ferry::metadata
