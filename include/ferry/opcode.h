// The two one-sided operations Ferry moves data with. Shared by the public
// engine API and the transport interface.
#ifndef FERRY_INCLUDE_FERRY_OPCODE_H_
#define FERRY_INCLUDE_FERRY_OPCODE_H_

#include <cstdint>

namespace ferry {

enum class OpCode : uint8_t {
  kRead = 0,   // Remote -> local.
  kWrite = 1,  // Local -> remote.
};

}  // namespace ferry

#endif  // FERRY_INCLUDE_FERRY_OPCODE_H_
