// Framed records in a file, for the durable store: each record is
//   u32 length | u32 CRC32C of the payload | payload
// (little-endian). A reader stops at the first record that is cut short or
// fails its checksum: that is where a crash tore the tail off (or the disk
// corrupted it), and nothing after it is trusted.
#ifndef FERRY_METADATA_RECORD_FILE_H_
#define FERRY_METADATA_RECORD_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry::metadata {

// Largest record accepted: a full segment descriptor fits many times over.
constexpr size_t kMaxRecordBytes = 64 << 20;

// CRC-32C (Castagnoli) of `data`.
uint32_t Crc32c(absl::string_view data);

// `payload` framed as a record.
std::string FrameRecord(absl::string_view payload);

struct ReadRecords {
  std::vector<std::string> payloads;
  // Bytes of whole, intact records; the file's bytes past this point
  // (`torn_bytes` of them) are a torn or corrupt tail.
  uint64_t good_bytes = 0;
  uint64_t torn_bytes = 0;
};

// Reads every intact record of the file at `path`. NotFound if there is no
// such file; other errors of open/read as Internal with the path.
absl::StatusOr<ReadRecords> ReadRecordFile(const std::string& path);

// Writes `data` to `fd` in full and, with `sync`, fdatasync()s it.
absl::Status WriteAll(int fd, absl::string_view data, bool sync,
                      const std::string& what);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_RECORD_FILE_H_
