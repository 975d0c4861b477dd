#include "transport/softrnic/hello_auth.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/types/span.h"
#include "common/secure_random.h"
#include "common/token_proof.h"

namespace softrnic {
namespace {

static_assert(kHelloProofBytes == ferry::kTokenProofBytes);

constexpr size_t kMaxTokenBytes = 4096;
constexpr char kLabel[] = "ferry softrnic hello v1";

// As the engine's ValidateAuthToken (metadata/auth.cc): 16 or more
// printable characters without spaces.
bool UsableToken(const std::string& t) {
  if (t.size() < 16 || t.size() > kMaxTokenBytes) return false;
  for (char c : t) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

// The first line of `path`, read boundedly (it may name /dev/zero).
bool ReadTokenFile(const char* path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::string buf(kMaxTokenBytes + 2, '\0');
  f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
  buf.resize(static_cast<size_t>(f.gcount()));
  *out = buf.substr(0, buf.find('\n'));
  if (!out->empty() && out->back() == '\r') out->pop_back();
  return true;
}

const std::string* LoadToken() {
  const char* file = std::getenv("FERRY_AUTH_TOKEN_FILE");
  const char* value = std::getenv("FERRY_AUTH_TOKEN");
  const bool has_file = file != nullptr && *file != '\0';
  const bool has_value = value != nullptr && *value != '\0';
  if (!has_file && !has_value) return nullptr;
  std::string token;
  bool ok;
  if (has_file && has_value) {
    ok = false;
  } else if (has_file) {
    ok = ReadTokenFile(file, &token) && UsableToken(token);
  } else {
    token = value;
    ok = UsableToken(token);
  }
  if (!ok) {
    std::fprintf(stderr,
                 "softrnic: the cluster token (FERRY_AUTH_TOKEN_FILE or "
                 "FERRY_AUTH_TOKEN, one of them, 16+ printable characters) "
                 "is unusable; this process's devices refuse every "
                 "connection and make none\n");
    uint8_t secret[32];
    ferry::SecureRandomBytes(secret, sizeof(secret));
    token.assign(reinterpret_cast<const char*>(secret), sizeof(secret));
  }
  return new std::string(std::move(token));
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
  if (!UsableToken(wanted)) return EINVAL;
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
