#include "common/file_util.h"

#include <fstream>

#include "absl/strings/str_cat.h"

namespace ferry {

absl::StatusOr<std::string> ReadFileBounded(const std::string& what,
                                            const std::string& path,
                                            size_t max_bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot read ", path));
  }
  std::string buf(max_bytes + 1, '\0');
  f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
  buf.resize(static_cast<size_t>(f.gcount()));
  if (buf.size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", path, " is larger than ", max_bytes, " bytes"));
  }
  return buf;
}

}  // namespace ferry
