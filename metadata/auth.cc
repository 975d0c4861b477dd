#include "metadata/auth.h"

#include <arpa/inet.h>

#include <cstdlib>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/secure_random.h"
#include "common/socket_util.h"
#include "metadata/connection_activity.h"

namespace ferry::metadata {
namespace {

constexpr char kHeader[] = "authorization";
constexpr absl::string_view kBearer = "Bearer ";

}  // namespace

void AddAuthToken(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata(kHeader, absl::StrCat(kBearer, token));
}

grpc::Status CheckAuthToken(const grpc::ServerContextBase& ctx,
                            const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const auto& md = ctx.client_metadata();
  auto it = md.find(kHeader);
  if (it != md.end()) {
    absl::string_view got(it->second.data(), it->second.size());
    if (got.size() > kBearer.size() &&
        got.substr(0, kBearer.size()) == kBearer &&
        SecretsEqual(got.substr(kBearer.size()), token)) {
      return grpc::Status::OK;
    }
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "this Ferry service requires its cluster's auth token "
                      "(EngineOptions::auth_token, --auth_token_file, or "
                      "FERRY_AUTH_TOKEN_FILE in the environment): the call "
                      "had none or another");
}

std::string CallerAddress(const grpc::ServerContextBase& ctx) {
  std::string peer = NormalizeGrpcPeer(ctx.peer());
  const size_t colon = peer.rfind(':');
  const size_t scheme = peer.find(':');
  if (colon != std::string::npos && colon != scheme) peer.resize(colon);
  return peer;
}

std::string AddressGroup(const std::string& caller_address) {
  constexpr absl::string_view kV6 = "ipv6:[";
  if (!absl::StartsWith(caller_address, kV6) || caller_address.back() != ']') {
    return caller_address;
  }
  auto sa = ParseNumericEndpoint(absl::StrCat(
      absl::string_view(caller_address).substr(kV6.size() - 1), ":1"));
  if (!sa.ok()) return caller_address;
  const uint64_t prefix = absl::Uint128High64(sa->AddressGroupKey());
  in6_addr a{};
  for (int i = 0; i < 8; ++i) {
    a.s6_addr[i] = static_cast<uint8_t>(prefix >> (56 - 8 * i));
  }
  char text[INET6_ADDRSTRLEN];
  if (::inet_ntop(AF_INET6, &a, text, sizeof(text)) == nullptr) {
    return caller_address;
  }
  return absl::StrCat(kV6, text, "]/64");
}

bool ListensBeyondLoopback(const std::string& listen_host) {
  return listen_host.empty() ||
         (listen_host != "localhost" && !IsLoopbackHost(listen_host));
}

void WarnOpenServer(const std::string& what,
                    const std::string& listen_address) {
  static Mutex mu;
  static auto* warned = new absl::flat_hash_set<std::string>();
  {
    MutexLock lock(&mu);
    if (!warned->insert(absl::StrCat(what, " ", listen_address)).second) {
      return;
    }
  }
  FERRY_LOG(kWarn, "auth", what, " listens on ", listen_address,
            " with no auth token: anyone who can reach it can read the "
            "segment descriptors it serves and, with them, read and write "
            "the registered memory they describe. Give every engine and "
            "metadata_server of the cluster the same token (export ",
            kAuthTokenFileEnv,
            "=/path/to/token, or EngineOptions::"
            "auth_token, or --auth_token_file), or listen on loopback only "
            "(docs/deployment.md)");
}

}  // namespace ferry::metadata
