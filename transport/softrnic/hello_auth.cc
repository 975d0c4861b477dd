#include "transport/softrnic/hello_auth.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/auth_token.h"
#include "common/secure_random.h"
#include "common/token_proof.h"

namespace softrnic {
namespace {

static_assert(kHelloProofBytes == ferry::kTokenProofBytes);

constexpr char kLabel[] = "ferry softrnic hello v1";

// The environment's token, as the engine reads it (common/auth_token.h).
const std::string* LoadToken() {
  absl::StatusOr<std::string> token = ferry::AuthTokenFromEnv();
  if (token.ok() && token->empty()) return nullptr;
  if (!token.ok()) {
    std::fprintf(stderr,
                 "softrnic: %s; this process's devices refuse every "
                 "connection and make none\n",
                 std::string(token.status().message()).c_str());
    // A random token nobody knows: a misconfiguration fails closed.
    uint8_t secret[32];
    ferry::SecureRandomBytes(secret, sizeof(secret));
    return new std::string(reinterpret_cast<const char*>(secret),
                           sizeof(secret));
  }
  return new std::string(std::move(*token));
}

std::atomic<const std::string*>& Token() {
  static std::atomic<const std::string*> token{LoadToken()};
  return token;
}

}  // namespace

const std::string* ClusterToken() {
  return Token().load(std::memory_order_acquire);
}

int SetClusterToken(const char* token) {
  const std::string wanted(token != nullptr ? token : "");
  if (wanted.empty() || !ferry::ValidateAuthToken(wanted).ok()) return EINVAL;
  const std::string* none = nullptr;
  // Set once, by the environment or the first caller, never replaced:
  // connections already opened were proven with it.
  auto* fresh = new std::string(wanted);
  if (Token().compare_exchange_strong(none, fresh, std::memory_order_acq_rel)) {
    return 0;
  }
  delete fresh;
  return *none == wanted ? 0 : EEXIST;
}

Frame MakeChallenge() {
  Frame f{};
  f.type = FrameType::kChallenge;
  uint32_t nonce[4];
  ferry::SecureRandomBytes(nonce, sizeof(nonce));
  f.msn = nonce[0];
  f.remote_addr = (static_cast<uint64_t>(nonce[1]) << 32) | nonce[2];
  f.aux = nonce[3];
  return f;
}

void HelloProof(const std::string& token, const uint8_t challenge[kHeaderBytes],
                const uint8_t hello[kHeaderBytes],
                uint8_t out[kHelloProofBytes]) {
  ferry::TokenProof(token, kLabel,
                    {absl::MakeConstSpan(challenge, kHeaderBytes),
                     absl::MakeConstSpan(hello, kHeaderBytes)},
                    out);
}

bool HelloProofMatches(const std::string& token,
                       const uint8_t challenge[kHeaderBytes],
                       const uint8_t hello[kHeaderBytes],
                       const uint8_t proof[kHelloProofBytes]) {
  return ferry::TokenProofMatches(token, kLabel,
                                  {absl::MakeConstSpan(challenge, kHeaderBytes),
                                   absl::MakeConstSpan(hello, kHeaderBytes)},
                                  proof);
}

}  // namespace softrnic
