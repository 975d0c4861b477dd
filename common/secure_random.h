// Secrets from the kernel's CSPRNG (getrandom(2)): owner keys, data-path
// buffer keys; and comparing them. Not for anything on a hot path.
//
// Thread-safe.
#ifndef FERRY_COMMON_SECURE_RANDOM_H_
#define FERRY_COMMON_SECURE_RANDOM_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace ferry {

// Fills [out, out + n) with random bytes. Blocks only until the kernel's
// pool is initialized at boot. Aborts, saying why, where the kernel gives
// no randomness at all (getrandom missing or forbidden).
void SecureRandomBytes(void* out, size_t n);

// A random 64-bit value that is never 0, so that 0 can mean "no key".
uint64_t SecureRandomNonZero64();

// Whether `candidate` (what a caller sent) equals `secret` (what this
// process holds), in time that depends on the secret's length only: not
// on where they first differ (operator== on strings returns at the first
// differing byte, which lets a guesser find a secret a byte at a time by
// timing), nor on whether the lengths match (which would tell a guesser
// the secret's length).
bool SecretsEqual(absl::string_view candidate, absl::string_view secret);

}  // namespace ferry

#endif  // FERRY_COMMON_SECURE_RANDOM_H_
