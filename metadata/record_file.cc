#include "metadata/record_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry::metadata {
namespace {

std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

uint32_t Crc32c(absl::string_view data) {
  static const std::array<uint32_t, 256> kTable = MakeCrcTable();
  uint32_t c = ~0u;
  for (char ch : data) {
    c = kTable[(c ^ static_cast<uint8_t>(ch)) & 0xff] ^ (c >> 8);
  }
  return ~c;
}

std::string FrameRecord(absl::string_view payload) {
  std::string out;
  out.reserve(8 + payload.size());
  PutU32(&out, static_cast<uint32_t>(payload.size()));
  PutU32(&out, Crc32c(payload));
  out.append(payload.data(), payload.size());
  return out;
}

absl::StatusOr<ReadRecords> ReadRecordFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(path);
    return Errno("open", path);
  }
  std::string data;
  char buf[1 << 16];
  while (true) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status s = Errno("read", path);
      close(fd);
      return s;
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  ReadRecords r;
  size_t off = 0;
  while (data.size() - off >= 8) {
    const uint32_t len = GetU32(data.data() + off);
    const uint32_t crc = GetU32(data.data() + off + 4);
    if (len > kMaxRecordBytes || data.size() - off - 8 < len) break;
    absl::string_view payload(data.data() + off + 8, len);
    if (Crc32c(payload) != crc) break;
    r.payloads.emplace_back(payload);
    off += 8 + len;
  }
  r.good_bytes = off;
  r.torn_bytes = data.size() - off;
  return r;
}

absl::Status WriteAll(int fd, absl::string_view data, bool sync,
                      const std::string& what) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("write", what);
    done += static_cast<size_t>(n);
  }
  if (sync && fdatasync(fd) != 0) return Errno("fdatasync", what);
  return absl::OkStatus();
}

}  // namespace ferry::metadata
