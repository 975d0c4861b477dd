// HappensBefore / HappensAfter: tell ThreadSanitizer about an ordering it
// cannot see. gRPC's callback API constructs a reactor on one thread and
// runs its callbacks on others, ordered by synchronization inside Debian's
// libgrpc, which is not instrumented; without this every field a callback
// reads that the constructor wrote is a "race" on paper. Mark the end of
// the constructor HappensBefore(this) and the start of each callback
// HappensAfter(this). No-ops outside TSan builds.
#ifndef FERRY_COMMON_HAPPENS_BEFORE_H_
#define FERRY_COMMON_HAPPENS_BEFORE_H_

#include "common/sanitizers.h"

#ifdef FERRY_TSAN
extern "C" {
void AnnotateHappensBefore(const char* file, int line, const volatile void* p);
void AnnotateHappensAfter(const char* file, int line, const volatile void* p);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}
#endif

namespace ferry {

inline void HappensBefore(const volatile void* p) {
#ifdef FERRY_TSAN
  AnnotateHappensBefore(__FILE__, __LINE__, p);
#else
  (void)p;
#endif
}

inline void HappensAfter(const volatile void* p) {
#ifdef FERRY_TSAN
  AnnotateHappensAfter(__FILE__, __LINE__, p);
#else
  (void)p;
#endif
}

// While one lives, ThreadSanitizer ignores this thread's memory accesses
// (reads too), and memory allocated on it counts as not yet written; its
// locks are still seen. For a call into uninstrumented code that
// allocates state its own threads use later, ordered where TSan cannot
// see: gRPC's server shutdown. Anything of Ferry's that such a call runs
// on this thread is not checked meanwhile, so keep the scope to that call.
class IgnoreAccessesInScope {
 public:
  IgnoreAccessesInScope() {
#ifdef FERRY_TSAN
    AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
  }
  ~IgnoreAccessesInScope() {
#ifdef FERRY_TSAN
    AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#endif
  }
  IgnoreAccessesInScope(const IgnoreAccessesInScope&) = delete;
  IgnoreAccessesInScope& operator=(const IgnoreAccessesInScope&) = delete;
};

}  // namespace ferry

#endif  // FERRY_COMMON_HAPPENS_BEFORE_H_
