#include "gpu/cuda_driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace ferry::gpu {
namespace {

constexpr char kDefaultLibrary[] = "libcuda.so.1";

// Host memory the driver knows (cuMemHostAlloc, cuMemHostRegister) has
// this type too; only a device ordinal tells nothing apart, so the type
// alone decides.
PointerInfo::Kind KindOf(unsigned int memory_type, unsigned int managed) {
  if (managed != 0) return PointerInfo::Kind::kManaged;
  switch (memory_type) {
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_ARRAY:
      return PointerInfo::Kind::kDevice;
    case CU_MEMORYTYPE_HOST:
      return PointerInfo::Kind::kPinnedHost;
    case CU_MEMORYTYPE_UNIFIED:
      return PointerInfo::Kind::kManaged;
    default:
      return PointerInfo::Kind::kHost;
  }
}

absl::StatusCode CodeOf(CUresult result) {
  switch (result) {
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_INVALID_HANDLE:
      return absl::StatusCode::kInvalidArgument;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_NOT_SUPPORTED:
      return absl::StatusCode::kUnimplemented;
    case CUDA_ERROR_NOT_FOUND:
      return absl::StatusCode::kNotFound;
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_CONTEXT:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::StatusOr<const CudaDriver*> CudaDriver::Get() {
  // Loaded once: a CUDA driver cannot be unloaded, and a host's driver
  // does not come or go while a process runs.
  static const auto* const kDriver =
      new absl::StatusOr<std::unique_ptr<CudaDriver>>([] {
        const char* env = std::getenv("FERRY_CUDA_LIBRARY");
        return Load(env != nullptr && *env != '\0' ? env : kDefaultLibrary);
      }());
  if (!kDriver->ok()) return kDriver->status();
  return kDriver->value().get();
}

const CudaDriver* CudaDriver::IfLoaded() {
  const char* env = std::getenv("FERRY_CUDA_LIBRARY");
  const char* library = env != nullptr && *env != '\0' ? env : kDefaultLibrary;
  void* handle = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  dlclose(handle);  // RTLD_NOLOAD took a reference.
  auto driver = Get();
  return driver.ok() ? *driver : nullptr;
}

absl::StatusOr<std::unique_ptr<CudaDriver>> CudaDriver::Load(
    const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::NotFoundError(absl::StrCat(
        "no CUDA driver: cannot load ", library, " (",
        why != nullptr ? why : "unknown reason",
        "); GPU memory needs NVIDIA's driver on this host, or softgpu's "
        "emulated one (tools/softgpu-run)"));
  }
  std::unique_ptr<CudaDriver> d(new CudaDriver());
  d->library_ = library;
  Api& a = d->api_;
  struct Entry {
    const char* symbol;
    void** slot;
  };
  const Entry entries[] = {
      {"cuInit", reinterpret_cast<void**>(&a.cuInit)},
      {"cuDriverGetVersion", reinterpret_cast<void**>(&a.cuDriverGetVersion)},
      {"cuGetErrorString", reinterpret_cast<void**>(&a.cuGetErrorString)},
      {"cuGetErrorName", reinterpret_cast<void**>(&a.cuGetErrorName)},
      {"cuDeviceGetCount", reinterpret_cast<void**>(&a.cuDeviceGetCount)},
      {"cuDeviceGet", reinterpret_cast<void**>(&a.cuDeviceGet)},
      {"cuDeviceGetName", reinterpret_cast<void**>(&a.cuDeviceGetName)},
      {"cuDeviceGetPCIBusId", reinterpret_cast<void**>(&a.cuDeviceGetPCIBusId)},
      {"cuDeviceGetAttribute",
       reinterpret_cast<void**>(&a.cuDeviceGetAttribute)},
      {"cuDevicePrimaryCtxRetain",
       reinterpret_cast<void**>(&a.cuDevicePrimaryCtxRetain)},
      {"cuDevicePrimaryCtxRelease_v2",
       reinterpret_cast<void**>(&a.cuDevicePrimaryCtxRelease)},
      {"cuCtxSetCurrent", reinterpret_cast<void**>(&a.cuCtxSetCurrent)},
      {"cuCtxGetCurrent", reinterpret_cast<void**>(&a.cuCtxGetCurrent)},
      {"cuMemAlloc_v2", reinterpret_cast<void**>(&a.cuMemAlloc)},
      {"cuMemFree_v2", reinterpret_cast<void**>(&a.cuMemFree)},
      {"cuMemGetAddressRange_v2",
       reinterpret_cast<void**>(&a.cuMemGetAddressRange)},
      {"cuMemHostAlloc", reinterpret_cast<void**>(&a.cuMemHostAlloc)},
      {"cuMemFreeHost", reinterpret_cast<void**>(&a.cuMemFreeHost)},
      {"cuMemcpyHtoD_v2", reinterpret_cast<void**>(&a.cuMemcpyHtoD)},
      {"cuMemcpyDtoH_v2", reinterpret_cast<void**>(&a.cuMemcpyDtoH)},
      {"cuMemcpyDtoD_v2", reinterpret_cast<void**>(&a.cuMemcpyDtoD)},
      {"cuMemcpyHtoDAsync_v2", reinterpret_cast<void**>(&a.cuMemcpyHtoDAsync)},
      {"cuMemcpyDtoHAsync_v2", reinterpret_cast<void**>(&a.cuMemcpyDtoHAsync)},
      {"cuMemcpyDtoDAsync_v2", reinterpret_cast<void**>(&a.cuMemcpyDtoDAsync)},
      {"cuIpcGetMemHandle", reinterpret_cast<void**>(&a.cuIpcGetMemHandle)},
      {"cuIpcOpenMemHandle_v2",
       reinterpret_cast<void**>(&a.cuIpcOpenMemHandle)},
      {"cuIpcCloseMemHandle", reinterpret_cast<void**>(&a.cuIpcCloseMemHandle)},
      {"cuMemsetD8_v2", reinterpret_cast<void**>(&a.cuMemsetD8)},
      {"cuStreamCreate", reinterpret_cast<void**>(&a.cuStreamCreate)},
      {"cuStreamDestroy_v2", reinterpret_cast<void**>(&a.cuStreamDestroy)},
      {"cuStreamSynchronize", reinterpret_cast<void**>(&a.cuStreamSynchronize)},
      {"cuStreamQuery", reinterpret_cast<void**>(&a.cuStreamQuery)},
      {"cuLaunchHostFunc", reinterpret_cast<void**>(&a.cuLaunchHostFunc)},
      {"cuPointerGetAttribute",
       reinterpret_cast<void**>(&a.cuPointerGetAttribute)},
      {"cuPointerGetAttributes",
       reinterpret_cast<void**>(&a.cuPointerGetAttributes)},
      {"cuPointerSetAttribute",
       reinterpret_cast<void**>(&a.cuPointerSetAttribute)},
      {"cuMemGetHandleForAddressRange",
       reinterpret_cast<void**>(&a.cuMemGetHandleForAddressRange)},
  };
  for (const Entry& e : entries) {
    *e.slot = dlsym(handle, e.symbol);
    if (*e.slot == nullptr) {
      // Not a driver Ferry can use: unloaded again. (A driver whose cuInit
      // fails below stays loaded: unloading a CUDA driver is unsupported.)
      dlclose(handle);
      // cuMemGetHandleForAddressRange came with CUDA 11.7; the others are
      // far older. A driver without one is too old for Ferry either way.
      return absl::FailedPreconditionError(absl::StrCat(
          "the CUDA driver ", library, " has no ", e.symbol,
          ": it is older than Ferry needs (CUDA 11.7, driver 515 or later)"));
    }
  }
  if (absl::Status s = d->Check(a.cuInit(0), "cuInit"); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA driver ", library, " does not start: ", s.message()));
  }
  FERRY_RETURN_IF_ERROR(
      d->Check(a.cuDriverGetVersion(&d->version_), "cuDriverGetVersion"));
  FERRY_RETURN_IF_ERROR(
      d->Check(a.cuDeviceGetCount(&d->device_count_), "cuDeviceGetCount"));
  return d;
}

absl::Status CudaDriver::Check(CUresult result, absl::string_view call) const {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* text = nullptr;
  if (api_.cuGetErrorName == nullptr ||
      api_.cuGetErrorName(result, &name) != CUDA_SUCCESS) {
    name = nullptr;
  }
  if (api_.cuGetErrorString == nullptr ||
      api_.cuGetErrorString(result, &text) != CUDA_SUCCESS) {
    text = nullptr;
  }
  return absl::Status(
      CodeOf(result),
      absl::StrCat(call, ": ",
                   name != nullptr ? name : absl::StrCat("CUresult ", result),
                   text != nullptr ? absl::StrCat(" (", text, ")") : ""));
}

absl::Status CudaDriver::UseDevice(int device) const {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(
        absl::StrCat("no CUDA device ", device, ": this host has ",
                     device_count_, " (", library_, ")"));
  }
  CUcontext ctx = nullptr;
  {
    MutexLock lock(&primary_mu_);
    if (primary_.size() < static_cast<size_t>(device_count_)) {
      primary_.resize(device_count_, nullptr);
    }
    ctx = primary_[device];
    if (ctx == nullptr) {
      CUdevice dev = 0;
      FERRY_RETURN_IF_ERROR(
          Check(api_.cuDeviceGet(&dev, device), "cuDeviceGet"));
      // Retained once and never released: the primary context then lives
      // as long as the process, which every buffer registered on it needs,
      // and a thread that switches devices per copy (the staging path)
      // does not grow the driver's reference count.
      FERRY_RETURN_IF_ERROR(Check(api_.cuDevicePrimaryCtxRetain(&ctx, dev),
                                  "cuDevicePrimaryCtxRetain"));
      primary_[device] = ctx;
    }
  }
  return Check(api_.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

absl::StatusOr<PointerInfo> CudaDriver::Classify(const void* ptr) const {
  unsigned int memory_type = 0;
  unsigned int managed = 0;
  int ordinal = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  unsigned long long buffer_id = 0;  // NOLINT: the ABI's type
  CUpointer_attribute attrs[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
      CU_POINTER_ATTRIBUTE_IS_MANAGED,
      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
      CU_POINTER_ATTRIBUTE_RANGE_SIZE,
      CU_POINTER_ATTRIBUTE_BUFFER_ID,
  };
  void* data[] = {&memory_type, &managed, &ordinal, &start, &size, &buffer_id};
  auto query = [&] {
    return api_.cuPointerGetAttributes(sizeof(attrs) / sizeof(attrs[0]), attrs,
                                       data,
                                       reinterpret_cast<CUdeviceptr>(ptr));
  };
  CUresult r = query();
  // Unified addressing answers without a context. A driver that wants one
  // gets device 0's primary context, on this thread only, and only then:
  // making one current everywhere would put a context (hundreds of MB) on
  // GPU 0 for every thread that registers memory.
  if (r == CUDA_ERROR_INVALID_CONTEXT && device_count_ > 0) {
    FERRY_RETURN_IF_ERROR(UseDevice(0));
    r = query();
  }
  FERRY_RETURN_IF_ERROR(Check(r, "cuPointerGetAttributes"));
  PointerInfo info;
  info.kind = KindOf(memory_type, managed);
  if (info.kind == PointerInfo::Kind::kHost) return info;
  info.device = ordinal;
  info.range_start = start;
  info.range_size = size;
  info.buffer_id = buffer_id;
  return info;
}

absl::StatusOr<std::string> CudaDriver::PciBusId(int device) const {
  CUdevice dev = 0;
  FERRY_RETURN_IF_ERROR(Check(api_.cuDeviceGet(&dev, device), "cuDeviceGet"));
  char id[32] = {};
  FERRY_RETURN_IF_ERROR(Check(api_.cuDeviceGetPCIBusId(id, sizeof(id), dev),
                              "cuDeviceGetPCIBusId"));
  std::string out(id);
  for (char& c : out) c = static_cast<char>(std::tolower(c));
  return out;
}

absl::StatusOr<std::string> CudaDriver::DeviceName(int device) const {
  CUdevice dev = 0;
  FERRY_RETURN_IF_ERROR(Check(api_.cuDeviceGet(&dev, device), "cuDeviceGet"));
  char name[256] = {};
  FERRY_RETURN_IF_ERROR(
      Check(api_.cuDeviceGetName(name, sizeof(name), dev), "cuDeviceGetName"));
  return std::string(name);
}

absl::StatusOr<bool> CudaDriver::DmaBufSupported(int device) const {
  CUdevice dev = 0;
  FERRY_RETURN_IF_ERROR(Check(api_.cuDeviceGet(&dev, device), "cuDeviceGet"));
  int value = 0;
  FERRY_RETURN_IF_ERROR(
      Check(api_.cuDeviceGetAttribute(
                &value, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev),
            "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)"));
  return value != 0;
}

absl::Status CudaDriver::CopyToDevice(CUdeviceptr dst, const void* src,
                                      size_t bytes) const {
  return Check(api_.cuMemcpyHtoD(dst, src, bytes), "cuMemcpyHtoD");
}

absl::Status CudaDriver::CopyFromDevice(void* dst, CUdeviceptr src,
                                        size_t bytes) const {
  return Check(api_.cuMemcpyDtoH(dst, src, bytes), "cuMemcpyDtoH");
}

absl::StatusOr<int> CudaDriver::DmaBufFd(CUdeviceptr ptr, size_t bytes) const {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (ptr % page != 0 || bytes % page != 0 || bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a dma-buf covers whole pages: [0x", absl::Hex(ptr), ", +",
                     bytes, ") is not aligned to the ", page, "-byte page"));
  }
  int fd = -1;
  absl::Status s = Check(
      api_.cuMemGetHandleForAddressRange(
          &fd, ptr, bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, /*flags=*/0),
      "cuMemGetHandleForAddressRange(DMA_BUF_FD)");
  if (s.code() == absl::StatusCode::kUnimplemented) {
    return absl::UnimplementedError(absl::StrCat(
        s.message(),
        ": this driver or kernel cannot export GPU memory as a dma-buf "
        "(it needs NVIDIA's open kernel modules, driver 515 or later, and "
        "Linux 5.12 or later); load nvidia-peermem (modprobe nvidia-peermem) "
        "for the older path, or let Ferry stage through host memory"));
  }
  if (!s.ok()) return s;
  return fd;
}

absl::Status CudaDriver::SetSyncMemops(CUdeviceptr ptr) const {
  const unsigned int on = 1;
  return Check(
      api_.cuPointerSetAttribute(&on, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, ptr),
      "cuPointerSetAttribute(SYNC_MEMOPS)");
}

}  // namespace ferry::gpu
