// softgpu's dma-bufs, and how an importer (softrnic's ibv_reg_dmabuf_mr)
// maps one. Header-only and libc-only, so that softrnic's libibverbs.so.1
// can use it without linking anything of softgpu's.
//
// A real dma-buf from cuMemGetHandleForAddressRange(dptr, size) is a file
// whose byte 0 is device address dptr. softgpu has no kernel driver: each
// device allocation is a memory file (memfd) named "softgpu-dev<N>-<id>",
// and the "dma-buf" it exports is a new open file description of that
// memfd (open("/proc/self/fd/<memfd>", O_RDWR)), whose byte 0 is the
// allocation's base, not dptr. So the export leaves the new file's position
// (lseek) at dptr's offset within the allocation, and:
//
//   Byte `off` of a softgpu dma-buf is byte lseek(fd, 0, SEEK_CUR) + off of
//   the file; map it with mmap(..., MAP_SHARED, fd, that offset rounded down
//   to a page).
//
// The position belongs to the open file description: it survives dup() and
// SCM_RIGHTS, and an importer must not read(2), write(2) or lseek the fd
// (it would move the position). The file keeps the device memory alive
// after cuMemFree, as a real dma-buf does, until the fd and every mapping
// of it are gone.
//
// What the fd does not say is the exported range's length: DmabufRange
// reports the bytes from the position to the allocation's end, an upper
// bound. Importers are given the length by their caller anyway
// (ibv_reg_dmabuf_mr's `length`) and must check it against that bound.
#ifndef FERRY_GPU_SOFTGPU_DMABUF_H_
#define FERRY_GPU_SOFTGPU_DMABUF_H_

#include <stdio.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace softgpu {

// The prefix of the name softgpu gives every device allocation's memfd;
// /proc/self/fd/N of one reads "/memfd:softgpu-dev0-7 (deleted)".
inline constexpr char kMemfdNamePrefix[] = "softgpu-";

// True when `fd` is an open softgpu dma-buf (a memfd named by
// kMemfdNamePrefix). Looks only at /proc/self/fd; never moves the position.
inline bool IsSoftgpuDmabuf(int fd) {
  if (fd < 0) return false;
  char link[32];
  std::snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  char target[128];
  const ssize_t n = ::readlink(link, target, sizeof(target) - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  static constexpr char kMemfd[] = "/memfd:";
  return std::strncmp(target, kMemfd, sizeof(kMemfd) - 1) == 0 &&
         std::strncmp(target + sizeof(kMemfd) - 1, kMemfdNamePrefix,
                      sizeof(kMemfdNamePrefix) - 1) == 0;
}

// For a softgpu dma-buf `fd`: stores in *base the file offset of the
// dma-buf's byte 0 (its position) and in *size the bytes from there to the
// end of the allocation (an upper bound on the exported length), and
// returns true. Returns false, leaving both untouched, for any other fd.
inline bool DmabufRange(int fd, uint64_t* base, uint64_t* size) {
  if (!IsSoftgpuDmabuf(fd)) return false;
  const off_t position = ::lseek(fd, 0, SEEK_CUR);
  struct stat st;
  if (position < 0 || ::fstat(fd, &st) != 0 || st.st_size < position) {
    return false;
  }
  *base = static_cast<uint64_t>(position);
  *size = static_cast<uint64_t>(st.st_size - position);
  return true;
}

}  // namespace softgpu

#endif  // FERRY_GPU_SOFTGPU_DMABUF_H_
