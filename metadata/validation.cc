#include "metadata/validation.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ferry::metadata {

absl::Status ValidateSegmentName(absl::string_view name) {
  if (name.empty()) {
    return absl::InvalidArgumentError("segment name is empty");
  }
  if (name.size() > kMaxSegmentNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment name is ", name.size(), " bytes; at most ",
                     kMaxSegmentNameBytes, " allowed"));
  }
  for (char c : name) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(
          "segment name must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBuffer(const Buffer& buffer) {
  if (buffer.length() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buffer at 0x", absl::Hex(buffer.addr()), " has zero length"));
  }
  if (buffer.addr() + buffer.length() < buffer.addr()) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer at 0x", absl::Hex(buffer.addr()), " of length ",
                     buffer.length(), " wraps around the address space"));
  }
  if (buffer.location().size() > kMaxLocationBytes) {
    return absl::InvalidArgumentError("buffer location is too long");
  }
  if (static_cast<size_t>(buffer.keys_size()) > kMaxKeysPerBuffer) {
    return absl::InvalidArgumentError("buffer has too many NIC keys");
  }
  for (const NicKey& key : buffer.keys()) {
    if (key.nic().empty() || key.nic().size() > kMaxAddressBytes) {
      return absl::InvalidArgumentError("buffer key has a bad NIC name");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSegmentDescriptor(const SegmentDescriptor& segment) {
  if (absl::Status s = ValidateSegmentName(segment.name()); !s.ok()) return s;
  if (segment.rpc_address().size() > kMaxAddressBytes) {
    return absl::InvalidArgumentError("rpc_address is too long");
  }
  if (static_cast<size_t>(segment.transports_size()) >
      kMaxTransportsPerSegment) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment lists ", segment.transports_size(),
                     " transports; at most ", kMaxTransportsPerSegment));
  }
  for (const TransportEndpoint& t : segment.transports()) {
    if (t.transport().empty() || t.transport().size() > 32) {
      return absl::InvalidArgumentError("transport name must be 1..32 bytes");
    }
    if (t.address().size() > kMaxAddressBytes) {
      return absl::InvalidArgumentError("transport address is too long");
    }
    if (static_cast<size_t>(t.devices_size()) > kMaxDevicesPerTransport) {
      return absl::InvalidArgumentError("transport lists too many devices");
    }
    for (const Device& d : t.devices()) {
      if (d.name().empty() || d.name().size() > kMaxAddressBytes) {
        return absl::InvalidArgumentError("device has a bad name");
      }
      if (!d.gid().empty() && d.gid().size() != kGidBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("device ", d.name(), " has a ", d.gid().size(),
                         "-byte GID; expected ", kGidBytes));
      }
    }
  }
  if (static_cast<size_t>(segment.buffers_size()) > kMaxBuffersPerSegment) {
    return absl::InvalidArgumentError(
        absl::StrCat("segment lists ", segment.buffers_size(),
                     " buffers; at most ", kMaxBuffersPerSegment));
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  ranges.reserve(segment.buffers_size());
  for (const Buffer& b : segment.buffers()) {
    if (absl::Status s = ValidateBuffer(b); !s.ok()) return s;
    ranges.emplace_back(b.addr(), b.addr() + b.length());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::InvalidArgumentError(
          absl::StrCat("buffers at 0x", absl::Hex(ranges[i - 1].first),
                       " and 0x", absl::Hex(ranges[i].first), " overlap"));
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry::metadata
