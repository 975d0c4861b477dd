#include "common/token_proof.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <string>

#include "common/secure_random.h"

namespace ferry {

void TokenProof(absl::string_view token, absl::string_view label,
                std::initializer_list<absl::Span<const uint8_t>> parts,
                uint8_t out[kTokenProofBytes]) {
  // The inputs are a few frame headers: one buffer and the one-shot HMAC.
  std::string msg(label);
  msg.push_back('\0');
  for (absl::Span<const uint8_t> part : parts) {
    msg.append(reinterpret_cast<const char*>(part.data()), part.size());
  }
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
           reinterpret_cast<const uint8_t*>(msg.data()), msg.size(), out,
           &len) == nullptr ||
      len != kTokenProofBytes) {
    SecureRandomBytes(out, kTokenProofBytes);
  }
}

bool TokenProofMatches(absl::string_view token, absl::string_view label,
                       std::initializer_list<absl::Span<const uint8_t>> parts,
                       const uint8_t proof[kTokenProofBytes]) {
  uint8_t want[kTokenProofBytes];
  TokenProof(token, label, parts, want);
  return CRYPTO_memcmp(want, proof, kTokenProofBytes) == 0;
}

}  // namespace ferry
