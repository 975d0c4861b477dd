// Proof that the other end of a data connection holds the cluster token,
// without sending the token: the listener sends a fresh random challenge
// when it accepts, and the dialler answers with HMAC-SHA256 under the
// token of a protocol label and the bytes both sides have seen (the
// challenge, and the frame that carries the answer). Used by the TCP
// transport's wire and by softrnic's listener. A captured answer is
// worth nothing on another connection: its challenge differs.
//
// Thread-safe (no state).
#ifndef FERRY_COMMON_TOKEN_PROOF_H_
#define FERRY_COMMON_TOKEN_PROOF_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace ferry {

constexpr size_t kTokenProofBytes = 32;
constexpr size_t kTokenChallengeBytes = 16;

// HMAC-SHA256 under `token` of `label` (with a NUL after it, so no label
// is a prefix of another's input) and `parts`, concatenated: each part
// must have a length fixed by the protocol, so that the concatenation is
// unambiguous. Never fails: should libcrypto fail (allocation), `out`
// gets random bytes, which match nothing.
void TokenProof(absl::string_view token, absl::string_view label,
                std::initializer_list<absl::Span<const uint8_t>> parts,
                uint8_t out[kTokenProofBytes]);

// Whether `proof` is TokenProof(token, label, parts), compared in time
// that does not depend on where it differs.
bool TokenProofMatches(absl::string_view token, absl::string_view label,
                       std::initializer_list<absl::Span<const uint8_t>> parts,
                       const uint8_t proof[kTokenProofBytes]);

}  // namespace ferry

#endif  // FERRY_COMMON_TOKEN_PROOF_H_
