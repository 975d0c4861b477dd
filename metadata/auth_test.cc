#include "metadata/auth.h"

#include <cstdlib>
#include <fstream>
#include <string>

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

}  // namespace
}  // namespace ferry::metadata
