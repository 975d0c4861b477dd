#include "common/secure_random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ferry {

void SecureRandomBytes(void* out, size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  size_t got = 0;
  while (got < n) {
    // Reads of <= 256 bytes from an initialized pool do not fail or return
    // short; larger ones may be cut by a signal, and EINTR is retried.
    const ssize_t r = getrandom(p + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno != EINTR && errno != EAGAIN) {
      // No kernel randomness (ENOSYS: pre-3.17 kernel; EPERM: a seccomp
      // filter): no secret can be made, and looping would hang.
      std::fprintf(stderr, "ferry: getrandom failed: %s\n",
                   std::strerror(errno));
      std::abort();
    }
  }
}

uint64_t SecureRandomNonZero64() {
  uint64_t v = 0;
  while (v == 0) SecureRandomBytes(&v, sizeof(v));
  return v;
}

bool SecretsEqual(absl::string_view candidate, absl::string_view secret) {
  // volatile: the compiler may not turn the loop into an early exit. A
  // candidate of another length is still walked over the secret's bytes.
  volatile unsigned char diff = candidate.size() == secret.size() ? 0 : 1;
  for (size_t i = 0; i < secret.size(); ++i) {
    const unsigned char c =
        i < candidate.size() ? static_cast<unsigned char>(candidate[i]) : 0;
    diff = diff | static_cast<unsigned char>(c ^ secret[i]);
  }
  return diff == 0;
}

}  // namespace ferry
