#include "metadata/store.h"

#include "absl/strings/str_cat.h"
#include "common/secure_random.h"

namespace ferry::metadata {

std::string NewOwnerKey() {
  std::string key(32, '\0');
  SecureRandomBytes(key.data(), key.size());
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
