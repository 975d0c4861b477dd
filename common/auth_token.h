// The cluster's shared token as a process gets it: its form, a file that
// holds it, the environment. Shared by the gRPC services (metadata/auth.h)
// and softrnic's listener (transport/softrnic/hello_auth.h), so that both
// take and refuse the same tokens. No gRPC here: softrnic is a libibverbs.
//
// Thread-safe if nothing changes the environment.
#ifndef FERRY_COMMON_AUTH_TOKEN_H_
#define FERRY_COMMON_AUTH_TOKEN_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry {

constexpr size_t kMaxAuthTokenBytes = 4096;

// InvalidArgument unless `token` is empty or 16..kMaxAuthTokenBytes
// printable characters without spaces.
absl::Status ValidateAuthToken(const std::string& token);

// Reads a token from a file (its first line), for command-line tools:
// keeps it out of `ps`. InvalidArgument if unreadable or not a token. The
// read is bounded whatever the path names (/dev/zero, a huge file).
absl::StatusOr<std::string> ReadAuthTokenFile(const std::string& path);

// The environment variables that give a process the cluster token when
// its caller passes none: Mooncake-style code (ferry.mooncake's
// initialize(), vLLM and SGLang's connectors) cannot pass one, so a
// deployment turns authentication on by exporting one of these on every
// engine and metadata_server of the cluster.
constexpr char kAuthTokenFileEnv[] = "FERRY_AUTH_TOKEN_FILE";
constexpr char kAuthTokenEnv[] = "FERRY_AUTH_TOKEN";

// The token the environment gives: the file $FERRY_AUTH_TOKEN_FILE names
// (read as ReadAuthTokenFile reads it), or $FERRY_AUTH_TOKEN. Empty if
// neither is set; InvalidArgument, naming the variable, if both are or the
// token is not valid.
absl::StatusOr<std::string> AuthTokenFromEnv();

}  // namespace ferry

#endif  // FERRY_COMMON_AUTH_TOKEN_H_
