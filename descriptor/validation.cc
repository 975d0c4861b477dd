#include "descriptor/validation.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"

namespace ferry::descriptor {

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

namespace {

// Printable ASCII without spaces, 1..max bytes: names that go into logs,
// maps and error messages unquoted.
bool IsToken(absl::string_view s, size_t max) {
  if (s.empty() || s.size() > max) return false;
  for (char c : s) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

// "host:port" with a printable host and a nonzero port: where a peer
// connects to. Not resolved here (validation does no I/O).
absl::Status ValidateAddress(absl::string_view field, absl::string_view addr) {
  if (!IsToken(addr, kMaxAddressBytes)) {
    return Invalid(field,
                   absl::StrCat("'", absl::CHexEscape(addr.substr(0, 64)),
                                "' is not a printable host:port"));
  }
  auto hp = ParseHostPort(addr);
  if (!hp.ok()) return Invalid(field, hp.status().message());
  if (hp->port == 0) {
    return Invalid(field, absl::StrCat("'", addr, "' has port 0"));
  }
  return absl::OkStatus();
}

absl::Status ValidateBufferAt(absl::string_view field, const Buffer& buffer) {
  if (buffer.length() == 0) {
    return Invalid(field, absl::StrCat("buffer at 0x", absl::Hex(buffer.addr()),
                                       " has zero length"));
  }
  if (buffer.addr() + buffer.length() < buffer.addr()) {
    return Invalid(field, absl::StrCat("buffer at 0x", absl::Hex(buffer.addr()),
                                       " of length ", buffer.length(),
                                       " wraps around the address space"));
  }
  if (buffer.location().size() > kMaxLocationBytes) {
    return Invalid(absl::StrCat(field, ".location"),
                   absl::StrCat(buffer.location().size(), " bytes; at most ",
                                kMaxLocationBytes));
  }
  if (static_cast<size_t>(buffer.keys_size()) > kMaxKeysPerBuffer) {
    return Invalid(
        absl::StrCat(field, ".keys"),
        absl::StrCat(buffer.keys_size(), " keys; at most ", kMaxKeysPerBuffer));
  }
  absl::flat_hash_set<absl::string_view> nics;
  for (int k = 0; k < buffer.keys_size(); ++k) {
    const std::string& nic = buffer.keys(k).nic();
    if (!IsToken(nic, kMaxDeviceNameBytes)) {
      return Invalid(absl::StrCat(field, ".keys[", k, "].nic"),
                     "not a printable device name");
    }
    if (!nics.insert(nic).second) {
      return Invalid(absl::StrCat(field, ".keys[", k, "].nic"),
                     absl::StrCat("device '", nic, "' has two keys"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateBuffer(const Buffer& buffer) {
  return ValidateBufferAt("buffer", buffer);
}

absl::Status ValidateSegmentDescriptor(const SegmentDescriptor& segment) {
  FERRY_RETURN_IF_ERROR(ValidateSegmentName(segment.name()));
  const std::string where = absl::StrCat("segment '", segment.name(), "': ");
  auto invalid = [&](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(where, field, ": ", why));
  };
  auto with_where = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(where, s.message()));
  };
  if (!segment.rpc_address().empty()) {
    if (absl::Status s = ValidateAddress("rpc_address", segment.rpc_address());
        !s.ok()) {
      return with_where(s);
    }
  }
  if (!segment.network_id().empty() &&
      !IsToken(segment.network_id(), kMaxNetworkIdBytes)) {
    return invalid("network_id", absl::StrCat("not printable, or over ",
                                              kMaxNetworkIdBytes, " bytes"));
  }
  // An Ed25519 public key (common/identity.h's kIdentityKeyBytes; not
  // included, to keep libcrypto out of what validates).
  constexpr size_t kIdentityKeyBytes = 32;
  if (!segment.identity_key().empty() &&
      segment.identity_key().size() != kIdentityKeyBytes) {
    return invalid(
        "identity_key",
        absl::StrCat(segment.identity_key().size(),
                     " bytes; an Ed25519 public key has ", kIdentityKeyBytes));
  }
  if (static_cast<size_t>(segment.transports_size()) >
      kMaxTransportsPerSegment) {
    return invalid("transports",
                   absl::StrCat(segment.transports_size(), " entries; at most ",
                                kMaxTransportsPerSegment));
  }
  // Every device any transport lists: what buffer keys may name.
  absl::flat_hash_set<absl::string_view> devices;
  absl::flat_hash_set<absl::string_view> transports;
  for (int i = 0; i < segment.transports_size(); ++i) {
    const TransportEndpoint& t = segment.transports(i);
    const std::string field = absl::StrCat("transports[", i, "]");
    if (!IsToken(t.transport(), kMaxTransportNameBytes)) {
      return invalid(absl::StrCat(field, ".transport"),
                     absl::StrCat("not a printable name of 1..",
                                  kMaxTransportNameBytes, " bytes"));
    }
    if (!transports.insert(t.transport()).second) {
      return invalid(absl::StrCat(field, ".transport"),
                     absl::StrCat("'", t.transport(), "' is listed twice"));
    }
    const std::string named = absl::StrCat(field, " ('", t.transport(), "')");
    // A TCP endpoint is useless without an address; others may not need
    // one (RDMA is reached through its devices), but any given must parse.
    if (t.transport() == "tcp") {
      if (t.address().empty()) {
        return invalid(absl::StrCat(named, ".address"), "missing");
      }
      // What the TCP transport dials: an IP address, not a name (which
      // would pass here and then fail every request).
      if (!ParseNumericEndpoint(t.address()).ok()) {
        return invalid(
            absl::StrCat(named, ".address"),
            absl::StrCat("'", absl::CHexEscape(t.address().substr(0, 64)),
                         "' is not a numeric IPv4 or [IPv6] address:port"));
      }
    }
    if (t.has_shm()) {
      const descriptor::ShmEndpoint& m = t.shm();
      const std::string shm = absl::StrCat(named, ".shm");
      if (t.transport() != "shm") {
        return invalid(shm, "set on a transport other than 'shm'");
      }
      if (!IsToken(m.host(), kMaxNetworkIdBytes)) {
        return invalid(absl::StrCat(shm, ".host"),
                       absl::StrCat("not printable, or over ",
                                    kMaxNetworkIdBytes, " bytes"));
      }
      if (m.pid() == 0 || m.pid() > kMaxPid) {
        return invalid(absl::StrCat(shm, ".pid"),
                       absl::StrCat(m.pid(), " is not a process id"));
      }
      if (m.table_fd() < 0) {
        return invalid(absl::StrCat(shm, ".table_fd"),
                       absl::StrCat(m.table_fd(), " is negative"));
      }
      if (m.token().size() != kShmTokenBytes) {
        return invalid(absl::StrCat(shm, ".token"),
                       absl::StrCat(m.token().size(), " bytes; expected ",
                                    kShmTokenBytes));
      }
    } else if (t.transport() == "shm") {
      return invalid(absl::StrCat(named, ".shm"), "missing");
    }
    if (!t.address().empty()) {
      if (absl::Status s =
              ValidateAddress(absl::StrCat(named, ".address"), t.address());
          !s.ok()) {
        return with_where(s);
      }
    }
    if (static_cast<size_t>(t.devices_size()) > kMaxDevicesPerTransport) {
      return invalid(absl::StrCat(named, ".devices"),
                     absl::StrCat(t.devices_size(), " entries; at most ",
                                  kMaxDevicesPerTransport));
    }
    absl::flat_hash_set<absl::string_view> names;
    for (int j = 0; j < t.devices_size(); ++j) {
      const Device& d = t.devices(j);
      const std::string dev = absl::StrCat(named, ".devices[", j, "]");
      if (!IsToken(d.name(), kMaxDeviceNameBytes)) {
        return invalid(absl::StrCat(dev, ".name"),
                       absl::StrCat("not a printable name of 1..",
                                    kMaxDeviceNameBytes, " bytes"));
      }
      if (!names.insert(d.name()).second) {
        return invalid(absl::StrCat(dev, ".name"),
                       absl::StrCat("'", d.name(), "' is listed twice"));
      }
      if (!d.gid().empty() && d.gid().size() != kGidBytes) {
        return invalid(
            absl::StrCat(dev, ".gid"),
            absl::StrCat(d.gid().size(), " bytes; expected ", kGidBytes));
      }
      if (d.lid() > 0xffff) {
        return invalid(absl::StrCat(dev, ".lid"),
                       absl::StrCat(d.lid(), " does not fit 16 bits"));
      }
      devices.insert(d.name());
    }
  }
  if (static_cast<size_t>(segment.buffers_size()) > kMaxBuffersPerSegment) {
    return invalid("buffers",
                   absl::StrCat(segment.buffers_size(), " entries; at most ",
                                kMaxBuffersPerSegment));
  }
  size_t index_entries = 0;
  for (const TransportEndpoint& t : segment.transports()) {
    index_entries += static_cast<size_t>(t.devices_size()) *
                     static_cast<size_t>(segment.buffers_size());
  }
  if (index_entries > kMaxKeyIndexEntries) {
    return invalid(
        "buffers",
        absl::StrCat(segment.buffers_size(),
                     " buffers on that many devices need a key "
                     "index of ",
                     index_entries, " entries; at most ", kMaxKeyIndexEntries));
  }
  size_t keys = 0;
  for (const Buffer& b : segment.buffers()) keys += b.keys_size();
  if (keys > kMaxKeysPerSegment) {
    return invalid("buffers", absl::StrCat(keys, " NIC keys in all; at most ",
                                           kMaxKeysPerSegment));
  }
  std::vector<std::pair<uint64_t, int>> starts;
  starts.reserve(segment.buffers_size());
  for (int i = 0; i < segment.buffers_size(); ++i) {
    const Buffer& b = segment.buffers(i);
    const std::string field = absl::StrCat("buffers[", i, "]");
    if (absl::Status s = ValidateBufferAt(field, b); !s.ok()) {
      return with_where(s);
    }
    if (b.has_cuda_ipc()) {
      if (b.cuda_ipc().handle().size() != kCudaIpcHandleBytes) {
        return invalid(absl::StrCat(field, ".cuda_ipc.handle"),
                       absl::StrCat(b.cuda_ipc().handle().size(),
                                    " bytes; expected ", kCudaIpcHandleBytes));
      }
      // The allocation holds the whole buffer.
      const uint64_t base = b.cuda_ipc().base();
      if (base == 0 || base > b.addr()) {
        return invalid(absl::StrCat(field, ".cuda_ipc.base"),
                       absl::StrCat("0x", absl::Hex(base),
                                    " is not at or below the buffer's "
                                    "address"));
      }
      if (b.cuda_ipc().size() < b.length() ||
          b.addr() - base > b.cuda_ipc().size() - b.length()) {
        return invalid(absl::StrCat(field, ".cuda_ipc.size"),
                       absl::StrCat(b.cuda_ipc().size(),
                                    " bytes from the base do not hold the "
                                    "buffer"));
      }
    }
    for (int k = 0; k < b.keys_size(); ++k) {
      if (!devices.contains(b.keys(k).nic())) {
        return invalid(absl::StrCat(field, ".keys[", k, "].nic"),
                       absl::StrCat("'", b.keys(k).nic(),
                                    "' is not a device of any of the segment's "
                                    "transports"));
      }
    }
    starts.emplace_back(b.addr(), i);
  }
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i) {
    const Buffer& prev = segment.buffers(starts[i - 1].second);
    if (starts[i].first < prev.addr() + prev.length()) {
      return invalid(absl::StrCat("buffers[", starts[i].second, "]"),
                     absl::StrCat("0x", absl::Hex(starts[i].first),
                                  " overlaps buffers[", starts[i - 1].second,
                                  "] at 0x", absl::Hex(prev.addr())));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckReachable(const SegmentDescriptor& segment,
                            absl::string_view local_network_id) {
  if (segment.network_id().empty() ||
      segment.network_id() == local_network_id) {
    return absl::OkStatus();
  }
  auto loopback = [](const std::string& address) {
    auto hp = ParseHostPort(address);
    return hp.ok() && IsLoopbackHost(hp->host);
  };
  std::string field, address;
  if (loopback(segment.rpc_address())) {
    field = "rpc_address";
    address = segment.rpc_address();
  }
  for (const TransportEndpoint& t : segment.transports()) {
    if (field.empty() && loopback(t.address())) {
      field = absl::StrCat(t.transport(), " address");
      address = t.address();
    }
  }
  if (field.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "segment '", segment.name(), "' advertises the loopback address ",
      address, " (", field,
      "), but it was published from another host or "
      "network namespace (",
      segment.network_id(), "; this engine: ", local_network_id,
      "), so it cannot be reached from here. Give that "
      "engine an address its peers can route to: EngineOptions::"
      "advertise_host or listen_host, transfer_bench --advertise_host, or "
      "--local_server_name=<its IP>:<port>"));
}

int64_t EncodedBufferBytes(const Buffer& buffer) {
  const size_t n = buffer.ByteSizeLong();
  return static_cast<int64_t>(
      1 + google::protobuf::io::CodedOutputStream::VarintSize64(n) + n);
}

}  // namespace ferry::descriptor
