// Reading small files a user names on a command line or in options.
#ifndef FERRY_COMMON_FILE_UTIL_H_
#define FERRY_COMMON_FILE_UTIL_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace ferry {

// The whole of the file at `path`, which must hold at most `max_bytes`:
// the path may name anything (/dev/zero, a FIFO, a huge log), so it never
// reads more than max_bytes + 1. InvalidArgument, naming `what` and the
// path, if it cannot be opened or is larger. Thread-safe.
absl::StatusOr<std::string> ReadFileBounded(const std::string& what,
                                            const std::string& path,
                                            size_t max_bytes);

}  // namespace ferry

#endif  // FERRY_COMMON_FILE_UTIL_H_
