#include "transport/segment_view.h"

#include <algorithm>
#include <utility>

#include "metadata/validation.h"

namespace ferry {

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentView::Create(
    metadata::SegmentDescriptor desc) {
  if (absl::Status s = metadata::ValidateSegmentDescriptor(desc); !s.ok()) {
    return s;
  }
  return std::shared_ptr<const SegmentView>(new SegmentView(std::move(desc)));
}

SegmentView::SegmentView(metadata::SegmentDescriptor desc)
    : desc_(std::move(desc)) {
  by_addr_.resize(desc_.buffers_size());
  for (int i = 0; i < desc_.buffers_size(); ++i) by_addr_[i] = i;
  std::sort(by_addr_.begin(), by_addr_.end(), [this](int a, int b) {
    return desc_.buffers(a).addr() < desc_.buffers(b).addr();
  });
}

const metadata::TransportEndpoint* SegmentView::FindTransport(
    absl::string_view transport) const {
  for (const auto& t : desc_.transports()) {
    if (t.transport() == transport) return &t;
  }
  return nullptr;
}

const metadata::Buffer* SegmentView::FindBuffer(uint64_t addr,
                                                uint64_t length) const {
  // First buffer starting above addr; the candidate is the one before it.
  auto it = std::upper_bound(
      by_addr_.begin(), by_addr_.end(), addr,
      [this](uint64_t a, int idx) { return a < desc_.buffers(idx).addr(); });
  if (it == by_addr_.begin()) return nullptr;
  const metadata::Buffer& b = desc_.buffers(*std::prev(it));
  if (addr + length < addr || addr + length > b.addr() + b.length()) {
    return nullptr;
  }
  return &b;
}

}  // namespace ferry
