#include "transport/segment_view.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "common/status_macros.h"
#include "descriptor/validation.h"

namespace ferry {

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentView::Create(
    descriptor::SegmentDescriptor desc) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentDescriptor(desc));
  return std::shared_ptr<const SegmentView>(new SegmentView(std::move(desc)));
}

SegmentView::SegmentView(descriptor::SegmentDescriptor desc)
    : desc_(std::move(desc)) {
  by_addr_.resize(desc_.buffers_size());
  for (int i = 0; i < desc_.buffers_size(); ++i) by_addr_[i] = i;
  std::sort(by_addr_.begin(), by_addr_.end(), [this](int a, int b) {
    return desc_.buffers(a).addr() < desc_.buffers(b).addr();
  });
  for (const auto& t : desc_.transports()) {
    device_count_.push_back(t.devices_size());
    std::vector<int64_t>& table = keys_.emplace_back();
    if (t.transport() == "shm") {
      // No devices, but a key per buffer: one column, set where the
      // buffer published one (host memory the target's table serves).
      device_count_.back() = 1;
      table.assign(desc_.buffers_size(), -1);
      for (int b = 0; b < desc_.buffers_size(); ++b) {
        if (desc_.buffers(b).shm_key() != 0) table[b] = 0;
      }
      continue;
    }
    if (t.devices_size() == 0) continue;
    absl::flat_hash_map<std::string, int> index;
    for (int d = 0; d < t.devices_size(); ++d) index[t.devices(d).name()] = d;
    table.assign(static_cast<size_t>(desc_.buffers_size()) * t.devices_size(),
                 -1);
    for (int b = 0; b < desc_.buffers_size(); ++b) {
      for (const auto& k : desc_.buffers(b).keys()) {
        auto it = index.find(k.nic());
        if (it == index.end()) continue;
        table[static_cast<size_t>(b) * t.devices_size() + it->second] =
            k.rkey();
      }
    }
  }
}

int SegmentView::FindTransportIndex(absl::string_view transport) const {
  for (int i = 0; i < desc_.transports_size(); ++i) {
    if (desc_.transports(i).transport() == transport) return i;
  }
  return -1;
}

const descriptor::TransportEndpoint* SegmentView::FindTransport(
    absl::string_view transport) const {
  for (const auto& t : desc_.transports()) {
    if (t.transport() == transport) return &t;
  }
  return nullptr;
}

int SegmentView::FindBufferIndex(uint64_t addr, uint64_t length) const {
  // First buffer starting above addr; the candidate is the one before it.
  auto it = std::upper_bound(
      by_addr_.begin(), by_addr_.end(), addr,
      [this](uint64_t a, int idx) { return a < desc_.buffers(idx).addr(); });
  if (it == by_addr_.begin()) return -1;
  const int index = *std::prev(it);
  const descriptor::Buffer& b = desc_.buffers(index);
  if (addr + length < addr || addr + length > b.addr() + b.length()) {
    return -1;
  }
  return index;
}

}  // namespace ferry
