#include "common/secure_random.h"

#include <sys/random.h>

namespace ferry {

void SecureRandomBytes(void* out, size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  size_t got = 0;
  while (got < n) {
    // Reads of <= 256 bytes from an initialized pool do not fail or return
    // short; larger ones may be cut by a signal, and EINTR is retried.
    const ssize_t r = getrandom(p + got, n - got, 0);
    if (r > 0) got += static_cast<size_t>(r);
  }
}

uint64_t SecureRandomNonZero64() {
  uint64_t v = 0;
  while (v == 0) SecureRandomBytes(&v, sizeof(v));
  return v;
}

}  // namespace ferry
