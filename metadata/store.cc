#include "metadata/store.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry::metadata {

std::string NewOwnerKey() {
  std::string key(32, '\0');
  size_t got = 0;
  while (got < key.size()) {
    // getrandom() of <= 256 bytes from an initialized pool does not fail
    // or return short; EINTR is retried all the same.
    ssize_t n = getrandom(key.data() + got, key.size() - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return key;
}

absl::Status ValidateOwnerKey(absl::string_view key) {
  if (key.size() < kMinOwnerKeyBytes || key.size() > kMaxOwnerKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("owner_key: ", key.size(), " bytes; an owner key is ",
                     kMinOwnerKeyBytes, "..", kMaxOwnerKeyBytes,
                     " random bytes chosen by the publishing engine run"));
  }
  return absl::OkStatus();
}

}  // namespace ferry::metadata
