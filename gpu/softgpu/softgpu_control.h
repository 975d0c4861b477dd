// Run-time control of softgpu from tests. Not part of NVIDIA's driver
// ABI: softgpu's libcuda.so.1 exports these beside the CUDA entry points,
// NVIDIA's does not, so they are looked up at run time, in whichever
// library the process loaded as libcuda.so.1 (by its soname, so also one
// loaded by path, as $FERRY_CUDA_LIBRARY or a test's dlopen does). Each
// returns 0 on success, -1 with errno set: ENOSYS if no libcuda.so.1 is
// loaded or the loaded one is not softgpu.
#ifndef FERRY_GPU_SOFTGPU_SOFTGPU_CONTROL_H_
#define FERRY_GPU_SOFTGPU_SOFTGPU_CONTROL_H_

#include <dlfcn.h>
#include <errno.h>

extern "C" {
// Exported by softgpu under these names (unversioned, as NVIDIA's entry
// points are: a version script cannot mix unversioned and named nodes).
typedef int (*softgpu_hold_streams_fn)(int hold);
}

namespace softgpu {

// `name` in the loaded libcuda.so.1, or null.
inline void* LoadedControl(const char* name) {
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  void* fn = dlsym(lib, name);
  dlclose(lib);  // only drops RTLD_NOLOAD's reference; it stays loaded
  return fn;
}

// Holds (hold = true) or releases every stream's queued work, the legacy
// NULL stream's included: while held, an operation enqueued does not run
// (cuStreamQuery says CUDA_ERROR_NOT_READY, its bytes are not moved, and
// cuStreamSynchronize or a synchronous call that waits for that stream
// blocks) until it is released; then the queues run as usual. An
// operation already running when the hold begins finishes. Process-wide;
// may be called before cuInit. For tests that must see work pending
// without relying on timing.
inline int HoldStreams(bool hold) {
  auto fn = reinterpret_cast<softgpu_hold_streams_fn>(
      LoadedControl("softgpu_hold_streams"));
  if (fn == nullptr) return errno = ENOSYS, -1;
  return fn(hold ? 1 : 0);
}

}  // namespace softgpu

#endif  // FERRY_GPU_SOFTGPU_SOFTGPU_CONTROL_H_
