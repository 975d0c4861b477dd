// Whether this build runs under a sanitizer that replaces malloc (ASan,
// TSan). Their allocators quarantine freed blocks and unmap with raw
// system calls, so tests of how glibc's allocator gives memory back skip
// under them.
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

#endif  // FERRY_COMMON_SANITIZERS_H_
