// The pages behind a memory registration, as the kernel's pinning would
// see them: whether a range is mapped with the access an MR grants, and
// strict page identity (mr_pages.cc says why), which records the frames of
// an MR's pages at registration for every access to compare
// (FramesUnchanged, softrnic.h). Thread-safe.
#ifndef FERRY_TRANSPORT_SOFTRNIC_MR_PAGES_H_
#define FERRY_TRANSPORT_SOFTRNIC_MR_PAGES_H_

#include <cstddef>
#include <cstdint>

namespace softrnic {

// Whether every page of [start, start + length) is mapped readable (and
// writable if `writable`), from /proc/self/maps. The kernel's ibv_reg_mr
// pins the pages and fails with EFAULT where it cannot: an unmapped hole,
// PROT_NONE memory (a GPU address without nvidia-peermem), or read-only
// memory registered for writing. softrnic pins nothing, so without this a
// bad registration would succeed and the first access would fault inside
// the NIC's thread. Returns 0 or EFAULT. A process out of file descriptors
// cannot open maps, but the kernel's ibv_reg_mr needs none: the check is
// skipped then rather than failing a registration hardware would accept.
int CheckMapped(uintptr_t start, size_t length, bool writable);

// Whether registrations record their pages' frames now
// (FERRY_SOFTRNIC_STRICT_PAGES=1 or softrnic_set_strict_pages).
bool StrictPagesOn();

// Whether registrations fault their pages in, as the kernel's pinning does
// (FERRY_SOFTRNIC_PIN_PAGES=1; strict mode does too). Off by default: a
// NIC pins, so registering costs what faulting the memory in costs and
// makes it resident, which bench/register_bench measures; tests that
// register large buffers they never touch would hold that memory.
bool PinPagesOn();

// Faults the pages of [start, start+length) in, as ibv_reg_mr pins them:
// for write if `writable` (so that a later write does not move a page off
// the shared zero page; read-only memory is then faulted for read), else
// for read (no copy-on-write break of a private file mapping for an MR
// that only reads). Returns 0 or EFAULT if a page is not mapped.
int PopulatePages(uintptr_t start, size_t length, bool writable);

// PopulatePages, then the frames of the pages in *out (new[]).
// Returns 0 or an errno: EFAULT if a page is not mapped, EPERM if frames
// are hidden.
int RecordFrames(uintptr_t start, size_t length, uint64_t** out);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_MR_PAGES_H_
