#include "common/auth_token.h"

#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"

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
  // At most a token's length and a line end: the path may name anything
  // (a huge file, /dev/zero), and reading must stay bounded.
  std::ifstream f(path, std::ios::binary);
  std::string buf(kMaxAuthTokenBytes + 2, '\0');
  if (!f) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read an auth token from ", path));
  }
  f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
  buf.resize(static_cast<size_t>(f.gcount()));
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
