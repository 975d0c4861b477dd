// softgpu's internals: the emulated machine's configuration, streams, and
// the driver state behind the entry points (api.cc).
//
// Device memory is a memfd per allocation. The device pointer is a
// PROT_NONE reservation, so a CPU access to device memory faults as it does
// on a real GPU; the bytes live in a second, hidden MAP_SHARED mapping of
// the memfd that only the driver's copies and memsets use, and that a
// dma-buf export hands to an importer (dmabuf.h).
//
// Thread safety: every entry point may be called from any thread. The
// driver's tables (contexts, allocations, streams) are guarded by one
// mutex, never held while bytes move; each stream has its own queue lock
// and worker thread. An allocation is reference-counted, so a copy in
// progress or queued keeps its memory mapped even if it is freed meanwhile
// (freeing memory that a copy is still using is the caller's bug; it must
// not crash the driver).
#ifndef FERRY_GPU_SOFTGPU_SOFTGPU_H_
#define FERRY_GPU_SOFTGPU_SOFTGPU_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "gpu/cuda_abi.h"

#define SOFTGPU_EXPORT extern "C" __attribute__((visibility("default")))

// What a CUcontext points to: a device's primary context (the only kind
// softgpu has). Never dereferenced by callers.
struct CUctx_st {
  int device;
};

namespace softgpu {

using ferry::CondVar;
using ferry::Mutex;
using ferry::MutexLock;

inline constexpr int kDriverVersion = 12040;  // CUDA 12.4
inline constexpr char kDeviceName[] = "Ferry softgpu";
inline constexpr int kMaxDevices = 64;
// CUDA's special stream handles (cuda.h's CU_STREAM_LEGACY and
// CU_STREAM_PER_THREAD; not in gpu/cuda_abi.h, which Ferry does not need
// them in): the legacy NULL stream, and the calling thread's default
// stream. softgpu does not model per-thread default streams: that handle
// is the legacy stream too, which orders more than CUDA would but never
// less.
inline constexpr uintptr_t kStreamLegacy = 0x1;
inline constexpr uintptr_t kStreamPerThread = 0x2;

struct DeviceConfig {
  // As cuDeviceGetPCIBusId writes it: upper-case hex, as NVIDIA's driver
  // does (sysfs names devices in lower case; callers must not compare the
  // two case-sensitively).
  std::string bus_id;
  int domain = 0;
  int bus = 0;
  int device = 0;
};

// The emulated machine, read from the environment at cuInit:
//   FERRY_SOFTGPU_DEVICES      a device count (0..64, default 1), or a comma
//                              list of PCI addresses "dddd:bb:dd.f", one
//                              device each
//   FERRY_SOFTGPU_MEMORY_MIB   memory per device (default 4096)
//   FERRY_SOFTGPU_DMABUF       0: a driver/kernel that cannot export dma-bufs
//   FERRY_SOFTGPU_COPY_DELAY_US  a delay before each asynchronous copy runs,
//                              so that a missing stream synchronisation shows;
//                              when > 0, also the "synchronous" calls that
//                              CUDA lets return early do so (memset, device
//                              to device, from pageable memory: see
//                              Driver::LooselySynchronous) unless the device
//                              memory has SYNC_MEMOPS
struct Config {
  std::vector<DeviceConfig> devices;
  uint64_t memory_bytes = uint64_t{4096} << 20;
  bool dmabuf = true;
  uint64_t copy_delay_us = 0;
};

// Reads the configuration from the environment (unset or empty variables
// keep their defaults). On a malformed value returns false and stores in
// *error one line naming the variable and what is wrong with it.
bool LoadConfig(Config* config, std::string* error);

// softgpu_hold_streams (softgpu_control.h), for tests: while held, every
// stream's worker leaves its queued operations unrun (one already running
// finishes), so a test sees work pending without depending on timing.
// Process-wide, independent of cuInit.
void SetStreamsHeld(bool hold);

// A CUDA stream: operations run in the order enqueued, on the stream's own
// worker thread, each after the configured copy delay (and not while
// SetStreamsHeld holds them). The worker is detached and keeps its stream
// alive until Stop's drain is done, so that destroying a stream never
// waits for its work.
class Stream {
 public:
  // A stream with its worker running.
  static std::shared_ptr<Stream> Start(int device, uint64_t delay_us);
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // The device whose context created it; -1 for the legacy NULL stream.
  int device() const { return device_; }
  void Enqueue(std::function<void()> op);
  // Returns once every operation enqueued before the call has run.
  void Synchronize();
  // Whether every operation enqueued so far has run.
  bool Idle();
  // cuStreamDestroy: returns at once; the worker still runs what is
  // queued, then exits and drops the stream. An operation enqueued after
  // Stop may never run (enqueueing on a stream while destroying it is the
  // caller's bug).
  void Stop();

 private:
  Stream(int device, uint64_t delay_us)
      : device_(device), delay_us_(delay_us) {}
  // Until stopped and drained.
  void Run();

  const int device_;
  const uint64_t delay_us_;
  Mutex mu_;
  CondVar changed_;  // an operation was queued or finished, or stopping_
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

// One cuMemAlloc or cuMemHostAlloc: immutable once made, shared by the
// driver's table and by copies that use it; the last reference unmaps it
// (a freed device allocation's address space excepted: the driver keeps
// it for reuse).
class Allocation {
 public:
  enum class Kind {
    kDevice,      // a memfd behind a PROT_NONE reservation
    kPinnedHost,  // an ordinary read-write mapping
  };
  // An allocation of `size` bytes (mapped_size: rounded up to pages); null
  // if the system refuses the memfd or a mapping. Device memory goes at
  // `reservation` (PROT_NONE address space of mapped_size kept from a
  // freed allocation) if it is not 0.
  static std::shared_ptr<const Allocation> New(Kind kind, int device,
                                               uint64_t buffer_id, size_t size,
                                               size_t mapped_size,
                                               uintptr_t reservation = 0);
  // Device memory whose bytes are an existing memfd (another process's
  // allocation, for IPC): takes `memfd` over, closing it on failure too.
  static std::shared_ptr<const Allocation> Import(int device,
                                                  uint64_t buffer_id, int memfd,
                                                  size_t size,
                                                  size_t mapped_size);
  ~Allocation();
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;

  bool is_device() const { return memfd_ >= 0; }
  int device() const { return device_; }
  uint64_t buffer_id() const { return buffer_id_; }
  // The address the caller sees: the PROT_NONE reservation for device
  // memory, the memory itself for host memory.
  uintptr_t base() const { return base_; }
  size_t size() const { return size_; }
  size_t mapped_size() const { return mapped_size_; }
  int memfd() const { return memfd_; }
  // Where the driver reads and writes the bytes at base() + offset.
  char* bytes(size_t offset) const { return data_ + offset; }
  // Device memory: its address space stays reserved when the allocation
  // goes, for the driver to reuse. NVIDIA's driver keeps freed device
  // addresses too (no munmap at cuMemFree) and hands them out again.
  void KeepReservation() const { keep_reservation_.store(true); }

 private:
  Allocation(int device, uint64_t buffer_id, size_t size, size_t mapped_size)
      : device_(device),
        buffer_id_(buffer_id),
        size_(size),
        mapped_size_(mapped_size) {}

  const int device_;
  const uint64_t buffer_id_;
  const size_t size_;
  const size_t mapped_size_;
  uintptr_t base_ = 0;
  int memfd_ = -1;
  char* data_ = nullptr;  // device: the hidden mapping; host: base_
  mutable std::atomic<bool> keep_reservation_{false};
};

// What cuPointerGetAttribute(s) report about an address.
struct PointerInfo {
  unsigned int memory_type = 0;  // 0: not the driver's
  int device = -2;               // CUDA's value for memory no device owns
  CUcontext context = nullptr;
  uintptr_t range_start = 0;
  size_t range_size = 0;
  uint64_t buffer_id = 0;
  unsigned int sync_memops = 0;
};

// Which memory a copy's source or destination is.
struct CopyEnd {
  uintptr_t address;
  bool device;
};

// The driver after a successful cuInit. Methods check their arguments and
// return CUresult values; api.cc adds only the NOT_INITIALIZED check.
class Driver {
 public:
  // The driver, or null before cuInit has succeeded.
  static Driver* Get();
  // cuInit: the first call reads the configuration and starts the driver;
  // every later call returns the first one's result.
  static CUresult Init(unsigned int flags);

  int device_count() const { return static_cast<int>(config_.devices.size()); }
  bool ValidDevice(CUdevice dev) const {
    return dev >= 0 && dev < device_count();
  }
  // Only for a valid device.
  const DeviceConfig& device_config(CUdevice dev) const {
    return config_.devices[dev];
  }
  CUresult DeviceGetAttribute(int* value, CUdevice_attribute attribute,
                              CUdevice dev) const;

  // Contexts (context.cc). The primary context is reference-counted; the
  // last release resets the device, as CUDA does: its allocations, pinned
  // host memory and streams are freed (work queued on the streams still
  // completes in the background, as after cuStreamDestroy).
  CUresult PrimaryCtxRetain(CUcontext* ctx, CUdevice dev);
  CUresult PrimaryCtxRelease(CUdevice dev);
  CUresult CtxSetCurrent(CUcontext ctx);
  CUresult CtxGetCurrent(CUcontext* ctx);

  // Memory (memory.cc).
  CUresult MemAlloc(CUdeviceptr* dptr, size_t size);
  CUresult MemFree(CUdeviceptr dptr);
  CUresult MemGetAddressRange(CUdeviceptr* base, size_t* size,
                              CUdeviceptr dptr);
  CUresult MemHostAlloc(void** pp, size_t size, unsigned int flags);
  CUresult MemFreeHost(void* p);
  // A copy; on `stream` when `async` (NULL: the legacy stream), else
  // synchronously after the legacy stream's work -- except as
  // LooselySynchronous says.
  CUresult Memcpy(CopyEnd dst, CopyEnd src, size_t n, bool async,
                  CUstream stream);
  // After the legacy stream's work; or queued on it, as LooselySynchronous
  // says.
  CUresult MemsetD8(CUdeviceptr dst, unsigned char value, size_t n);
  PointerInfo QueryPointer(uintptr_t ptr);
  // Setting SYNC_MEMOPS (value != 0) also waits for the synchronous
  // operations still pending (LooselySynchronous), the allocation's among
  // them: from its return on, every synchronous one has completed.
  CUresult SetSyncMemops(uintptr_t ptr, unsigned int value);
  CUresult ExportDmabuf(void* handle, CUdeviceptr dptr, size_t size,
                        CUmemRangeHandleType type, unsigned long long flags);
  // CUDA IPC (memory.cc). A handle names the exporting process, its
  // allocation's memfd and buffer id; opening one reopens that memfd
  // through /proc/PID/fd (the ptrace permission a real driver's IPC does
  // not need: processes of one user have it) and maps it behind a
  // reservation of its own, on the device of the caller's context. A
  // process cannot open its own handles (as with NVIDIA's driver); one
  // opened twice is counted, and unmapped at its last close.
  CUresult IpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr dptr);
  CUresult IpcOpenMemHandle(CUdeviceptr* pdptr, const CUipcMemHandle& handle,
                            unsigned int flags);
  CUresult IpcCloseMemHandle(CUdeviceptr dptr);

  // Streams (context.cc).
  CUresult StreamCreate(CUstream* stream, unsigned int flags);
  CUresult StreamDestroy(CUstream stream);
  CUresult StreamSynchronize(CUstream stream);
  CUresult StreamQuery(CUstream stream);
  // Queues fn(user_data) on the stream, in order with its copies.
  CUresult LaunchHostFunc(CUstream stream, CUhostFn fn, void* user_data);

 private:
  struct Entry {
    std::shared_ptr<const Allocation> allocation;
    unsigned int sync_memops = 0;
    // Opened from another process's handle (cuIpcOpenMemHandle): closed,
    // never freed, and counted per open. Which file it maps: the same
    // allocation opened again is the same file (a restarted exporter's
    // handles may repeat its pid and buffer ids; its files differ).
    int imports = 0;
    dev_t file_dev = 0;
    ino_t file_ino = 0;
  };
  // Where one end of a copy reads or writes, and the allocation that must
  // stay mapped until it has.
  struct Side {
    char* bytes = nullptr;
    std::shared_ptr<const Allocation> keep;
    // The allocation's CU_POINTER_ATTRIBUTE_SYNC_MEMOPS.
    bool sync_memops = false;
  };

  explicit Driver(Config config);
  // Reads the configuration and makes the driver (Init's first call).
  static CUresult Start();

  // The calling thread's current context's device, if that context is
  // retained; else CUDA_ERROR_INVALID_CONTEXT.
  CUresult CurrentDevice(int* dev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The allocation in `table` holding [ptr, ptr + n) (n = 0: holding ptr),
  // or null.
  static Entry* Find(std::map<uintptr_t, Entry>& table, uintptr_t ptr,
                     size_t n);
  // Whether [ptr, ptr + n) overlaps any device allocation's pages.
  bool OverlapsDevice(uintptr_t ptr, size_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  CUresult Resolve(CopyEnd end, size_t n, Side* side)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NVIDIA's "API synchronization behavior": a synchronous memset of
  // device memory and a device-to-device copy are asynchronous with
  // respect to the host, and a host-to-device copy from pageable memory
  // returns once the source is staged, before the device is written --
  // unless the device memory has SYNC_MEMOPS. softgpu emulates that only
  // with FERRY_SOFTGPU_COPY_DELAY_US > 0 (so that a missing SYNC_MEMOPS
  // shows where one looks for missing synchronisation, and nowhere else):
  // then such a call is queued on the legacy stream and returns at once,
  // and this says true. `dst` is a device side; `src` the source of a
  // copy, or null for a memset. Device-to-host copies, and copies from
  // pinned memory, stay synchronous, as on a GPU.
  bool LooselySynchronous(const Side& dst, const CopyEnd* src_end,
                          const Side* src) const;
  // The stream behind a handle (NULL, kStreamLegacy, kStreamPerThread: the
  // legacy stream), or null.
  std::shared_ptr<Stream> FindStream(CUstream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<Stream> LockedFindStream(CUstream stream)
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t RoundToPages(size_t n) const {
    return (n + page_size_ - 1) / page_size_ * page_size_;
  }

  const Config config_;
  const size_t page_size_;
  // The devices' primary contexts; a CUcontext points to one of these.
  const std::unique_ptr<CUctx_st[]> contexts_;
  const std::shared_ptr<Stream> legacy_stream_;

  Mutex mu_;
  std::vector<int> retains_ ABSL_GUARDED_BY(mu_);          // per device
  std::vector<uint64_t> used_bytes_ ABSL_GUARDED_BY(mu_);  // per device
  // By base address; device pointers and host allocations never overlap.
  std::map<uintptr_t, Entry> device_memory_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, Entry> host_memory_ ABSL_GUARDED_BY(mu_);
  uint64_t next_buffer_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Address space of freed device allocations, by size: the next
  // allocation of that size gets it, so that tests meet, as on a GPU, a
  // freed pointer that points into another allocation.
  std::multimap<size_t, uintptr_t> spare_reservations_ ABSL_GUARDED_BY(mu_);
  // By handle: CUstream values are numbers, never reused, so a destroyed
  // stream's handle is refused rather than mistaken for a new stream.
  std::map<uintptr_t, std::shared_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  uintptr_t next_stream_handle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace softgpu

#endif  // FERRY_GPU_SOFTGPU_SOFTGPU_H_
