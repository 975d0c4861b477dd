// ScopedDmaAccess: marks code that moves payload bytes into or out of
// registered memory the way a NIC's DMA engine does -- softrnic's
// responder and requester, the TCP transport's socket I/O on application
// buffers.
//
// Why: the application's own accesses to those bytes are ordered with the
// transfer by completions and by messages between processes (the
// initiator's completion, then a notification), which ThreadSanitizer
// cannot follow; on real hardware the DMA is not visible to it at all. So
// under TSan these accesses are ignored, as a NIC's are. The transports'
// own state is never accessed inside such a scope. A no-op in other
// builds.
#ifndef FERRY_COMMON_DMA_ANNOTATIONS_H_
#define FERRY_COMMON_DMA_ANNOTATIONS_H_

#include "common/sanitizers.h"

#ifdef FERRY_TSAN
extern "C" {
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}
#endif

namespace ferry {

class ScopedDmaAccess {
 public:
#ifdef FERRY_TSAN
  ScopedDmaAccess() {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  }
  ~ScopedDmaAccess() {
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
#else
  // User-provided (not = default), so that an unused-variable warning does
  // not fire on the scope object where it does nothing.
  ScopedDmaAccess() {}
#endif
  ScopedDmaAccess(const ScopedDmaAccess&) = delete;
  ScopedDmaAccess& operator=(const ScopedDmaAccess&) = delete;
};

}  // namespace ferry

#endif  // FERRY_COMMON_DMA_ANNOTATIONS_H_
