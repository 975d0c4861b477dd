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

bool SecretsEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  // volatile: the compiler may not turn the loop into an early exit.
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

}  // namespace ferry
