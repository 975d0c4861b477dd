// softgpu's streams with FERRY_SOFTGPU_COPY_DELAY_US set, as CI sets it to
// make a missing synchronisation visible: an asynchronous copy has not run
// until its stream is synchronised; a stream runs its copies in order;
// synchronous copies wait for the legacy stream first, and those CUDA lets
// return early do, unless the memory has SYNC_MEMOPS.
//
// Work is seen pending by holding the streams (softgpu_control.h), never
// by racing the delay: a test holds, enqueues, looks, releases. So no
// result depends on how fast this thread runs.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gpu/cuda_abi.h"
#include "gpu/softgpu/softgpu_control.h"
#include "gpu/softgpu/test_driver.h"
#include "gtest/gtest.h"

namespace softgpu {
namespace {

// Each asynchronous copy waits this long before it runs: short, since no
// check relies on it (only a lower bound on the time a synchronisation
// takes is checked), so that without the hold the copies would run.
constexpr auto kDelay = std::chrono::milliseconds(1);
// How long work left to run in the background may take at most.
constexpr auto kLongWait = std::chrono::seconds(30);

std::vector<unsigned char> Bytes(size_t n, unsigned char value) {
  return std::vector<unsigned char>(n, value);
}

class StreamTest : public ::testing::Test {
 protected:
  static constexpr size_t kBytes = 64 * 1024;

  static void SetUpTestSuite() {
    const std::string delay_us = std::to_string(
        std::chrono::duration_cast<std::chrono::microseconds>(kDelay).count());
    ASSERT_EQ(
        Name(InitWith({{"FERRY_SOFTGPU_COPY_DELAY_US", delay_us.c_str()}})),
        Name(CUDA_SUCCESS));
    ASSERT_CU_OK(Cuda().cuDevicePrimaryCtxRetain(&context_, 0));
  }

  void SetUp() override {
    ASSERT_CU_OK(cu_.cuCtxSetCurrent(context_));
    ASSERT_CU_OK(cu_.cuMemAlloc(&dev_, kBytes));
    // A memset may return before it ran (SynchronousCallsAreAsynchronous):
    // done before any test holds the streams.
    ASSERT_CU_OK(cu_.cuMemsetD8(dev_, 0, kBytes));
    ASSERT_CU_OK(cu_.cuStreamSynchronize(nullptr));
    ASSERT_CU_OK(cu_.cuStreamCreate(&stream_, 0));
  }

  void TearDown() override {
    // A test that failed while holding must not hang the rest.
    Release();
    if (stream_ != nullptr) {
      EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamDestroy(stream_));
    }
    if (dev_ != 0) {
      EXPECT_CU(CUDA_SUCCESS, cu_.cuMemFree(dev_));
    }
  }

  // The device bytes now, by a synchronous copy (which waits for the
  // legacy stream only, not for stream_).
  std::vector<unsigned char> DeviceBytes() {
    std::vector<unsigned char> out(kBytes, 0xff);
    EXPECT_CU(CUDA_SUCCESS, cu_.cuMemcpyDtoH(out.data(), dev_, kBytes));
    return out;
  }

  // The bytes of device allocation `dptr` (kBytes long) now, read through
  // a dma-buf export: behind the driver's back, so without waiting for
  // any stream, held or not.
  static std::vector<unsigned char> Peek(CUdeviceptr dptr) {
    std::vector<unsigned char> out(kBytes, 0xff);
    int fd = -1;
    EXPECT_CU(CUDA_SUCCESS,
              Cuda().cuMemGetHandleForAddressRange(
                  &fd, dptr, kBytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
    if (fd < 0) return out;
    // Position 0: the whole allocation (dmabuf.h).
    void* m = mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd, 0);
    EXPECT_NE(m, MAP_FAILED);
    if (m != MAP_FAILED) {
      std::memcpy(out.data(), m, kBytes);
      munmap(m, kBytes);
    }
    close(fd);
    return out;
  }

  static void Hold() { ASSERT_EQ(HoldStreams(true), 0); }
  static void Release() { ASSERT_EQ(HoldStreams(false), 0); }

  static inline CUcontext context_ = nullptr;
  const CudaApi& cu_ = Cuda();
  CUdeviceptr dev_ = 0;
  CUstream stream_ = nullptr;
};

TEST_F(StreamTest, AsyncCopiesCompleteOnlyAfterSynchronize) {
  const auto in = Bytes(kBytes, 0xa1);
  auto out = Bytes(kBytes, 0);
  Hold();
  const auto start = std::chrono::steady_clock::now();
  // Both calls return while the stream is held (they would hang if they
  // waited for the copies), with nothing copied yet.
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, in.data(), kBytes, stream_));
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(out.data(), dev_, kBytes, stream_));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(stream_));
  EXPECT_EQ(out, Bytes(kBytes, 0));
  EXPECT_EQ(DeviceBytes(), Bytes(kBytes, 0));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(stream_));

  Release();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(stream_));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(stream_));
  EXPECT_EQ(out, in);
  EXPECT_EQ(DeviceBytes(), in);
  // The delay ran before each copy.
  EXPECT_GE(std::chrono::steady_clock::now() - start, 2 * kDelay);
}

TEST_F(StreamTest, HeldWorkStaysQueued) {
  const auto in = Bytes(kBytes, 0x77);
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, in.data(), kBytes, stream_));
  // Far longer than the delay: a hold that did not hold would show. (A
  // slow machine could only hide that, never fail a working hold.)
  std::this_thread::sleep_for(100 * kDelay);
  EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(stream_));
  EXPECT_EQ(DeviceBytes(), Bytes(kBytes, 0));
  Release();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(stream_));
  EXPECT_EQ(DeviceBytes(), in);
}

TEST_F(StreamTest, AStreamRunsItsCopiesInOrder) {
  const auto a = Bytes(kBytes, 0xaa);
  const auto b = Bytes(kBytes, 0xbb);
  auto first = Bytes(kBytes, 0);
  auto second = Bytes(kBytes, 0);
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, a.data(), kBytes, stream_));
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(first.data(), dev_, kBytes, stream_));
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, b.data(), kBytes, stream_));
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(second.data(), dev_, kBytes, stream_));
  ASSERT_CU_OK(cu_.cuStreamSynchronize(stream_));
  EXPECT_EQ(first, a);
  EXPECT_EQ(second, b);
}

TEST_F(StreamTest, SynchronousCopiesWaitForTheLegacyStream) {
  const auto a = Bytes(kBytes, 0x0a);
  const auto b = Bytes(kBytes, 0x0b);
  auto out = Bytes(kBytes, 0);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(dev_, a.data(), kBytes));
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(out.data(), dev_, kBytes, nullptr));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(nullptr));
  // The copy of `b` must not overwrite `a` before the queued read of it:
  // from another thread, since it may wait for the held stream.
  std::thread writer([&] {
    ASSERT_CU_OK(cu_.cuCtxSetCurrent(context_));
    EXPECT_CU(CUDA_SUCCESS, cu_.cuMemcpyHtoD(dev_, b.data(), kBytes));
  });
  EXPECT_EQ(out, Bytes(kBytes, 0));
  Release();
  writer.join();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(nullptr));
  EXPECT_EQ(out, a);
  EXPECT_EQ(DeviceBytes(), b);

  // So must a memset.
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(out.data(), dev_, kBytes, nullptr));
  std::thread setter([&] {
    ASSERT_CU_OK(cu_.cuCtxSetCurrent(context_));
    EXPECT_CU(CUDA_SUCCESS, cu_.cuMemsetD8(dev_, 0x0c, kBytes));
  });
  EXPECT_EQ(out, a);
  Release();
  setter.join();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(nullptr));
  EXPECT_EQ(out, b);
  EXPECT_EQ(DeviceBytes(), Bytes(kBytes, 0x0c));
}

TEST_F(StreamTest, StreamsAreIndependent) {
  CUstream other = nullptr;
  ASSERT_CU_OK(cu_.cuStreamCreate(&other, CU_STREAM_NON_BLOCKING));
  const auto in = Bytes(kBytes, 0x11);
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, in.data(), kBytes, stream_));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(stream_));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(other));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(nullptr));
  // Neither waits for stream_'s held copy.
  ASSERT_CU_OK(cu_.cuStreamSynchronize(other));
  ASSERT_CU_OK(cu_.cuStreamSynchronize(nullptr));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(stream_));
  ASSERT_CU_OK(cu_.cuStreamDestroy(other));
  Release();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(stream_));
  EXPECT_EQ(DeviceBytes(), in);
}

TEST_F(StreamTest, TheSpecialHandlesAreTheLegacyStream) {
  // cuda.h's CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: softgpu makes the
  // per-thread default stream the legacy stream too.
  const CUstream kLegacy = reinterpret_cast<CUstream>(0x1);
  const CUstream kPerThread = reinterpret_cast<CUstream>(0x2);
  const auto in = Bytes(kBytes, 0x3c);
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, in.data(), kBytes, kLegacy));
  for (CUstream s : {static_cast<CUstream>(nullptr), kLegacy, kPerThread}) {
    EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(s));
  }
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(stream_));
  Release();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(kPerThread));
  for (CUstream s : {static_cast<CUstream>(nullptr), kLegacy, kPerThread}) {
    EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(s));
  }
  EXPECT_EQ(DeviceBytes(), in);
}

TEST_F(StreamTest, DestroyReturnsAtOnceAndTheWorkStillLands) {
  const auto in = Bytes(kBytes, 0x5e);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(dev_, in.data(), kBytes));
  // Landed before stream_ reads it: from pageable memory, the copy may
  // still be queued on the NULL stream when the call returns.
  ASSERT_CU_OK(cu_.cuStreamSynchronize(nullptr));
  auto out = Bytes(kBytes, 0);
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(out.data(), dev_, kBytes, stream_));
  // Returns while the copy is held (it would hang if it waited for it),
  // and the handle is invalid at once.
  const CUstream destroyed = stream_;
  ASSERT_CU_OK(cu_.cuStreamDestroy(stream_));
  stream_ = nullptr;
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamQuery(destroyed));
  EXPECT_CU(CUDA_ERROR_INVALID_HANDLE, cu_.cuStreamSynchronize(destroyed));
  EXPECT_EQ(out, Bytes(kBytes, 0));
  // Nothing can synchronise with a destroyed stream: wait for the bytes
  // (the time bound only keeps a broken driver from hanging the test).
  Release();
  const auto deadline = std::chrono::steady_clock::now() + kLongWait;
  while (out != in && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(out, in);
}

TEST_F(StreamTest, ExitingWithWorkQueuedIsClean) {
  // A fresh process (re-executed, not forked from one with stream
  // threads) destroys a stream, frees the memory and releases the last
  // context while the stream's copy is held, then exits: no call waits for
  // the copy, and exit does not crash or leak (under ASan its leak check
  // runs at this exit, and fails it).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        static const auto in = Bytes(kBytes, 0x99);
        bool ok = HoldStreams(true) == 0;
        ok &= cu_.cuMemcpyHtoDAsync(dev_, in.data(), kBytes, stream_) ==
              CUDA_SUCCESS;
        ok &= cu_.cuStreamDestroy(stream_) == CUDA_SUCCESS;
        ok &= cu_.cuMemFree(dev_) == CUDA_SUCCESS;
        ok &= cu_.cuDevicePrimaryCtxRelease(0) == CUDA_SUCCESS;
        std::exit(ok ? 0 : 3);
      },
      ::testing::ExitedWithCode(0), "");
}

// NVIDIA's "API synchronization behavior", emulated with a copy delay: a
// memset of device memory and a device-to-device copy are asynchronous
// with respect to the host, and a copy from pageable memory returns once
// its source is staged; device-to-host copies and copies from pinned
// memory are synchronous.
TEST_F(StreamTest, SynchronousCallsAreAsynchronous) {
  CUdeviceptr other = 0;
  ASSERT_CU_OK(cu_.cuMemAlloc(&other, kBytes));
  ASSERT_CU_OK(cu_.cuMemsetD8(other, 0x22, kBytes));
  ASSERT_CU_OK(cu_.cuStreamSynchronize(nullptr));
  void* pinned = nullptr;
  ASSERT_CU_OK(cu_.cuMemHostAlloc(&pinned, kBytes, 0));
  std::memset(pinned, 0x10, kBytes);
  Hold();
  // From pinned memory: done when it returns.
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(dev_, pinned, kBytes));
  EXPECT_EQ(Peek(dev_), Bytes(kBytes, 0x10));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(nullptr));

  // These three return with nothing written, queued on the NULL stream.
  auto in = Bytes(kBytes, 0xd1);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(dev_, in.data(), kBytes));
  std::fill(in.begin(), in.end(), 0xee);  // staged: may be reused at once
  ASSERT_CU_OK(cu_.cuMemcpyDtoD(other, dev_, kBytes));
  ASSERT_CU_OK(cu_.cuMemsetD8(dev_, 0x44, kBytes));
  EXPECT_CU(CUDA_ERROR_NOT_READY, cu_.cuStreamQuery(nullptr));
  EXPECT_EQ(Peek(dev_), Bytes(kBytes, 0x10));
  EXPECT_EQ(Peek(other), Bytes(kBytes, 0x22));

  // A device-to-host copy waits for them (they ran in order).
  Release();
  EXPECT_EQ(DeviceBytes(), Bytes(kBytes, 0x44));
  std::vector<unsigned char> out(kBytes, 0);
  ASSERT_CU_OK(cu_.cuMemcpyDtoH(out.data(), other, kBytes));
  EXPECT_EQ(out, Bytes(kBytes, 0xd1));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(nullptr));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuMemFreeHost(pinned));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuMemFree(other));
}

TEST_F(StreamTest, SyncMemopsMakesThemSynchronous) {
  CUdeviceptr other = 0;
  ASSERT_CU_OK(cu_.cuMemAlloc(&other, kBytes));
  ASSERT_CU_OK(cu_.cuMemsetD8(other, 0x22, kBytes));
  ASSERT_CU_OK(cu_.cuStreamSynchronize(nullptr));
  const unsigned int on = 1;
  ASSERT_CU_OK(
      cu_.cuPointerSetAttribute(&on, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, dev_));
  Hold();
  // Each is done when it returns, with the NULL stream held.
  const auto in = Bytes(kBytes, 0xd2);
  ASSERT_CU_OK(cu_.cuMemcpyHtoD(dev_, in.data(), kBytes));
  EXPECT_EQ(Peek(dev_), in);
  ASSERT_CU_OK(cu_.cuMemsetD8(dev_, 0x55, kBytes));
  EXPECT_EQ(Peek(dev_), Bytes(kBytes, 0x55));
  ASSERT_CU_OK(cu_.cuMemcpyDtoD(dev_, other, kBytes));
  EXPECT_EQ(Peek(dev_), Bytes(kBytes, 0x22));
  EXPECT_CU(CUDA_SUCCESS, cu_.cuStreamQuery(nullptr));
  Release();
  EXPECT_CU(CUDA_SUCCESS, cu_.cuMemFree(other));
}

TEST_F(StreamTest, SettingSyncMemopsWaitsForPendingOperations) {
  Hold();
  ASSERT_CU_OK(cu_.cuMemsetD8(dev_, 0x66, kBytes));
  EXPECT_EQ(Peek(dev_), Bytes(kBytes, 0));
  std::atomic<bool> set{false};
  std::thread setter([&] {
    const unsigned int on = 1;
    EXPECT_CU(CUDA_SUCCESS, cu_.cuPointerSetAttribute(
                                &on, CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, dev_));
    set = true;
  });
  // It cannot return while the memset is held. (A slow machine could only
  // hide a setter that does not wait, never fail one that does.)
  std::this_thread::sleep_for(50 * kDelay);
  EXPECT_FALSE(set);
  Release();
  setter.join();
  // Returned: the memset has run, with no synchronisation besides.
  EXPECT_EQ(Peek(dev_), Bytes(kBytes, 0x66));
}

TEST_F(StreamTest, MemoryFreedUnderAQueuedCopyStaysMappedForIt) {
  // Freeing memory a copy is still using is the caller's bug; the driver
  // must survive it (the copy keeps the allocation mapped until it runs).
  const auto in = Bytes(kBytes, 0x42);
  void* pinned = nullptr;
  ASSERT_CU_OK(cu_.cuMemHostAlloc(&pinned, kBytes, 0));
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, in.data(), kBytes, stream_));
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(pinned, dev_, kBytes, stream_));
  // Both copies are still queued.
  ASSERT_CU_OK(cu_.cuMemFree(dev_));
  ASSERT_CU_OK(cu_.cuMemFreeHost(pinned));
  EXPECT_EQ(MemoryType(dev_), 0u);
  dev_ = 0;
  Release();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(stream_));
}

// cuLaunchHostFunc: the function runs after the stream's earlier copies
// (it sees their bytes) and before its later ones.
TEST_F(StreamTest, HostFunctionsRunInStreamOrder) {
  struct Seen {
    const unsigned char* host = nullptr;
    std::atomic<int> runs{0};
    unsigned char first = 0;
  };
  std::vector<unsigned char> in = Bytes(kBytes, 0x5a);
  void* pinned = nullptr;
  ASSERT_CU_OK(cu_.cuMemHostAlloc(&pinned, kBytes, 0));
  auto* out = static_cast<unsigned char*>(pinned);
  std::memset(out, 0, kBytes);
  Seen seen;
  seen.host = out;
  Hold();
  ASSERT_CU_OK(cu_.cuMemcpyHtoDAsync(dev_, in.data(), kBytes, stream_));
  ASSERT_CU_OK(cu_.cuMemcpyDtoHAsync(out, dev_, kBytes, stream_));
  ASSERT_CU_OK(cu_.cuLaunchHostFunc(
      stream_,
      [](void* p) {
        auto* s = static_cast<Seen*>(p);
        s->first = s->host[0];
        s->runs.fetch_add(1);
      },
      &seen));
  EXPECT_EQ(seen.runs.load(), 0);  // Held: nothing ran.
  EXPECT_EQ(cu_.cuStreamQuery(stream_), CUDA_ERROR_NOT_READY);
  Release();
  ASSERT_CU_OK(cu_.cuStreamSynchronize(stream_));
  EXPECT_EQ(seen.runs.load(), 1);
  EXPECT_EQ(seen.first, 0x5a);  // The copies before it had run.
  EXPECT_CU(CUDA_ERROR_INVALID_VALUE,
            cu_.cuLaunchHostFunc(stream_, nullptr, nullptr));
  ASSERT_CU_OK(cu_.cuMemFreeHost(pinned));
}

}  // namespace
}  // namespace softgpu
