// CudaDriver against softgpu, the emulated driver: loading (and what
// happens where there is none), pointer classification, errors.
#include "gpu/cuda_driver.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::gpu {
namespace {

std::string g_library;  // softgpu's libcuda.so.1 (argv[1])
bool g_no_dmabuf = false;

const CudaDriver& Driver() {
  static const CudaDriver* driver = [] {
    auto d = CudaDriver::Load(g_library);
    if (!d.ok()) {
      std::fprintf(stderr, "loading %s: %s\n", g_library.c_str(),
                   d.status().ToString().c_str());
      std::abort();
    }
    return d->release();
  }();
  return *driver;
}

TEST(CudaDriverTest, NoDriverIsNotFoundAndSaysWhatToDo) {
  auto d = CudaDriver::Load("/nonexistent/libcuda.so.1");
  EXPECT_STATUS(d, absl::StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("no CUDA driver"), std::string::npos)
      << d.status();
  EXPECT_NE(d.status().message().find("softgpu"), std::string::npos)
      << d.status();
}

TEST(CudaDriverTest, ALibraryThatIsNoDriverIsRefusedByName) {
  auto d = CudaDriver::Load("libm.so.6");
  EXPECT_STATUS(d, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(d.status().message().find("has no cuInit"), std::string::npos)
      << d.status();
}

TEST(CudaDriverTest, DevicesAndTheirPciAddresses) {
  const CudaDriver& d = Driver();
  EXPECT_EQ(d.device_count(), 2);
  EXPECT_GE(d.version(), 11070);
  ASSERT_OK_AND_ASSIGN(std::string bus0, d.PciBusId(0));
  EXPECT_EQ(bus0, "0000:3b:00.0");  // lower case, as sysfs names it
  ASSERT_OK_AND_ASSIGN(std::string bus1, d.PciBusId(1));
  EXPECT_EQ(bus1, "0000:af:00.0");
  ASSERT_OK_AND_ASSIGN(std::string name, d.DeviceName(0));
  EXPECT_FALSE(name.empty());
  EXPECT_STATUS(d.UseDevice(2), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(d.PciBusId(7), absl::StatusCode::kInvalidArgument);
}

TEST(CudaDriverTest, ClassifiesHostPinnedAndDeviceMemory) {
  const CudaDriver& d = Driver();
  std::vector<char> pageable(4096);
  ASSERT_OK_AND_ASSIGN(PointerInfo host, d.Classify(pageable.data()));
  EXPECT_EQ(host.kind, PointerInfo::Kind::kHost);

  ASSERT_OK(d.UseDevice(1));
  CUdeviceptr dev = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev, 1 << 20), "cuMemAlloc"));
  ASSERT_OK_AND_ASSIGN(PointerInfo in,
                       d.Classify(reinterpret_cast<void*>(dev + 4096)));
  EXPECT_EQ(in.kind, PointerInfo::Kind::kDevice);
  EXPECT_EQ(in.device, 1);
  EXPECT_EQ(in.range_start, dev);
  EXPECT_EQ(in.range_size, size_t{1} << 20);
  EXPECT_NE(in.buffer_id, 0u);

  void* pinned = nullptr;
  ASSERT_OK(
      d.Check(d.api().cuMemHostAlloc(&pinned, 8192, 0), "cuMemHostAlloc"));
  ASSERT_OK_AND_ASSIGN(PointerInfo p, d.Classify(pinned));
  EXPECT_EQ(p.kind, PointerInfo::Kind::kPinnedHost);
  ASSERT_OK(d.Check(d.api().cuMemFreeHost(pinned), "cuMemFreeHost"));

  // Freed device memory is no longer the driver's.
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
  ASSERT_OK_AND_ASSIGN(PointerInfo gone,
                       d.Classify(reinterpret_cast<void*>(dev)));
  EXPECT_EQ(gone.kind, PointerInfo::Kind::kHost);
}

TEST(CudaDriverTest, CopiesRoundTripEveryByte) {
  const CudaDriver& d = Driver();
  ASSERT_OK(d.UseDevice(0));
  constexpr size_t kBytes = 3 << 20;
  CUdeviceptr dev = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev, kBytes), "cuMemAlloc"));
  std::vector<unsigned char> in(kBytes), out(kBytes, 0);
  for (size_t i = 0; i < kBytes; ++i)
    in[i] = static_cast<unsigned char>(i * 7 + 3);
  ASSERT_OK(d.CopyToDevice(dev, in.data(), kBytes));
  ASSERT_OK(d.CopyFromDevice(out.data(), dev, kBytes));
  EXPECT_EQ(in, out);
  ASSERT_OK(d.SetSyncMemops(dev));
  // Past the allocation's end: the driver's error, named.
  absl::Status over = d.CopyFromDevice(out.data(), dev + 4096, kBytes);
  EXPECT_STATUS(over, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.message().find("cuMemcpyDtoH: CUDA_ERROR_INVALID_VALUE"),
            std::string::npos)
      << over;
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
}

TEST(CudaDriverTest, DmaBufExportOrWhyNot) {
  const CudaDriver& d = Driver();
  ASSERT_OK(d.UseDevice(0));
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  CUdeviceptr dev = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev, 4 * page), "cuMemAlloc"));
  EXPECT_STATUS(d.DmaBufFd(dev + 1, page), absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(bool supported, d.DmaBufSupported(0));
  EXPECT_EQ(supported, !g_no_dmabuf);
  auto fd = d.DmaBufFd(dev + page, 2 * page);
  if (g_no_dmabuf) {
    EXPECT_STATUS(fd, absl::StatusCode::kUnimplemented);
    EXPECT_NE(fd.status().message().find("nvidia-peermem"), std::string::npos)
        << fd.status();
  } else {
    ASSERT_OK(fd.status());
    EXPECT_GE(*fd, 0);
    close(*fd);
  }
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
}

}  // namespace
}  // namespace ferry::gpu

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s LIBCUDA [--no_dmabuf]\n", argv[0]);
    return 2;
  }
  ferry::gpu::g_library = argv[1];
  ferry::gpu::g_no_dmabuf =
      argc > 2 && std::strcmp(argv[2], "--no_dmabuf") == 0;
  // Read by softgpu at cuInit, before the first test loads it.
  setenv("FERRY_SOFTGPU_DEVICES", "0000:3B:00.0,0000:AF:00.0", 1);
  if (ferry::gpu::g_no_dmabuf) setenv("FERRY_SOFTGPU_DMABUF", "0", 1);
  return RUN_ALL_TESTS();
}
