// SegmentView: an immutable, validated snapshot of a remote segment's
// descriptor with an O(log n) index of its buffers. Transports read it to
// route slices; the engine replaces (never mutates) it on refresh, and each
// task keeps the snapshot its slices point into alive.
#ifndef FERRY_TRANSPORT_SEGMENT_VIEW_H_
#define FERRY_TRANSPORT_SEGMENT_VIEW_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "descriptor/descriptor.pb.h"

namespace ferry {

class SegmentView {
 public:
  // Validates `desc` and indexes its buffers.
  static absl::StatusOr<std::shared_ptr<const SegmentView>> Create(
      descriptor::SegmentDescriptor desc);

  const std::string& name() const { return desc_.name(); }
  uint64_t incarnation() const { return desc_.incarnation(); }
  uint64_t version() const { return desc_.version(); }
  const descriptor::SegmentDescriptor& descriptor() const { return desc_; }

  // The endpoint of `transport`, or nullptr if the segment does not serve it.
  const descriptor::TransportEndpoint* FindTransport(
      absl::string_view transport) const;

  // Index of `transport` in descriptor().transports(), or -1.
  int FindTransportIndex(absl::string_view transport) const;

  // Index in descriptor().buffers() of the buffer containing all of
  // [addr, addr + length), or -1.
  int FindBufferIndex(uint64_t addr, uint64_t length) const;
  const descriptor::Buffer& buffer(int index) const {
    return desc_.buffers(index);
  }

  // Whether `transport` reaches buffer `buffer`: a transport without
  // per-device keys (TCP) reaches every buffer; one with them (RDMA) only
  // those that published a key for at least one of its devices. GPU memory
  // that no NIC there could register (no GPUDirect RDMA) has none. The shm
  // transport reaches the buffers that published an shm_key (host memory).
  // Whether a transport reaches the segment at all is the transport's to
  // say (Transport::CanReach).
  bool Reaches(int transport, int buffer) const {
    const int n = device_count_[transport];
    if (n == 0) return true;
    const int64_t* row = &keys_[transport][static_cast<size_t>(buffer) * n];
    for (int d = 0; d < n; ++d) {
      if (row[d] >= 0) return true;
    }
    return false;
  }

  // The key buffer `buffer` published for device `device` of transport
  // `transport` (indices into the descriptor's lists), found in O(1): false
  // if it published none for that device.
  bool DeviceKey(int transport, int buffer, int device, uint32_t* key) const {
    const auto& t = keys_[transport];
    const int64_t k =
        t.empty() ? -1 : t[buffer * device_count_[transport] + device];
    if (k < 0) return false;
    *key = static_cast<uint32_t>(k);
    return true;
  }

 private:
  explicit SegmentView(descriptor::SegmentDescriptor desc);

  descriptor::SegmentDescriptor desc_;
  // Indices into desc_.buffers(), sorted by address.
  std::vector<int> by_addr_;
  // Per transport: devices, and the buffers x devices key table (-1: no
  // key), so the data path never compares NIC names.
  std::vector<int> device_count_;
  std::vector<std::vector<int64_t>> keys_;
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_SEGMENT_VIEW_H_
