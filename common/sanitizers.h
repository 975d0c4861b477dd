// Which sanitizer this build runs under. FERRY_SANITIZER_ALLOCATOR: one
// that replaces malloc (ASan, TSan). Their allocators quarantine freed blocks
// and unmap with raw system calls, so tests of how glibc's allocator gives
// memory back skip under them.
#ifndef FERRY_COMMON_SANITIZERS_H_
#define FERRY_COMMON_SANITIZERS_H_

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FERRY_SANITIZER_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FERRY_SANITIZER_ALLOCATOR 1
#endif
#endif
#ifndef FERRY_SANITIZER_ALLOCATOR
#define FERRY_SANITIZER_ALLOCATOR 0
#endif

// Defined in ThreadSanitizer builds (for its annotations:
// dma_annotations.h, happens_before.h).
#if defined(__SANITIZE_THREAD__)
#define FERRY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TSAN 1
#endif
#endif

#ifdef __cplusplus
#include <cstddef>

namespace ferry {

// How many times less bulk data a test moves in a build that makes every
// access and every fresh page several times dearer (ASan, TSan): 4 there,
// 1 elsewhere. Every case and every size class stays; only volumes moved
// for their own sake shrink, as the connection model checker bounds its
// depth there. Those builds are for finding races and memory errors, which
// the cases find at a quarter of the volume; the default build moves it all.
inline constexpr size_t kSanitizerVolumeDivisor =
    FERRY_SANITIZER_ALLOCATOR ? 4 : 1;

}  // namespace ferry
#endif

#endif  // FERRY_COMMON_SANITIZERS_H_
