// softgpu against its contract, gpu/cuda_abi.h, through the library file
// loaded as Ferry loads a driver (test_driver.h). Most tests share one
// driver: two devices, 256 MiB each. Those that need another
// configuration, or a driver not yet initialised, run in a fresh process:
// a death test's child, which re-executes this binary (threadsafe style)
// and so loads a driver of its own.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gpu/cuda_abi.h"
#include "gpu/softgpu/dmabuf.h"
#include "gpu/softgpu/test_driver.h"
#include "gtest/gtest.h"

namespace softgpu {
namespace {

constexpr size_t kMemoryMib = 256;
constexpr char kBusIds[] = "0000:3b:00.0,0001:86:1f.0";

size_t PageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// Bytes that differ with the position and from page to page, so that a
// copy to the wrong offset shows.
std::vector<unsigned char> Pattern(size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<unsigned char>(i * 131 + (i >> 12) * 17 + seed * 29 + 1);
  }
  return v;
}

// The index of the first differing byte, or -1 (every byte checked).
long FirstDifference(const unsigned char* a, const unsigned char* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<long>(i);
  }
  return -1;
}

// The driver most tests share.
struct Machine {
  CUcontext contexts[2] = {};
};

const Machine& Gpu() {
  static const Machine* machine = [] {
    const std::string mib = std::to_string(kMemoryMib);
    const CUresult r = InitWith({{"FERRY_SOFTGPU_DEVICES", kBusIds},
                                 {"FERRY_SOFTGPU_MEMORY_MIB", mib.c_str()}});
    auto* m = new Machine;
    // Retained for good: releasing the last reference would reset a
    // device under the other tests.
    if (r != CUDA_SUCCESS ||
        Cuda().cuDevicePrimaryCtxRetain(&m->contexts[0], 0) != CUDA_SUCCESS ||
        Cuda().cuDevicePrimaryCtxRetain(&m->contexts[1], 1) != CUDA_SUCCESS) {
      std::fprintf(stderr, "softgpu did not start: %s\n", Name(r).c_str());
      std::exit(2);
    }
    return m;
  }();
  return *machine;
}

// A device allocation freed at the end of the scope (unless freed before).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size) : size_(size) {
    result_ = Cuda().cuMemAlloc(&ptr_, size);
  }
  ~DeviceBuffer() {
    if (result_ == CUDA_SUCCESS && !freed_) Cuda().cuMemFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  CUresult result() const { return result_; }
  CUdeviceptr ptr() const { return ptr_; }
  size_t size() const { return size_; }
  // Frees it now; ptr() keeps the address, for tests of what follows.
  CUresult Free() {
    freed_ = true;
    return Cuda().cuMemFree(ptr_);
  }

 private:
  const size_t size_;
  CUdeviceptr ptr_ = 0;
  CUresult result_;
  bool freed_ = false;
};

// Death tests re-execute the binary (threadsafe style) rather than fork
// it: the child then loads a driver of its own, and no fork copies one
// with stream threads. Set here, not in a static initializer, which may
// run before gtest initialises its flags.
class DeathTestsReexecute : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

using SoftgpuFreshTest = DeathTestsReexecute;

class SoftgpuTest : public DeathTestsReexecute {
 protected:
  void SetUp() override {
    DeathTestsReexecute::SetUp();
    UseDevice(0);
  }
  static void UseDevice(int device) {
    ASSERT_CU_OK(Cuda().cuCtxSetCurrent(Gpu().contexts[device]));
  }
  const CudaApi& cu_ = Cuda();
};

// ---- Fresh processes -----------------------------------------------------

// Checks in a fresh process, whose gtest assertions would not reach this
// one: each failure is printed (gtest shows the child's stderr) and makes
// the child exit 1.
class Child {
 public:
  void Expect(bool ok, const char* what, int line) {
    if (ok) return;
    std::fprintf(stderr, "softgpu_test.cc:%d: expected %s\n", line, what);
    ++failures_;
  }
  void ExpectCu(CUresult expected, CUresult actual, const char* what,
                int line) {
    if (expected == actual) return;
    std::fprintf(stderr, "softgpu_test.cc:%d: %s is %s, expected %s\n", line,
                 what, Name(actual).c_str(), Name(expected).c_str());
    ++failures_;
  }
  int failures() const { return failures_; }

 private:
  int failures_ = 0;
};

#define CHILD_EXPECT(child, cond) (child).Expect((cond), #cond, __LINE__)
#define CHILD_EXPECT_CU(child, expected, call) \
  (child).ExpectCu((expected), (call), #call, __LINE__)

// Runs `body` in a fresh process; the test fails with the child's report
// if any of its checks failed.
#define EXPECT_IN_FRESH_PROCESS(body)         \
  EXPECT_EXIT(                                \
      {                                       \
        Child child;                          \
        body(child);                          \
        std::fflush(stdout);                  \
        _exit(child.failures() == 0 ? 0 : 1); \
      },                                      \
      ::testing::ExitedWithCode(0), "")

TEST_F(SoftgpuFreshTest, EveryCallBeforeCuInitIsNotInitialized) {
  auto body = [](Child& c) {
    const CudaApi& cu = Cuda();
    const CUresult kNo = CUDA_ERROR_NOT_INITIALIZED;
    int i = 0;
    char s[32];
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    CUdeviceptr p = 0;
    size_t size = 0;
    void* host = nullptr;
    CUstream stream = nullptr;
    unsigned int u = 0;
    CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    void* data[] = {&u};
    CHILD_EXPECT_CU(c, kNo, cu.cuDeviceGetCount(&i));
    CHILD_EXPECT_CU(c, kNo, cu.cuDeviceGet(&dev, 0));
    CHILD_EXPECT_CU(c, kNo, cu.cuDeviceGetName(s, sizeof(s), 0));
    CHILD_EXPECT_CU(c, kNo, cu.cuDeviceGetPCIBusId(s, sizeof(s), 0));
    CHILD_EXPECT_CU(
        c, kNo, cu.cuDeviceGetAttribute(&i, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
    CHILD_EXPECT_CU(c, kNo, cu.cuDevicePrimaryCtxRetain(&ctx, 0));
    CHILD_EXPECT_CU(c, kNo, cu.cuDevicePrimaryCtxRelease(0));
    CHILD_EXPECT_CU(c, kNo, cu.cuCtxSetCurrent(nullptr));
    CHILD_EXPECT_CU(c, kNo, cu.cuCtxGetCurrent(&ctx));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemAlloc(&p, 4096));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemFree(p));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemGetAddressRange(&p, &size, p));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemHostAlloc(&host, 4096, 0));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemFreeHost(host));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemcpyHtoD(p, s, 1));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemcpyDtoH(s, p, 1));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemcpyDtoD(p, p, 1));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemcpyHtoDAsync(p, s, 1, nullptr));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemcpyDtoHAsync(s, p, 1, nullptr));
    CHILD_EXPECT_CU(c, kNo, cu.cuMemsetD8(p, 0, 1));
    CHILD_EXPECT_CU(c, kNo, cu.cuStreamCreate(&stream, 0));
    CHILD_EXPECT_CU(c, kNo, cu.cuStreamDestroy(stream));
    CHILD_EXPECT_CU(c, kNo, cu.cuStreamSynchronize(stream));
    CHILD_EXPECT_CU(c, kNo, cu.cuStreamQuery(stream));
    CHILD_EXPECT_CU(c, kNo, cu.cuPointerGetAttribute(&u, attr, p));
    CHILD_EXPECT_CU(c, kNo, cu.cuPointerGetAttributes(1, &attr, data, p));
    CHILD_EXPECT_CU(
        c, kNo,
        cu.cuPointerSetAttribute(&u, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p));
    CHILD_EXPECT_CU(c, kNo,
                    cu.cuMemGetHandleForAddressRange(
                        &i, p, 4096, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
    // These three work without a driver.
    const char* str = nullptr;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDriverGetVersion(&i));
    CHILD_EXPECT(c, i == 12040);
    CHILD_EXPECT_CU(c, CUDA_SUCCESS,
                    cu.cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &str));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS,
                    cu.cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &str));
    // Flags must be 0; a refused cuInit does not count as the first.
    CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_VALUE, cu.cuInit(1));
    CHILD_EXPECT_CU(c, kNo, cu.cuDeviceGetCount(&i));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, InitWith({}));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDeviceGetCount(&i));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuInit(0));
  };
  EXPECT_IN_FRESH_PROCESS(body);
}

TEST_F(SoftgpuFreshTest, DefaultIsOneDeviceOf4GiB) {
  auto body = [](Child& c) {
    const CudaApi& cu = Cuda();
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, InitWith({}));
    int count = 0;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDeviceGetCount(&count));
    CHILD_EXPECT(c, count == 1);
    CUcontext ctx = nullptr;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRetain(&ctx, 0));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuCtxSetCurrent(ctx));
    // Memory files are sparse: 4 GiB never touched costs nothing.
    CUdeviceptr all = 0;
    CUdeviceptr more = 0;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemAlloc(&all, size_t{4096} << 20));
    CHILD_EXPECT_CU(c, CUDA_ERROR_OUT_OF_MEMORY, cu.cuMemAlloc(&more, 1));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemFree(all));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemAlloc(&more, 1));
  };
  EXPECT_IN_FRESH_PROCESS(body);
}

TEST_F(SoftgpuFreshTest, ACountInventsDistinctPciAddresses) {
  auto body = [](Child& c) {
    const CudaApi& cu = Cuda();
    CHILD_EXPECT_CU(c, CUDA_SUCCESS,
                    InitWith({{"FERRY_SOFTGPU_DEVICES", "3"}}));
    int count = 0;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDeviceGetCount(&count));
    CHILD_EXPECT(c, count == 3);
    const char* kExpected[] = {"0000:01:00.0", "0000:02:00.0", "0000:03:00.0"};
    for (int d = 0; d < 3; ++d) {
      char id[16] = {};
      int bus = -1;
      CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDeviceGetPCIBusId(id, 16, d));
      CHILD_EXPECT(c, std::strcmp(id, kExpected[d]) == 0);
      CHILD_EXPECT_CU(
          c, CUDA_SUCCESS,
          cu.cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, d));
      CHILD_EXPECT(c, bus == d + 1);
    }
  };
  EXPECT_IN_FRESH_PROCESS(body);
}

TEST_F(SoftgpuFreshTest, NoDevicesIsNoDevice) {
  auto body = [](Child& c) {
    const CudaApi& cu = Cuda();
    CHILD_EXPECT_CU(c, CUDA_ERROR_NO_DEVICE,
                    InitWith({{"FERRY_SOFTGPU_DEVICES", "0"}}));
    // As NVIDIA's driver on a host without a GPU: every later call says
    // so, cuInit again included.
    int count = 0;
    CHILD_EXPECT_CU(c, CUDA_ERROR_NOT_INITIALIZED, cu.cuDeviceGetCount(&count));
    CHILD_EXPECT_CU(c, CUDA_ERROR_NO_DEVICE, cu.cuInit(0));
  };
  EXPECT_IN_FRESH_PROCESS(body);
}

TEST_F(SoftgpuFreshTest, AMalformedVariableFailsCuInitWithOneLineNamingIt) {
  const struct {
    const char* name;
    const char* value;
  } kCases[] = {
      {"FERRY_SOFTGPU_DEVICES", "two"},
      {"FERRY_SOFTGPU_DEVICES", "-1"},
      {"FERRY_SOFTGPU_DEVICES", "65"},
      {"FERRY_SOFTGPU_DEVICES", " 1"},
      {"FERRY_SOFTGPU_DEVICES", "0000:3b:00"},
      {"FERRY_SOFTGPU_DEVICES", "0000:3b:00.0,"},
      {"FERRY_SOFTGPU_DEVICES", "0000:3b:00.0,0000:3B:00.0"},
      {"FERRY_SOFTGPU_DEVICES", "0000:3b:20.0"},
      {"FERRY_SOFTGPU_DEVICES", "0000:3b:00.8"},
      {"FERRY_SOFTGPU_DEVICES", "0000:3g:00.0"},
      {"FERRY_SOFTGPU_MEMORY_MIB", "0"},
      {"FERRY_SOFTGPU_MEMORY_MIB", "-5"},
      {"FERRY_SOFTGPU_MEMORY_MIB", "4k"},
      {"FERRY_SOFTGPU_MEMORY_MIB", "1048577"},
      {"FERRY_SOFTGPU_MEMORY_MIB", "99999999999999999999999"},
      {"FERRY_SOFTGPU_DMABUF", "2"},
      {"FERRY_SOFTGPU_DMABUF", "no"},
      {"FERRY_SOFTGPU_COPY_DELAY_US", "-1"},
      {"FERRY_SOFTGPU_COPY_DELAY_US", "1.5"},
      {"FERRY_SOFTGPU_COPY_DELAY_US", "60000001"},
  };
  for (const auto& bad : kCases) {
    SCOPED_TRACE(std::string(bad.name) + "=" + bad.value);
    auto body = [&](Child& c) {
      const CudaApi& cu = Cuda();
      CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_VALUE,
                      InitWith({{bad.name, bad.value}}));
      // The failure sticks and nothing works, but nothing more is printed.
      CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_VALUE, cu.cuInit(0));
      int count = 0;
      CHILD_EXPECT_CU(c, CUDA_ERROR_NOT_INITIALIZED,
                      cu.cuDeviceGetCount(&count));
    };
    // Exactly one line, naming the variable and its value.
    EXPECT_EXIT(
        {
          Child child;
          body(child);
          _exit(child.failures() == 0 ? 0 : 1);
        },
        ::testing::ExitedWithCode(0),
        "^softgpu: cuInit: " + std::string(bad.name) + "='[^\n]*': [^\n]+\n$");
  }
}

// ---- Devices, errors, contexts ------------------------------------------

TEST_F(SoftgpuTest, DevicesHaveTheirNamesAndPciAddresses) {
  int count = 0;
  ASSERT_CU_OK(cu_.cuDeviceGetCount(&count));
  EXPECT_EQ(count, 2);
  const struct {
    const char* bus_id;  // upper case, as NVIDIA's driver writes it
    int domain, bus, device;
  } kDevices[] = {{"0000:3B:00.0", 0, 0x3b, 0},
                  {"0001:86:1F.0", 1, 0x86, 0x1f}};
  for (int d = 0; d < 2; ++d) {
    CUdevice dev = -1;
    ASSERT_CU_OK(cu_.cuDeviceGet(&dev, d));
    EXPECT_EQ(dev, d);
    char name[64];
    ASSERT_CU_OK(cu_.cuDeviceGetName(name, sizeof(name), dev));
    EXPECT_STREQ(name, "Ferry softgpu");
    char id[13];  // what CUDA documents as enough
    ASSERT_CU_OK(cu_.cuDeviceGetPCIBusId(id, sizeof(id), dev));
    EXPECT_STREQ(id, kDevices[d].bus_id);
    int v = -1;
    ASSERT_CU_OK(
        cu_.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, dev));
    EXPECT_EQ(v, kDevices[d].domain);
    ASSERT_CU_OK(
        cu_.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev));
    EXPECT_EQ(v, kDevices[d].bus);
    ASSERT_CU_OK(
        cu_.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, dev));
    EXPECT_EQ(v, kDevices[d].device);
    ASSERT_CU_OK(cu_.cuDeviceGetAttribute(
        &v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, dev));
    EXPECT_EQ(v, 1);
    ASSERT_CU_OK(cu_.cuDeviceGetAttribute(
        &v, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev));
    EXPECT_EQ(v, 1);
  }
  // A short buffer gets as much as fits, terminated.
  char shortname[6];
  ASSERT_CU_OK(cu_.cuDeviceGetName(shortname, sizeof(shortname), 0));
  EXPECT_STREQ(shortname, "Ferry");

  int version = 0;
  ASSERT_CU_OK(cu_.cuDriverGetVersion(&version));
  EXPECT_EQ(version, 12040);

  CUdevice dev = 0;
  int v = 0;
  char buf[16];
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cu_.cuDeviceGet(&dev, 2));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cu_.cuDeviceGet(&dev, -1));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cu_.cuDeviceGetName(buf, 16, 2));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cu_.cuDeviceGetPCIBusId(buf, 16, 2));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE,
            cu_.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 2));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuDeviceGetAttribute(&v, 1, 0));
  EXPECT_CU(
      CUDA_ERROR_INVALID_VALUE,
      cu_.cuDeviceGetAttribute(nullptr, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuDeviceGetName(nullptr, 16, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuDeviceGetPCIBusId(buf, 0, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuDeviceGetCount(nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuDeviceGet(nullptr, 0));
}

TEST_F(SoftgpuTest, EveryErrorHasANameAndAString) {
  const struct {
    CUresult code;
    const char* name;
  } kErrors[] = {
      {CUDA_SUCCESS, "CUDA_SUCCESS"},
      {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
      {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
      {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
      {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED"},
      {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"},
      {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
      {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
      {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
      {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
      {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
      {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
      {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
      {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"},
  };
  std::vector<std::string> texts;
  for (const auto& e : kErrors) {
    const char* name = nullptr;
    const char* text = nullptr;
    ASSERT_CU_OK(cu_.cuGetErrorName(e.code, &name));
    ASSERT_NE(name, nullptr);
    EXPECT_STREQ(name, e.name);
    ASSERT_CU_OK(cu_.cuGetErrorString(e.code, &text));
    ASSERT_NE(text, nullptr);
    EXPECT_GT(std::strlen(text), 0u);
    for (const std::string& t : texts) EXPECT_NE(t, text) << e.name;
    texts.push_back(text);
  }
  const char* text = nullptr;
  ASSERT_CU_OK(cu_.cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &text));
  EXPECT_STREQ(text, "out of memory");
  for (CUresult unknown : {5, 99, 202, 12345, -1}) {
    const char* s = "unchanged";
    EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuGetErrorName(unknown, &s));
    EXPECT_EQ(s, nullptr);
    s = "unchanged";
    EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuGetErrorString(unknown, &s));
    EXPECT_EQ(s, nullptr);
  }
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuGetErrorName(CUDA_SUCCESS, nullptr));
}

TEST_F(SoftgpuTest, TheCurrentContextIsPerThread) {
  CUcontext ctx = nullptr;
  ASSERT_CU_OK(cu_.cuCtxGetCurrent(&ctx));
  EXPECT_EQ(ctx, Gpu().contexts[0]);
  EXPECT_NE(Gpu().contexts[0], Gpu().contexts[1]);
  // Retaining again gives the same primary context.
  CUcontext again = nullptr;
  ASSERT_CU_OK(cu_.cuDevicePrimaryCtxRetain(&again, 1));
  EXPECT_EQ(again, Gpu().contexts[1]);
  ASSERT_CU_OK(cu_.cuDevicePrimaryCtxRelease(1));

  std::thread other([&] {
    CUcontext none = Gpu().contexts[1];
    EXPECT_CU(CUDA_SUCCESS, cu_.cuCtxGetCurrent(&none));
    EXPECT_EQ(none, nullptr);
    CUdeviceptr p = 0;
    void* host = nullptr;
    CUstream stream = nullptr;
    char byte = 0;
    EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT, cu_.cuMemAlloc(&p, 4096));
    EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT, cu_.cuMemHostAlloc(&host, 4096, 0));
    EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT, cu_.cuStreamCreate(&stream, 0));
    EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT, cu_.cuMemcpyHtoD(p, &byte, 1));
    // Setting device 1 here leaves the main thread on device 0.
    EXPECT_CU(CUDA_SUCCESS, cu_.cuCtxSetCurrent(Gpu().contexts[1]));
    ASSERT_CU_OK(cu_.cuMemAlloc(&p, 4096));
    int ordinal = -1;
    EXPECT_CU(CUDA_SUCCESS,
              cu_.cuPointerGetAttribute(
                  &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
    EXPECT_EQ(ordinal, 1);
    EXPECT_CU(CUDA_SUCCESS, cu_.cuMemFree(p));
  });
  other.join();
  ASSERT_CU_OK(cu_.cuCtxGetCurrent(&ctx));
  EXPECT_EQ(ctx, Gpu().contexts[0]);

  int not_a_context = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT,
            cu_.cuCtxSetCurrent(reinterpret_cast<CUcontext>(&not_a_context)));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuCtxGetCurrent(nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuDevicePrimaryCtxRetain(nullptr, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cu_.cuDevicePrimaryCtxRetain(&ctx, 2));
  EXPECT_CU(CUDA_ERROR_INVALID_DEVICE, cu_.cuDevicePrimaryCtxRelease(2));
  // No current context at all.
  ASSERT_CU_OK(cu_.cuCtxSetCurrent(nullptr));
  CUdeviceptr p = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT, cu_.cuMemAlloc(&p, 4096));
}

TEST_F(SoftgpuFreshTest, TheLastPrimaryContextReleaseResetsTheDevice) {
  auto body = [](Child& c) {
    const CudaApi& cu = Cuda();
    CHILD_EXPECT_CU(c, CUDA_SUCCESS,
                    InitWith({{"FERRY_SOFTGPU_DEVICES", "2"}}));
    CUcontext a = nullptr;
    CUcontext b = nullptr;
    CUcontext other = nullptr;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRetain(&a, 0));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRetain(&b, 0));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRetain(&other, 1));
    CHILD_EXPECT(c, a == b);
    CUdeviceptr on0 = 0;
    CUdeviceptr on1 = 0;
    void* pinned = nullptr;
    CUstream stream = nullptr;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuCtxSetCurrent(other));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemAlloc(&on1, 4096));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuCtxSetCurrent(a));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemAlloc(&on0, 4096));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemHostAlloc(&pinned, 4096, 0));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuStreamCreate(&stream, 0));

    // One reference left: nothing happens.
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRelease(0));
    CHILD_EXPECT(c, MemoryType(on0) == CU_MEMORYTYPE_DEVICE);
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuStreamQuery(stream));
    // The last: device 0's memory, pinned memory and streams are gone.
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRelease(0));
    CHILD_EXPECT(c, MemoryType(on0) == 0);
    CHILD_EXPECT(c, MemoryType(reinterpret_cast<CUdeviceptr>(pinned)) == 0);
    CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_VALUE, cu.cuMemFree(on0));
    CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_VALUE, cu.cuMemFreeHost(pinned));
    CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_HANDLE, cu.cuStreamQuery(stream));
    // The released context is still current here, but no longer usable.
    CUdeviceptr p = 0;
    CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_CONTEXT, cu.cuMemAlloc(&p, 4096));
    CHILD_EXPECT_CU(c, CUDA_ERROR_INVALID_CONTEXT,
                    cu.cuDevicePrimaryCtxRelease(0));
    // Device 1 is untouched.
    CHILD_EXPECT(c, MemoryType(on1) == CU_MEMORYTYPE_DEVICE);
    // Retained again: the same handle, working.
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRetain(&b, 0));
    CHILD_EXPECT(c, a == b);
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemAlloc(&p, 4096));
  };
  EXPECT_IN_FRESH_PROCESS(body);
}

// ---- Device memory --------------------------------------------------------

TEST_F(SoftgpuTest, CopiesRoundTripEveryByte) {
  UseDevice(1);
  // Not a whole number of pages, to catch rounding in the copies.
  const size_t n = 3 * PageSize() + 123;
  DeviceBuffer a(n);
  DeviceBuffer b(n);
  ASSERT_CU_OK(a.result());
  ASSERT_CU_OK(b.result());
  EXPECT_NE(a.ptr(), b.ptr());
  const std::vector<unsigned char> in = Pattern(n, 1);
  std::vector<unsigned char> out(n, 0);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(a.ptr(), in.data(), n));
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(out.data(), a.ptr(), n));
  EXPECT_EQ(FirstDifference(in.data(), out.data(), n), -1);

  // Device to device, at offsets into both.
  ASSERT_CU_OK(cu_.cuMemsetD8(b.ptr(), 0xee, n));
  ASSERT_CU_OK(cu_.cuMemcpyDtoD(b.ptr() + 7, a.ptr() + 100, n - 200));
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(out.data(), b.ptr(), n));
  for (size_t i = 0; i < n; ++i) {
    const unsigned char want = i >= 7 && i < 7 + n - 200 ? in[i + 93] : 0xee;
    ASSERT_EQ(out[i], want) << "byte " << i;
  }

  // A memset of a range in the middle leaves the rest.
  ASSERT_CU_OK(cu_.cuMemsetD8(a.ptr() + 4000, 0x42, 300));
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(out.data(), a.ptr(), n));
  for (size_t i = 0; i < n; ++i) {
    const unsigned char want = i >= 4000 && i < 4300 ? 0x42 : in[i];
    ASSERT_EQ(out[i], want) << "byte " << i;
  }

  // Overlapping ranges of one allocation copy as memmove does.
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(a.ptr(), in.data(), n));
  ASSERT_CU_OK(cu_.cuMemcpyDtoD(a.ptr() + 1, a.ptr(), n - 1));
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(out.data(), a.ptr(), n));
  EXPECT_EQ(out[0], in[0]);
  EXPECT_EQ(FirstDifference(out.data() + 1, in.data(), n - 1), -1);

  // Zero bytes is a successful no-op.
  EXPECT_CU(CUDA_SUCCESS, cu_.cuMemcpyHtoD(a.ptr(), in.data(), 0));
}

TEST_F(SoftgpuTest, CopiesOutsideOneLiveAllocationAreRefused) {
  const size_t n = 2 * PageSize();
  DeviceBuffer a(n);
  DeviceBuffer b(n);
  ASSERT_CU_OK(a.result());
  ASSERT_CU_OK(b.result());
  std::vector<unsigned char> host(4 * n, 0);
  const CUdeviceptr end = a.ptr() + n;
  const CUresult kBad = CUDA_ERROR_INVALID_VALUE;
  // Past the end, by one byte or more; before the start.
  EXPECT_CU(kBad, cu_.cuMemcpyHtoD(a.ptr(), host.data(), n + 1));
  EXPECT_CU(kBad, cu_.cuMemcpyHtoD(a.ptr() + 1, host.data(), n));
  EXPECT_CU(kBad, cu_.cuMemcpyDtoH(host.data(), end - 10, 11));
  EXPECT_CU(kBad, cu_.cuMemcpyDtoH(host.data(), a.ptr() - 1, 2));
  EXPECT_CU(kBad, cu_.cuMemcpyDtoD(b.ptr(), a.ptr() + 1, n));
  EXPECT_CU(kBad, cu_.cuMemcpyDtoD(b.ptr() + 1, a.ptr(), n));
  EXPECT_CU(kBad, cu_.cuMemsetD8(a.ptr() + n, 0, 1));
  EXPECT_CU(kBad, cu_.cuMemsetD8(a.ptr(), 0, n + 1));
  // A size that wraps around the address space.
  EXPECT_CU(kBad, cu_.cuMemcpyDtoH(host.data(), a.ptr() + 1, SIZE_MAX));
  // Exactly up to the end is fine.
  EXPECT_CU(CUDA_SUCCESS, cu_.cuMemcpyDtoH(host.data(), end - 10, 10));
  // Not device memory at all: a host pointer, null, freed memory.
  EXPECT_CU(kBad, cu_.cuMemcpyHtoD(reinterpret_cast<CUdeviceptr>(host.data()),
                                   host.data() + n, 1));
  EXPECT_CU(kBad, cu_.cuMemsetD8(0, 0, 1));
  DeviceBuffer freed(n);
  ASSERT_CU_OK(freed.result());
  ASSERT_CU_OK(freed.Free());
  EXPECT_CU(kBad, cu_.cuMemcpyHtoD(freed.ptr(), host.data(), 1));
  EXPECT_CU(kBad, cu_.cuMemcpyDtoH(host.data(), freed.ptr(), 1));
  EXPECT_CU(kBad, cu_.cuMemsetD8(freed.ptr(), 0, 1));
  // A "host" pointer that is device memory, or null.
  EXPECT_CU(kBad, cu_.cuMemcpyHtoD(a.ptr(),
                                   reinterpret_cast<const void*>(b.ptr()), 1));
  EXPECT_CU(kBad,
            cu_.cuMemcpyDtoH(reinterpret_cast<void*>(b.ptr() + 5), a.ptr(), 1));
  EXPECT_CU(kBad, cu_.cuMemcpyDtoH(nullptr, a.ptr(), 1));
  EXPECT_CU(kBad, cu_.cuMemcpyHtoD(a.ptr(), nullptr, 1));

  // Freeing: only a live allocation's base, once.
  EXPECT_CU(kBad, cu_.cuMemFree(a.ptr() + 1));
  EXPECT_CU(kBad, cu_.cuMemFree(reinterpret_cast<CUdeviceptr>(host.data())));
  EXPECT_CU(kBad, cu_.cuMemFree(freed.ptr()));
  EXPECT_CU(kBad, cu_.cuMemFree(0));
  EXPECT_CU(kBad, cu_.cuMemAlloc(nullptr, 1));
  CUdeviceptr p = 0;
  EXPECT_CU(kBad, cu_.cuMemAlloc(&p, 0));
}

TEST_F(SoftgpuTest, TheCpuCannotTouchDeviceMemory) {
  DeviceBuffer a(PageSize());
  ASSERT_CU_OK(a.result());
  ASSERT_CU_OK(cu_.cuMemsetD8(a.ptr(), 0x5a, PageSize()));
  auto* bytes = reinterpret_cast<volatile unsigned char*>(a.ptr());
  // SIG_DFL first: under ASan its own handler would report the fault and
  // abort instead.
  EXPECT_EXIT(
      {
        signal(SIGSEGV, SIG_DFL);
        std::fprintf(stderr, "read %d\n", bytes[0]);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  EXPECT_EXIT(
      {
        signal(SIGSEGV, SIG_DFL);
        bytes[PageSize() - 1] = 1;
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

TEST_F(SoftgpuTest, AddressRangeIsTheAllocation) {
  const size_t n = 5000;
  DeviceBuffer a(n);
  ASSERT_CU_OK(a.result());
  EXPECT_EQ(a.ptr() % PageSize(), 0u);
  for (CUdeviceptr p : {a.ptr(), a.ptr() + 1, a.ptr() + n - 1}) {
    CUdeviceptr base = 0;
    size_t size = 0;
    ASSERT_CU_OK(cu_.cuMemGetAddressRange(&base, &size, p));
    EXPECT_EQ(base, a.ptr());
    EXPECT_EQ(size, n);
  }
  // Either output may be left out.
  CUdeviceptr base = 0;
  ASSERT_CU_OK(cu_.cuMemGetAddressRange(&base, nullptr, a.ptr() + 9));
  EXPECT_EQ(base, a.ptr());
  CUdeviceptr unused = 0;
  size_t size = 0;
  EXPECT_CU(CUDA_ERROR_NOT_FOUND,
            cu_.cuMemGetAddressRange(&unused, &size, a.ptr() + n));
  int on_stack = 0;
  EXPECT_CU(CUDA_ERROR_NOT_FOUND,
            cu_.cuMemGetAddressRange(&unused, &size,
                                     reinterpret_cast<CUdeviceptr>(&on_stack)));
}

// IPC handles name an allocation of this process; opening one is for other
// processes (tests/gpu_engine_test GpuShmIpcTest does it, through the shm
// transport), never this one, as with NVIDIA's driver.
TEST_F(SoftgpuTest, IpcHandlesAreForOtherProcesses) {
  DeviceBuffer a(8192);
  ASSERT_CU_OK(a.result());
  CUipcMemHandle h;
  ASSERT_CU_OK(cu_.cuIpcGetMemHandle(&h, a.ptr() + 100));  // Any byte of it.
  CUdeviceptr p = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_CONTEXT,
            cu_.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuIpcOpenMemHandle(&p, h, 0x80));
  CUipcMemHandle garbage;
  std::memset(&garbage, 0x5a, sizeof(garbage));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuIpcOpenMemHandle(&p, garbage, 0));
  int on_stack = 0;
  EXPECT_CU(
      CUDA_ERROR_INVALID_VALUE,
      cu_.cuIpcGetMemHandle(&h, reinterpret_cast<CUdeviceptr>(&on_stack)));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuIpcCloseMemHandle(a.ptr()));
}

TEST_F(SoftgpuTest, AsyncDeviceToDeviceCopiesOnAStream) {
  const size_t n = 3 << 20;
  DeviceBuffer a(n), b(n);
  ASSERT_CU_OK(a.result());
  ASSERT_CU_OK(b.result());
  std::vector<uint8_t> host(n), back(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<uint8_t>(i * 7);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(a.ptr(), host.data(), n));
  CUstream s = nullptr;
  ASSERT_CU_OK(cu_.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  ASSERT_CU_OK(cu_.cuMemcpyDtoDAsync(b.ptr(), a.ptr(), n, s));
  ASSERT_CU_OK(cu_.cuStreamSynchronize(s));
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(back.data(), b.ptr(), n));
  EXPECT_EQ(back, host);
  ASSERT_CU_OK(cu_.cuStreamDestroy(s));
}

TEST_F(SoftgpuTest, OutOfMemoryIsPerDevice) {
  const size_t all = kMemoryMib << 20;
  DeviceBuffer whole(all);
  ASSERT_CU_OK(whole.result());
  CUdeviceptr p = 0;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cu_.cuMemAlloc(&p, 1));
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cu_.cuMemAlloc(&p, SIZE_MAX));
  UseDevice(1);
  {
    DeviceBuffer other(PageSize());
    EXPECT_CU(CUDA_SUCCESS, other.result());
  }
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cu_.cuMemAlloc(&p, all + 1));
  UseDevice(0);
  ASSERT_CU_OK(whole.Free());
  // Capacity is counted in pages: half of it plus a byte leaves less than
  // half.
  DeviceBuffer half(all / 2 + 1);
  ASSERT_CU_OK(half.result());
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cu_.cuMemAlloc(&p, all / 2));
  DeviceBuffer rest(all / 2 - PageSize());
  EXPECT_CU(CUDA_SUCCESS, rest.result());
  void* host = nullptr;
  EXPECT_CU(CUDA_ERROR_OUT_OF_MEMORY, cu_.cuMemHostAlloc(&host, SIZE_MAX, 0));
}

// ---- Pointer attributes ---------------------------------------------------

// Attribute `attribute` of `ptr` through cuPointerGetAttribute, checking
// that it writes exactly sizeof(T) bytes: read once over 0xaa and once
// over 0x55, the first sizeof(T) bytes must agree and the rest be
// untouched.
template <typename T>
T Attribute(CUpointer_attribute attribute, CUdeviceptr ptr) {
  unsigned char raw[2][32];
  const unsigned char kFill[2] = {0xaa, 0x55};
  for (int k = 0; k < 2; ++k) {
    std::memset(raw[k], kFill[k], sizeof(raw[k]));
    EXPECT_CU(CUDA_SUCCESS,
              Cuda().cuPointerGetAttribute(raw[k], attribute, ptr))
        << "attribute " << attribute;
    for (size_t i = sizeof(T); i < sizeof(raw[k]); ++i) {
      EXPECT_EQ(raw[k][i], kFill[k])
          << "attribute " << attribute << " wrote byte " << i;
    }
  }
  EXPECT_EQ(std::memcmp(raw[0], raw[1], sizeof(T)), 0)
      << "attribute " << attribute << " left some of its bytes unwritten";
  T value;
  std::memcpy(&value, raw[0], sizeof(value));
  return value;
}

using ULL =
    unsigned long long;  // NOLINT: CU_POINTER_ATTRIBUTE_BUFFER_ID's type

TEST_F(SoftgpuTest, PointerAttributesOfDeviceMemory) {
  UseDevice(1);
  const size_t n = 3 * PageSize();
  DeviceBuffer a(n);
  ASSERT_CU_OK(a.result());
  const CUdeviceptr p = a.ptr() + 1000;
  EXPECT_EQ(Attribute<unsigned int>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p),
            CU_MEMORYTYPE_DEVICE);
  EXPECT_EQ(Attribute<CUcontext>(CU_POINTER_ATTRIBUTE_CONTEXT, p),
            Gpu().contexts[1]);
  EXPECT_EQ(Attribute<CUdeviceptr>(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, p), p);
  EXPECT_EQ(Attribute<void*>(CU_POINTER_ATTRIBUTE_HOST_POINTER, p), nullptr);
  EXPECT_EQ(Attribute<unsigned int>(CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p), 0u);
  EXPECT_NE(Attribute<ULL>(CU_POINTER_ATTRIBUTE_BUFFER_ID, p), 0u);
  EXPECT_EQ(Attribute<unsigned int>(CU_POINTER_ATTRIBUTE_IS_MANAGED, p), 0u);
  EXPECT_EQ(Attribute<int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p), 1);
  EXPECT_EQ(Attribute<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p),
            a.ptr());
  EXPECT_EQ(Attribute<size_t>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, p), n);
  EXPECT_EQ(Attribute<unsigned int>(CU_POINTER_ATTRIBUTE_MAPPED, p), 1u);
  EXPECT_EQ(Attribute<unsigned int>(
                CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, p),
            1u);
  // The last byte belongs to it; the next does not.
  EXPECT_EQ(Attribute<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                   a.ptr() + n - 1),
            a.ptr());
  unsigned int type = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                      a.ptr() + n));

  // Several at once.
  unsigned int memory_type = 0;
  int ordinal = -1;
  size_t size = 0;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* data[] = {&memory_type, &ordinal, &size};
  ASSERT_CU_OK(cu_.cuPointerGetAttributes(3, attrs, data, p));
  EXPECT_EQ(memory_type, CU_MEMORYTYPE_DEVICE);
  EXPECT_EQ(ordinal, 1);
  EXPECT_EQ(size, n);

  // SYNC_MEMOPS is the one settable attribute, for the whole allocation.
  const unsigned int on = 1;
  ASSERT_CU_OK(cu_.cuPointerSetAttribute(&on, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                                         a.ptr() + 5));
  EXPECT_EQ(Attribute<unsigned int>(CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p), 1u);
  const unsigned int off = 0;
  ASSERT_CU_OK(
      cu_.cuPointerSetAttribute(&off, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p));
  EXPECT_EQ(Attribute<unsigned int>(CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p), 0u);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuPointerSetAttribute(&on, CU_POINTER_ATTRIBUTE_MAPPED, p));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuPointerSetAttribute(&on, CU_POINTER_ATTRIBUTE_BUFFER_ID, p));
  EXPECT_CU(
      CUDA_ERROR_INVALID_VALUE,
      cu_.cuPointerSetAttribute(nullptr, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, p));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuPointerSetAttribute(&on, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                                      a.ptr() + n));
  // An attribute outside the contract.
  ULL big = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuPointerGetAttribute(&big, 5, p));
  EXPECT_CU(
      CUDA_ERROR_INVALID_VALUE,
      cu_.cuPointerGetAttribute(nullptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p));
}

TEST_F(SoftgpuTest, PointerAttributesOfPinnedHostMemory) {
  UseDevice(1);
  const size_t n = PageSize() + 10;
  void* host = nullptr;
  ASSERT_CU_OK(cu_.cuMemHostAlloc(
      &host, n, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(host) % PageSize(), 0u);
  // Ordinary memory: the CPU reads and writes it.
  std::memset(host, 0x33, n);
  EXPECT_EQ(static_cast<unsigned char*>(host)[n - 1], 0x33);

  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(host) + 4;
  EXPECT_EQ(Attribute<unsigned int>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p),
            CU_MEMORYTYPE_HOST);
  EXPECT_EQ(Attribute<void*>(CU_POINTER_ATTRIBUTE_HOST_POINTER, p),
            reinterpret_cast<void*>(p));
  EXPECT_EQ(Attribute<CUdeviceptr>(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, p), p);
  EXPECT_EQ(Attribute<int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p), 1);
  EXPECT_EQ(Attribute<CUcontext>(CU_POINTER_ATTRIBUTE_CONTEXT, p),
            Gpu().contexts[1]);
  EXPECT_EQ(Attribute<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p),
            reinterpret_cast<CUdeviceptr>(host));
  EXPECT_EQ(Attribute<size_t>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, p), n);
  EXPECT_NE(Attribute<ULL>(CU_POINTER_ATTRIBUTE_BUFFER_ID, p), 0u);
  EXPECT_EQ(Attribute<unsigned int>(
                CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, p),
            0u);

  // Copies to and from it.
  DeviceBuffer d(n);
  ASSERT_CU_OK(d.result());
  const std::vector<unsigned char> in = Pattern(n, 3);
  std::memcpy(host, in.data(), n);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(d.ptr(), host, n));
  std::memset(host, 0, n);
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(host, d.ptr(), n));
  EXPECT_EQ(FirstDifference(static_cast<unsigned char*>(host), in.data(), n),
            -1);

  ASSERT_CU_OK(cu_.cuMemFreeHost(host));
  EXPECT_EQ(MemoryType(p), 0u);
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuMemFreeHost(host));
  int on_stack = 0;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuMemFreeHost(&on_stack));
  void* q = nullptr;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuMemHostAlloc(&q, 4096, 0x8));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuMemHostAlloc(&q, 0, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuMemHostAlloc(nullptr, 4096, 0));
}

// Every attribute of gpu/cuda_abi.h at once, each over a non-null value.
struct AllAttributes {
  CUcontext context = reinterpret_cast<CUcontext>(0x1);
  unsigned int memory_type = 77;
  CUdeviceptr device_pointer = 77;
  void* host_pointer = reinterpret_cast<void*>(0x1);
  unsigned int sync_memops = 77;
  ULL buffer_id = 77;
  unsigned int is_managed = 77;
  int device_ordinal = 77;
  CUdeviceptr range_start = 77;
  size_t range_size = 77;
  unsigned int mapped = 77;
  unsigned int rdma = 77;

  CUresult Query(CUdeviceptr ptr) {
    CUpointer_attribute attrs[] = {
        CU_POINTER_ATTRIBUTE_CONTEXT,
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
        CU_POINTER_ATTRIBUTE_HOST_POINTER,
        CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
        CU_POINTER_ATTRIBUTE_BUFFER_ID,
        CU_POINTER_ATTRIBUTE_IS_MANAGED,
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        CU_POINTER_ATTRIBUTE_MAPPED,
        CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
    };
    void* data[] = {&context,      &memory_type,    &device_pointer,
                    &host_pointer, &sync_memops,    &buffer_id,
                    &is_managed,   &device_ordinal, &range_start,
                    &range_size,   &mapped,         &rdma};
    static_assert(sizeof(attrs) / sizeof(attrs[0]) ==
                  sizeof(data) / sizeof(data[0]));
    return Cuda().cuPointerGetAttributes(sizeof(attrs) / sizeof(attrs[0]),
                                         attrs, data, ptr);
  }
  void ExpectUnknown() const {
    EXPECT_EQ(context, nullptr);
    EXPECT_EQ(memory_type, 0u);
    EXPECT_EQ(device_pointer, 0u);
    EXPECT_EQ(host_pointer, nullptr);
    EXPECT_EQ(sync_memops, 0u);
    EXPECT_EQ(buffer_id, 0u);
    EXPECT_EQ(is_managed, 0u);
    EXPECT_EQ(device_ordinal, -2);  // CUDA's "no device"
    EXPECT_EQ(range_start, 0u);
    EXPECT_EQ(range_size, 0u);
    EXPECT_EQ(mapped, 0u);
    EXPECT_EQ(rdma, 0u);
  }
};

TEST_F(SoftgpuTest, UnknownPointersHaveNullAttributes) {
  int on_stack = 0;
  std::vector<char> on_heap(100);
  DeviceBuffer freed(PageSize());
  ASSERT_CU_OK(freed.result());
  {
    AllAttributes live;
    ASSERT_CU_OK(live.Query(freed.ptr()));
    EXPECT_EQ(live.memory_type, CU_MEMORYTYPE_DEVICE);
    EXPECT_EQ(live.device_ordinal, 0);
    EXPECT_EQ(live.context, Gpu().contexts[0]);
  }
  ASSERT_CU_OK(freed.Free());
  for (CUdeviceptr p : {reinterpret_cast<CUdeviceptr>(&on_stack),
                        reinterpret_cast<CUdeviceptr>(on_heap.data()),
                        CUdeviceptr{0}, freed.ptr()}) {
    SCOPED_TRACE(p);
    AllAttributes a;
    // The query succeeds: this is how Ferry tells plain host memory.
    ASSERT_CU_OK(a.Query(p));
    a.ExpectUnknown();
    unsigned int type = 0;
    EXPECT_CU(
        CUDA_ERROR_INVALID_VALUE,
        cu_.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p));
  }
  // One bad attribute fails the query and writes nothing.
  unsigned int type = 77;
  ULL tokens = 77;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                 5 /* P2P_TOKENS: not in the contract */};
  void* data[] = {&type, &tokens};
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuPointerGetAttributes(
                2, attrs, data, reinterpret_cast<CUdeviceptr>(&on_stack)));
  EXPECT_EQ(type, 77u);
  void* no_data[] = {&type, nullptr};
  attrs[1] = CU_POINTER_ATTRIBUTE_MAPPED;
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuPointerGetAttributes(2, attrs, no_data, 0));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuPointerGetAttributes(0, attrs, data, 0));
}

TEST_F(SoftgpuTest, BufferIdsAreNeverReused) {
  // Freed and allocated again at the same size, an address comes back (as
  // on NVIDIA's driver); its id never does: that is what the id is for.
  ULL last = 0;
  CUdeviceptr first = 0;
  for (int i = 0; i < 20; ++i) {
    DeviceBuffer a(PageSize());
    ASSERT_CU_OK(a.result());
    if (i == 0) first = a.ptr();
    EXPECT_EQ(a.ptr(), first) << i;
    const ULL id = Attribute<ULL>(CU_POINTER_ATTRIBUTE_BUFFER_ID, a.ptr());
    EXPECT_GT(id, last);
    last = id;
  }
  void* host = nullptr;
  ASSERT_CU_OK(cu_.cuMemHostAlloc(&host, 1, 0));
  EXPECT_GT(Attribute<ULL>(CU_POINTER_ATTRIBUTE_BUFFER_ID,
                           reinterpret_cast<CUdeviceptr>(host)),
            last);
  ASSERT_CU_OK(cu_.cuMemFreeHost(host));
}

// ---- dma-buf ------------------------------------------------------------

// The dma-buf of [ptr, ptr + size), or -1.
int ExportDmabuf(CUdeviceptr ptr, size_t size) {
  int fd = -1;
  EXPECT_CU(CUDA_SUCCESS,
            Cuda().cuMemGetHandleForAddressRange(
                &fd, ptr, size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
  return fd;
}

// Maps `length` bytes of dma-buf `fd` from its byte 0, by dmabuf.h's
// convention (the file position is the dma-buf's byte 0).
unsigned char* MapDmabuf(int fd, size_t length) {
  const off_t position = lseek(fd, 0, SEEK_CUR);
  EXPECT_EQ(position % static_cast<off_t>(PageSize()), 0);
  void* p =
      mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, position);
  EXPECT_NE(p, MAP_FAILED) << std::strerror(errno);
  return p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
}

TEST_F(SoftgpuTest, DmabufOfAWholeAllocationIsItsMemory) {
  const size_t n = 4 * PageSize();
  DeviceBuffer a(n);
  ASSERT_CU_OK(a.result());
  const std::vector<unsigned char> in = Pattern(n, 5);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(a.ptr(), in.data(), n));
  const int fd = ExportDmabuf(a.ptr(), n);
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(IsSoftgpuDmabuf(fd));
  uint64_t base = 99;
  uint64_t size = 0;
  ASSERT_TRUE(DmabufRange(fd, &base, &size));
  EXPECT_EQ(base, 0u);
  EXPECT_EQ(size, n);
  EXPECT_EQ(fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);

  unsigned char* m = MapDmabuf(fd, n);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(FirstDifference(m, in.data(), n), -1);
  // A write through the mapping (a NIC's DMA) is the device's memory.
  std::memset(m + PageSize(), 0x77, 10);
  std::vector<unsigned char> out(n);
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(out.data(), a.ptr(), n));
  for (size_t i = 0; i < n; ++i) {
    const unsigned char want =
        i >= PageSize() && i < PageSize() + 10 ? 0x77 : in[i];
    ASSERT_EQ(out[i], want) << "byte " << i;
  }

  // cuMemFree leaves the memory to the dma-buf, as a real one holds it.
  ASSERT_CU_OK(a.Free());
  EXPECT_EQ(m[0], in[0]);
  m[1] = 0x99;
  munmap(m, n);
  unsigned char* again = MapDmabuf(fd, n);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again[1], 0x99);
  EXPECT_EQ(again[n - 1], in[n - 1]);
  munmap(again, n);
  close(fd);
}

TEST_F(SoftgpuTest, DmabufOfAPageAlignedSubrange) {
  const size_t page = PageSize();
  const size_t n = 8 * page;
  DeviceBuffer a(n);
  ASSERT_CU_OK(a.result());
  const std::vector<unsigned char> in = Pattern(n, 7);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(a.ptr(), in.data(), n));
  const int fd = ExportDmabuf(a.ptr() + 2 * page, 3 * page);
  ASSERT_GE(fd, 0);
  uint64_t base = 0;
  uint64_t size = 0;
  ASSERT_TRUE(DmabufRange(fd, &base, &size));
  EXPECT_EQ(base, 2 * page);
  // An upper bound: the allocation's end (dmabuf.h says why).
  EXPECT_EQ(size, 6 * page);
  // Reading the range does not move the position.
  ASSERT_TRUE(DmabufRange(fd, &base, &size));
  EXPECT_EQ(base, 2 * page);

  unsigned char* m = MapDmabuf(fd, 3 * page);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(FirstDifference(m, in.data() + 2 * page, 3 * page), -1);
  m[0] = static_cast<unsigned char>(~in[2 * page]);
  unsigned char byte = 0;
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(&byte, a.ptr() + 2 * page, 1));
  EXPECT_EQ(byte, m[0]);
  munmap(m, 3 * page);
  close(fd);

  // A dma-buf is whole pages: the last page of a 5000-byte allocation can
  // be exported whole.
  DeviceBuffer odd(5000);
  ASSERT_CU_OK(odd.result());
  const int tail = ExportDmabuf(odd.ptr() + page, page);
  EXPECT_GE(tail, 0);
  close(tail);
}

TEST_F(SoftgpuTest, DmabufArgumentsAreChecked) {
  const size_t page = PageSize();
  DeviceBuffer a(4 * page);
  ASSERT_CU_OK(a.result());
  const CUresult kBad = CUDA_ERROR_INVALID_VALUE;
  const int kFd = CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
  int fd = -1;
  EXPECT_CU(kBad,
            cu_.cuMemGetHandleForAddressRange(&fd, a.ptr() + 1, page, kFd, 0));
  EXPECT_CU(kBad,
            cu_.cuMemGetHandleForAddressRange(&fd, a.ptr(), page + 1, kFd, 0));
  EXPECT_CU(kBad, cu_.cuMemGetHandleForAddressRange(&fd, a.ptr(), 0, kFd, 0));
  EXPECT_CU(kBad, cu_.cuMemGetHandleForAddressRange(&fd, a.ptr() + page,
                                                    4 * page, kFd, 0));
  EXPECT_CU(kBad, cu_.cuMemGetHandleForAddressRange(&fd, a.ptr() + 4 * page,
                                                    page, kFd, 0));
  EXPECT_CU(kBad,
            cu_.cuMemGetHandleForAddressRange(&fd, a.ptr(), page, kFd, 1));
  EXPECT_CU(kBad, cu_.cuMemGetHandleForAddressRange(&fd, a.ptr(), page, 2, 0));
  EXPECT_CU(kBad,
            cu_.cuMemGetHandleForAddressRange(nullptr, a.ptr(), page, kFd, 0));
  void* host = nullptr;
  ASSERT_CU_OK(cu_.cuMemHostAlloc(&host, page, 0));
  EXPECT_CU(kBad, cu_.cuMemGetHandleForAddressRange(
                      &fd, reinterpret_cast<CUdeviceptr>(host), page, kFd, 0));
  ASSERT_CU_OK(cu_.cuMemFreeHost(host));
  EXPECT_EQ(fd, -1);

  // Only softgpu's dma-bufs are recognised.
  int other = memfd_create("not-softgpu", MFD_CLOEXEC);
  ASSERT_GE(other, 0);
  uint64_t base = 7;
  uint64_t size = 7;
  EXPECT_FALSE(IsSoftgpuDmabuf(other));
  EXPECT_FALSE(DmabufRange(other, &base, &size));
  EXPECT_EQ(base, 7u);
  close(other);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  EXPECT_FALSE(IsSoftgpuDmabuf(pipe_fds[0]));
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  EXPECT_FALSE(IsSoftgpuDmabuf(-1));
}

TEST_F(SoftgpuFreshTest, WithoutDmabufSupportExportIsNotSupported) {
  auto body = [](Child& c) {
    const CudaApi& cu = Cuda();
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, InitWith({{"FERRY_SOFTGPU_DMABUF", "0"}}));
    int v = -1;
    CHILD_EXPECT_CU(
        c, CUDA_SUCCESS,
        cu.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, 0));
    CHILD_EXPECT(c, v == 0);
    CHILD_EXPECT_CU(c, CUDA_SUCCESS,
                    cu.cuDeviceGetAttribute(
                        &v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, 0));
    CHILD_EXPECT(c, v == 1);
    CUcontext ctx = nullptr;
    CUdeviceptr p = 0;
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuDevicePrimaryCtxRetain(&ctx, 0));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuCtxSetCurrent(ctx));
    CHILD_EXPECT_CU(c, CUDA_SUCCESS, cu.cuMemAlloc(&p, 2 * PageSize()));
    int fd = -1;
    CHILD_EXPECT_CU(
        c, CUDA_ERROR_NOT_SUPPORTED,
        cu.cuMemGetHandleForAddressRange(
            &fd, p, PageSize(), CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
    CHILD_EXPECT(c, fd == -1);
  };
  EXPECT_IN_FRESH_PROCESS(body);
}

// ---- Streams (without a copy delay: stream_test.cc has those) -------------

TEST_F(SoftgpuTest, StreamsCopyAndAreCheckedAtEnqueue) {
  CUstream s = nullptr;
  ASSERT_CU_OK(cu_.cuStreamCreate(&s, CU_STREAM_DEFAULT));
  CUstream nb = nullptr;
  ASSERT_CU_OK(cu_.cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
  EXPECT_NE(s, nb);
  const size_t n = 10000;
  DeviceBuffer a(n);
  ASSERT_CU_OK(a.result());
  const std::vector<unsigned char> in = Pattern(n, 9);
  std::vector<unsigned char> out(n, 0);
  // And the legacy stream under its three handles: NULL, CUDA's
  // CU_STREAM_LEGACY and CU_STREAM_PER_THREAD (cuda.h's values).
  const CUstream kLegacy = reinterpret_cast<CUstream>(0x1);
  const CUstream kPerThread = reinterpret_cast<CUstream>(0x2);
  for (CUstream stream :
       {s, nb, static_cast<CUstream>(nullptr), kLegacy, kPerThread}) {
    std::fill(out.begin(), out.end(), 0);
    ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(a.ptr(), in.data(), n, stream));
    ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(out.data(), a.ptr(), n, stream));
    ASSERT_CU_OK(cu_.cuStreamSynchronize(stream));
    EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(stream));
    EXPECT_EQ(FirstDifference(out.data(), in.data(), n), -1);
    // Bounds are checked when the copy is queued.
    EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
              cu_.cuMemcpyHtoDAsync(a.ptr() + 1, in.data(), n, stream));
    EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
              cu_.cuMemcpyDtoHAsync(out.data(), a.ptr() + n, 1, stream));
    EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
              cu_.cuMemcpyDtoHAsync(reinterpret_cast<void*>(a.ptr()), a.ptr(),
                                    1, stream));
  }
  ASSERT_CU_OK(cu_.cuStreamDestroy(s));
  // A destroyed stream's handle is refused, not mistaken for another.
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamQuery(s));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamSynchronize(s));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamDestroy(s));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE,
            cu_.cuMemcpyHtoDAsync(a.ptr(), in.data(), 1, s));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE,
            cu_.cuStreamQuery(reinterpret_cast<CUstream>(0x1234)));
  // The legacy stream is the driver's.
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamDestroy(nullptr));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamDestroy(kLegacy));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamDestroy(kPerThread));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(kLegacy));
  ASSERT_CU_OK(cu_.cuStreamDestroy(nb));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuStreamCreate(&s, 0x2));
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE, cu_.cuStreamCreate(nullptr, 0));
}

// ---- Threads --------------------------------------------------------------

TEST_F(SoftgpuTest, ThreadsAllocateAndCopyConcurrently) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 25;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t] {
      const int dev = t % 2;
      ASSERT_CU_OK(cu_.cuCtxSetCurrent(Gpu().contexts[dev]));
      CUstream stream = nullptr;
      ASSERT_CU_OK(cu_.cuStreamCreate(&stream, 0));
      for (int r = 0; r < kRounds; ++r) {
        const size_t n = 1 + (t * 7919 + r * 104729) % (64 * 1024);
        DeviceBuffer a(n);
        DeviceBuffer b(n);
        ASSERT_CU_OK(a.result());
        ASSERT_CU_OK(b.result());
        const std::vector<unsigned char> in = Pattern(n, t * 100 + r);
        std::vector<unsigned char> out(n, 0);
        ASSERT_CU_OK(cu_.cuMemcpyHtoD(a.ptr(), in.data(), n));
        ASSERT_CU_OK(cu_.cuMemcpyDtoD(b.ptr(), a.ptr(), n));
        ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(out.data(), b.ptr(), n, stream));
        ASSERT_CU_OK(cu_.cuStreamSynchronize(stream));
        ASSERT_EQ(FirstDifference(out.data(), in.data(), n), -1)
            << "thread " << t << " round " << r;
        int ordinal = -1;
        ASSERT_CU_OK(cu_.cuPointerGetAttribute(
            &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, b.ptr() + n - 1));
        EXPECT_EQ(ordinal, dev);
        void* pinned = nullptr;
        ASSERT_CU_OK(cu_.cuMemHostAlloc(&pinned, n, 0));
        ASSERT_CU_OK(cu_.cuMemFreeHost(pinned));
      }
      ASSERT_CU_OK(cu_.cuStreamDestroy(stream));
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace
}  // namespace softgpu
