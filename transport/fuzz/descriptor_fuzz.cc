// Fuzz target: a segment descriptor as it arrives from a metadata server
// (any bytes). Parsing, validation and the view built from a valid one
// must never crash, and a view must answer lookups within its buffers.
#include <cstddef>
#include <cstdint>

#include "descriptor/descriptor.pb.h"
#include "descriptor/validation.h"
#include "google/protobuf/stubs/logging.h"
#include "transport/segment_view.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Protobuf logs every string field that is not UTF-8: noise here, and
  // slow.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ferry::descriptor::SegmentDescriptor desc;
  if (!desc.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto view = ferry::SegmentView::Create(desc);
  if (!view.ok()) return 0;
  const auto& d = (*view)->descriptor();
  for (int t = 0; t < d.transports_size(); ++t) {
    (*view)->FindTransport(d.transports(t).transport());
  }
  for (int b = 0; b < d.buffers_size(); ++b) {
    const auto& buf = d.buffers(b);
    const int found = (*view)->FindBufferIndex(buf.addr(), buf.length());
    if (found < 0) __builtin_trap();  // A valid buffer must be found.
    (*view)->FindBufferIndex(buf.addr() + buf.length() - 1, 2);
    for (int t = 0; t < d.transports_size(); ++t) {
      for (int dev = 0; dev < d.transports(t).devices_size(); ++dev) {
        uint32_t key;
        (*view)->DeviceKey(t, b, dev, &key);
      }
    }
  }
  return 0;
}
