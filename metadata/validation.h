// The descriptor checks (descriptor/validation.h), and the size cap every
// Ferry gRPC service and client applies.
#ifndef FERRY_METADATA_VALIDATION_H_
#define FERRY_METADATA_VALIDATION_H_

#include "descriptor/validation.h"

namespace ferry::metadata {

// gRPC message cap for every Ferry service: a full descriptor of
// kMaxBuffersPerSegment buffers with a few keys each fits comfortably.
constexpr int kMaxRpcMessageBytes = 32 << 20;

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_VALIDATION_H_
