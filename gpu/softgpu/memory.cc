// Device and pinned host memory, copies, pointer attributes and dma-buf
// export.
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "common/dma_annotations.h"
#include "gpu/softgpu/dmabuf.h"
#include "gpu/softgpu/softgpu.h"

namespace softgpu {
namespace {

// The bytes a GPU's copy engine moves. On real hardware that is DMA, which
// ThreadSanitizer never sees; the application orders it with stream
// synchronisation. So it is invisible to TSan here too (ScopedDmaAccess),
// and a missing synchronisation shows instead as wrong bytes under
// FERRY_SOFTGPU_COPY_DELAY_US. memmove: a copy within one allocation may
// overlap.
void CopyEngine(char* to, const char* from, size_t n) {
  ferry::ScopedDmaAccess dma;
  std::memmove(to, from, n);
}

}  // namespace

std::shared_ptr<const Allocation> Allocation::New(Kind kind, int device,
                                                  uint64_t buffer_id,
                                                  size_t size,
                                                  size_t mapped_size,
                                                  uintptr_t reservation) {
  std::shared_ptr<Allocation> a(
      new Allocation(device, buffer_id, size, mapped_size));
  if (kind == Kind::kPinnedHost) {
    void* p = mmap(nullptr, mapped_size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    a->base_ = reinterpret_cast<uintptr_t>(p);
    a->data_ = static_cast<char*>(p);
    return a;
  }
  a->base_ = reservation;  // Unmapped by the destructor if this fails.
  char name[64];
  std::snprintf(name, sizeof(name), "%sdev%d-%llu", kMemfdNamePrefix, device,
                static_cast<unsigned long long>(buffer_id));
  a->memfd_ = memfd_create(name, MFD_CLOEXEC);
  if (a->memfd_ < 0) return nullptr;
  if (ftruncate(a->memfd_, static_cast<off_t>(mapped_size)) != 0) {
    return nullptr;
  }
  // The device pointer: address space no CPU access may touch. It is never
  // backed, so it costs no memory whatever its size.
  if (reservation == 0) {
    void* r = mmap(nullptr, mapped_size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) return nullptr;
    reservation = reinterpret_cast<uintptr_t>(r);
  }
  a->base_ = reservation;
  void* data = mmap(nullptr, mapped_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                    a->memfd_, 0);
  if (data == MAP_FAILED) return nullptr;
  a->data_ = static_cast<char*>(data);
  return a;
}

std::shared_ptr<const Allocation> Allocation::Import(int device,
                                                     uint64_t buffer_id,
                                                     int memfd, size_t size,
                                                     size_t mapped_size) {
  std::shared_ptr<Allocation> a(
      new Allocation(device, buffer_id, size, mapped_size));
  a->memfd_ = memfd;  // Closed by the destructor, whatever happens below.
  void* r = mmap(nullptr, mapped_size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return nullptr;
  a->base_ = reinterpret_cast<uintptr_t>(r);
  void* data =
      mmap(nullptr, mapped_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (data == MAP_FAILED) return nullptr;
  a->data_ = static_cast<char*>(data);
  return a;
}

Allocation::~Allocation() {
  if (base_ != 0 && !keep_reservation_.load()) {
    munmap(reinterpret_cast<void*>(base_), mapped_size_);
  }
  if (memfd_ >= 0) {
    if (data_ != nullptr) munmap(data_, mapped_size_);
    close(memfd_);
  }
}

Driver::Entry* Driver::Find(std::map<uintptr_t, Entry>& table, uintptr_t ptr,
                            size_t n) {
  auto it = table.upper_bound(ptr);
  if (it == table.begin()) return nullptr;
  --it;
  const Allocation& a = *it->second.allocation;
  const uintptr_t offset = ptr - a.base();
  if (offset >= a.size() || (n > 0 && n > a.size() - offset)) return nullptr;
  return &it->second;
}

bool Driver::OverlapsDevice(uintptr_t ptr, size_t n) {
  const uintptr_t last = n == 0 || ptr + (n - 1) < ptr ? ptr : ptr + (n - 1);
  // Allocations do not overlap: only the last one starting at or before
  // `last` can reach into the range.
  auto it = device_memory_.upper_bound(last);
  if (it == device_memory_.begin()) return false;
  --it;
  return it->first + it->second.allocation->mapped_size() > ptr;
}

CUresult Driver::Resolve(CopyEnd end, size_t n, Side* side) {
  if (end.device) {
    Entry* e = Find(device_memory_, end.address, n);
    if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
    side->bytes = e->allocation->bytes(end.address - e->allocation->base());
    side->keep = e->allocation;
    side->sync_memops = e->sync_memops != 0;
    return CUDA_SUCCESS;
  }
  // A device pointer passed as a host pointer would fault in the copy: a
  // real driver refuses it too.
  if (end.address == 0 || OverlapsDevice(end.address, n)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  side->bytes = reinterpret_cast<char*>(end.address);
  // Pinned memory stays mapped until a queued copy into it has run.
  if (Entry* e = Find(host_memory_, end.address, n); e != nullptr) {
    side->keep = e->allocation;
  }
  return CUDA_SUCCESS;
}

CUresult Driver::MemAlloc(CUdeviceptr* dptr, size_t size) {
  if (dptr == nullptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
  MutexLock lock(&mu_);
  int dev = 0;
  if (CUresult r = CurrentDevice(&dev); r != CUDA_SUCCESS) return r;
  // Checked before rounding, which could overflow.
  const uint64_t free_bytes = config_.memory_bytes - used_bytes_[dev];
  if (size > free_bytes || RoundToPages(size) > free_bytes) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const size_t mapped = RoundToPages(size);
  // System calls under the lock: a few microseconds, and allocation then
  // never races with the context's reset.
  uintptr_t reservation = 0;
  if (auto spare = spare_reservations_.find(mapped);
      spare != spare_reservations_.end()) {
    reservation = spare->second;
    spare_reservations_.erase(spare);
  }
  auto a = Allocation::New(Allocation::Kind::kDevice, dev, next_buffer_id_++,
                           size, mapped, reservation);
  if (a == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  used_bytes_[dev] += mapped;
  const uintptr_t base = a->base();
  device_memory_[base] = Entry{std::move(a), 0};
  *dptr = base;
  return CUDA_SUCCESS;
}

CUresult Driver::MemFree(CUdeviceptr dptr) {
  Entry freed;  // unmapped after the lock is dropped
  MutexLock lock(&mu_);
  auto it = device_memory_.find(dptr);
  // Memory opened from another process is closed, never freed.
  if (it == device_memory_.end() || it->second.imports > 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  freed = std::move(it->second);
  device_memory_.erase(it);
  used_bytes_[freed.allocation->device()] -= freed.allocation->mapped_size();
  freed.allocation->KeepReservation();
  spare_reservations_.emplace(freed.allocation->mapped_size(), dptr);
  return CUDA_SUCCESS;
}

CUresult Driver::MemGetAddressRange(CUdeviceptr* base, size_t* size,
                                    CUdeviceptr dptr) {
  MutexLock lock(&mu_);
  const Entry* e = Find(device_memory_, dptr, 0);
  if (e == nullptr) return CUDA_ERROR_NOT_FOUND;
  if (base != nullptr) *base = e->allocation->base();
  if (size != nullptr) *size = e->allocation->size();
  return CUDA_SUCCESS;
}

CUresult Driver::MemHostAlloc(void** pp, size_t size, unsigned int flags) {
  if (pp == nullptr || size == 0 ||
      (flags & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP)) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (size > SIZE_MAX - page_size_) return CUDA_ERROR_OUT_OF_MEMORY;
  MutexLock lock(&mu_);
  int dev = 0;
  if (CUresult r = CurrentDevice(&dev); r != CUDA_SUCCESS) return r;
  auto a = Allocation::New(Allocation::Kind::kPinnedHost, dev,
                           next_buffer_id_++, size, RoundToPages(size));
  if (a == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  const uintptr_t base = a->base();
  host_memory_[base] = Entry{std::move(a), 0};
  *pp = reinterpret_cast<void*>(base);
  return CUDA_SUCCESS;
}

CUresult Driver::MemFreeHost(void* p) {
  Entry freed;  // unmapped after the lock is dropped
  MutexLock lock(&mu_);
  auto it = host_memory_.find(reinterpret_cast<uintptr_t>(p));
  if (it == host_memory_.end()) return CUDA_ERROR_INVALID_VALUE;
  freed = std::move(it->second);
  host_memory_.erase(it);
  return CUDA_SUCCESS;
}

CUresult Driver::Memcpy(CopyEnd dst, CopyEnd src, size_t n, bool async,
                        CUstream stream) {
  Side to;
  Side from;
  std::shared_ptr<Stream> s;
  {
    MutexLock lock(&mu_);
    int dev = 0;
    if (CUresult r = CurrentDevice(&dev); r != CUDA_SUCCESS) return r;
    s = async ? FindStream(stream) : legacy_stream_;
    if (s == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (n == 0) return CUDA_SUCCESS;
    if (CUresult r = Resolve(dst, n, &to); r != CUDA_SUCCESS) return r;
    if (CUresult r = Resolve(src, n, &from); r != CUDA_SUCCESS) return r;
  }
  if (async) {
    s->Enqueue([to, from, n] { CopyEngine(to.bytes, from.bytes, n); });
    return CUDA_SUCCESS;
  }
  if (dst.device && LooselySynchronous(to, &src, &from)) {
    if (src.device) {  // device to device: queued
      s->Enqueue([to, from, n] { CopyEngine(to.bytes, from.bytes, n); });
      return CUDA_SUCCESS;
    }
    // From pageable memory: as the driver does, after the stream's work,
    // the source is copied to staging memory, which the caller may then
    // reuse, and the copy from there to the device is queued.
    s->Synchronize();
    auto staged =
        std::make_shared<std::vector<char>>(from.bytes, from.bytes + n);
    s->Enqueue([to, staged, n] { CopyEngine(to.bytes, staged->data(), n); });
    return CUDA_SUCCESS;
  }
  s->Synchronize();
  CopyEngine(to.bytes, from.bytes, n);
  return CUDA_SUCCESS;
}

bool Driver::LooselySynchronous(const Side& dst, const CopyEnd* src_end,
                                const Side* src) const {
  if (config_.copy_delay_us == 0 || dst.sync_memops) return false;
  if (src_end == nullptr) return true;  // a memset
  // From device memory (unless it has SYNC_MEMOPS), or pageable host
  // memory (no allocation of ours keeps it): not from pinned memory.
  return src_end->device ? !src->sync_memops : src->keep == nullptr;
}

CUresult Driver::MemsetD8(CUdeviceptr dst, unsigned char value, size_t n) {
  Side to;
  {
    MutexLock lock(&mu_);
    int dev = 0;
    if (CUresult r = CurrentDevice(&dev); r != CUDA_SUCCESS) return r;
    if (n == 0) return CUDA_SUCCESS;
    if (CUresult r = Resolve({dst, true}, n, &to); r != CUDA_SUCCESS) return r;
  }
  if (LooselySynchronous(to, nullptr, nullptr)) {
    legacy_stream_->Enqueue([to, value, n] {
      ferry::ScopedDmaAccess dma;
      std::memset(to.bytes, value, n);
    });
    return CUDA_SUCCESS;
  }
  legacy_stream_->Synchronize();
  ferry::ScopedDmaAccess dma;
  std::memset(to.bytes, value, n);
  return CUDA_SUCCESS;
}

PointerInfo Driver::QueryPointer(uintptr_t ptr) {
  PointerInfo info;
  MutexLock lock(&mu_);
  const Entry* e = Find(device_memory_, ptr, 0);
  unsigned int type = CU_MEMORYTYPE_DEVICE;
  if (e == nullptr) {
    e = Find(host_memory_, ptr, 0);
    type = CU_MEMORYTYPE_HOST;
  }
  if (e == nullptr) return info;
  const Allocation& a = *e->allocation;
  info.memory_type = type;
  info.device = a.device();
  info.context = &contexts_[a.device()];
  info.range_start = a.base();
  info.range_size = a.size();
  info.buffer_id = a.buffer_id();
  info.sync_memops = e->sync_memops;
  return info;
}

CUresult Driver::SetSyncMemops(uintptr_t ptr, unsigned int value) {
  {
    MutexLock lock(&mu_);
    Entry* e = Find(device_memory_, ptr, 0);
    if (e == nullptr) e = Find(host_memory_, ptr, 0);
    if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
    e->sync_memops = value != 0 ? 1 : 0;
  }
  // Synchronous operations still pending on the allocation complete
  // first. They are all on the legacy stream (LooselySynchronous), in
  // order with the rest of its work: all of that is waited for.
  if (value != 0 && config_.copy_delay_us > 0) legacy_stream_->Synchronize();
  return CUDA_SUCCESS;
}

CUresult Driver::ExportDmabuf(void* handle, CUdeviceptr dptr, size_t size,
                              CUmemRangeHandleType type,
                              unsigned long long flags) {
  if (!config_.dmabuf) return CUDA_ERROR_NOT_SUPPORTED;
  if (handle == nullptr || type != CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD ||
      flags != 0 || size == 0 || dptr % page_size_ != 0 ||
      size % page_size_ != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::shared_ptr<const Allocation> a;
  {
    MutexLock lock(&mu_);
    const Entry* e = Find(device_memory_, dptr, 0);
    if (e == nullptr) return CUDA_ERROR_INVALID_VALUE;
    // A range may cover the last page's tail past the requested size: a
    // dma-buf is whole pages.
    if (size > e->allocation->mapped_size() - (dptr - e->allocation->base())) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    // Held while the memfd is reopened, so that a concurrent cuMemFree
    // cannot close it and let its number name another file.
    a = e->allocation;
  }
  char path[32];
  std::snprintf(path, sizeof(path), "/proc/self/fd/%d", a->memfd());
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return errno == EMFILE || errno == ENFILE ? CUDA_ERROR_OUT_OF_MEMORY
                                              : CUDA_ERROR_UNKNOWN;
  }
  // The convention of dmabuf.h: the dma-buf's byte 0 is at the position.
  const off_t offset = static_cast<off_t>(dptr - a->base());
  if (lseek(fd, offset, SEEK_SET) != offset) {
    close(fd);
    return CUDA_ERROR_UNKNOWN;
  }
  *static_cast<int*>(handle) = fd;
  return CUDA_SUCCESS;
}

namespace {

// What a softgpu CUipcMemHandle holds (the rest of its 64 bytes is zero).
struct IpcHandle {
  uint32_t magic;
  uint32_t version;
  int32_t pid;
  int32_t memfd;
  uint64_t buffer_id;
  uint64_t size;
  uint64_t mapped_size;
  int32_t device;
};
static_assert(sizeof(IpcHandle) <= CU_IPC_HANDLE_SIZE);
constexpr uint32_t kIpcMagic = 0x53475049;  // "IPGS"

}  // namespace

CUresult Driver::IpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr dptr) {
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  MutexLock lock(&mu_);
  const Entry* e = Find(device_memory_, dptr, 0);
  // Only memory this process allocated: an opened handle is not exported
  // again.
  if (e == nullptr || e->imports > 0) return CUDA_ERROR_INVALID_VALUE;
  IpcHandle h{};
  h.magic = kIpcMagic;
  h.version = 1;
  h.pid = getpid();
  h.memfd = e->allocation->memfd();
  h.buffer_id = e->allocation->buffer_id();
  h.size = e->allocation->size();
  h.mapped_size = e->allocation->mapped_size();
  h.device = e->allocation->device();
  std::memset(handle, 0, sizeof(*handle));
  std::memcpy(handle->reserved, &h, sizeof(h));
  return CUDA_SUCCESS;
}

CUresult Driver::IpcOpenMemHandle(CUdeviceptr* pdptr,
                                  const CUipcMemHandle& handle,
                                  unsigned int flags) {
  if (pdptr == nullptr || (flags & ~CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  IpcHandle h;
  std::memcpy(&h, handle.reserved, sizeof(h));
  if (h.magic != kIpcMagic || h.version != 1 || h.pid <= 0 || h.memfd < 0 ||
      h.size == 0 || h.mapped_size < h.size ||
      h.mapped_size % page_size_ != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (h.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;
  int dev = 0;
  {
    MutexLock lock(&mu_);
    if (CUresult r = CurrentDevice(&dev); r != CUDA_SUCCESS) return r;
  }
  // The exporter's memfd, checked to be the allocation the handle names
  // (its name carries the device and buffer id) and as large.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/fd/%d", h.pid, h.memfd);
  char target[128];
  const ssize_t n = readlink(path, target, sizeof(target) - 1);
  if (n <= 0) return CUDA_ERROR_INVALID_HANDLE;  // Exited, or not ours.
  target[n] = '\0';
  char want[96];
  std::snprintf(want, sizeof(want), "/memfd:%sdev%d-%llu", kMemfdNamePrefix,
                h.device, static_cast<unsigned long long>(h.buffer_id));
  const size_t want_len = std::strlen(want);
  if (std::strncmp(target, want, want_len) != 0 ||
      (target[want_len] != '\0' && target[want_len] != ' ')) {
    return CUDA_ERROR_INVALID_HANDLE;  // The fd names something else now.
  }
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
  struct stat st {};
  if (fstat(fd, &st) != 0 ||
      static_cast<uint64_t>(st.st_size) != h.mapped_size) {
    close(fd);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  MutexLock lock(&mu_);
  // Opened before (the same file): one more reference to that mapping.
  for (auto& [base, e] : device_memory_) {
    if (e.imports > 0 && e.file_dev == st.st_dev && e.file_ino == st.st_ino) {
      close(fd);
      ++e.imports;
      *pdptr = base;
      return CUDA_SUCCESS;
    }
  }
  auto a =
      Allocation::Import(dev, next_buffer_id_++, fd, h.size, h.mapped_size);
  if (a == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  const uintptr_t base = a->base();
  Entry e{std::move(a), 0};
  e.imports = 1;
  e.file_dev = st.st_dev;
  e.file_ino = st.st_ino;
  device_memory_[base] = std::move(e);
  *pdptr = base;
  return CUDA_SUCCESS;
}

CUresult Driver::IpcCloseMemHandle(CUdeviceptr dptr) {
  Entry closed;  // unmapped after the lock is dropped
  MutexLock lock(&mu_);
  auto it = device_memory_.find(dptr);
  if (it == device_memory_.end() || it->second.imports == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (--it->second.imports > 0) return CUDA_SUCCESS;
  closed = std::move(it->second);
  device_memory_.erase(it);
  return CUDA_SUCCESS;
}

}  // namespace softgpu
