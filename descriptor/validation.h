// Checks applied to every segment descriptor that crosses the wire, on the
// metadata server (before storing) and in engines and transports (before
// using a descriptor fetched from a server that may be buggy or hostile).
// Part of the descriptor layer: no service, no gRPC.
#ifndef FERRY_DESCRIPTOR_VALIDATION_H_
#define FERRY_DESCRIPTOR_VALIDATION_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "descriptor/descriptor.pb.h"

namespace ferry::descriptor {

constexpr size_t kMaxSegmentNameBytes = 256;
constexpr size_t kMaxBuffersPerSegment = 1 << 16;
constexpr size_t kMaxTransportsPerSegment = 8;
constexpr size_t kMaxDevicesPerTransport = 64;
constexpr size_t kMaxKeysPerBuffer = 64;
// Bounds of what a descriptor costs its readers: NIC keys in all, and the
// per-device key index engines build (buffers x devices, summed over
// transports with devices; 8 bytes each): 65,536 buffers on 32 NICs.
constexpr size_t kMaxKeysPerSegment = 1 << 21;
constexpr size_t kMaxKeyIndexEntries = 1 << 21;
constexpr size_t kMaxLocationBytes = 64;
constexpr size_t kMaxAddressBytes = 256;
constexpr size_t kMaxTransportNameBytes = 32;
constexpr size_t kMaxNetworkIdBytes = 128;
constexpr size_t kMaxDeviceNameBytes = 64;
constexpr size_t kGidBytes = 16;
// The shm endpoint's token, and the largest pid Linux hands out
// (PID_MAX_LIMIT on 64-bit).
constexpr size_t kShmTokenBytes = 16;
constexpr size_t kCudaIpcHandleBytes = 64;
constexpr uint32_t kMaxPid = 1u << 22;

// A segment name is 1..kMaxSegmentNameBytes printable ASCII characters
// without spaces, so it can be used in logs and flags unquoted.
absl::Status ValidateSegmentName(absl::string_view name);

// One buffer: nonzero length, no address wrap-around, bounded fields, at
// most one key per device.
absl::Status ValidateBuffer(const Buffer& buffer);

// What a buffer adds to its descriptor's encoding: its field tag (one
// byte), its length and its bytes. The stores' limits and quotas count
// descriptors by it, so an update charges and a removal refunds alike.
int64_t EncodedBufferBytes(const Buffer& buffer);

// The whole descriptor, so that nothing downstream needs to distrust it:
// the name; rpc_address and every transport address (host:port with a
// nonzero port; required for "tcp"); transport names (unique) and their
// devices (unique names, 16-byte GIDs, 16-bit LIDs); bounded counts and
// sizes; buffers (each valid, no two overlapping, every key naming a
// device the segment lists). InvalidArgument names the segment and the
// offending field, e.g. "segment 'x': transports[0] ('tcp').address: ...".
absl::Status ValidateSegmentDescriptor(const SegmentDescriptor& segment);

// FailedPrecondition if `segment` was published from another host or
// network namespace than `local_network_id` (NetworkIdentity()) and
// advertises a loopback address (its rpc_address or a transport's), which
// cannot be reached from here; the message says how to fix the publisher.
// A descriptor without network_id passes.
absl::Status CheckReachable(const SegmentDescriptor& segment,
                            absl::string_view local_network_id);

}  // namespace ferry::descriptor

#endif  // FERRY_DESCRIPTOR_VALIDATION_H_
