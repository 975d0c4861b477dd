// GPUDirect RDMA on the two emulators, the path Ferry's RDMA transport will
// take for GPU memory: softgpu (the CUDA driver) exports device memory as
// a dma-buf, softrnic (the NIC) registers it with ibv_reg_dmabuf_mr, and a
// peer's RDMA WRITE and READ move bytes into and out of device memory that
// the CPU cannot touch; the driver's own copies check every byte.
#include <infiniband/verbs.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gpu/cuda_driver.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"
#include "transport/softrnic/verbs_test_util.h"

namespace ferry {
namespace {

using gpu::CudaDriver;
using softrnic_test::Buffer;
using softrnic_test::ConnectOptions;
using softrnic_test::ConnectQp;
using softrnic_test::Endpoint;
using softrnic_test::EndpointOptions;
using softrnic_test::FillPattern;
using softrnic_test::FirstNotEqual;
using softrnic_test::FirstPatternMismatch;
using softrnic_test::OpenDeviceByName;
using softrnic_test::PollOne;
using softrnic_test::PostRdma;

constexpr int kAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

const CudaDriver& Driver() { return gpu::SoftgpuDriver(1); }

class GpuDirectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 2; ++i) {
      std::string err;
      ctx_[i] = OpenDeviceByName(i == 0 ? "softrnic0" : "softrnic1", &err);
      ASSERT_NE(ctx_[i], nullptr) << err;
    }
    std::string err;
    host_ = Endpoint::Create(ctx_[0], EndpointOptions{}, &err);
    ASSERT_NE(host_, nullptr) << err;
    gpu_side_ = Endpoint::Create(ctx_[1], EndpointOptions{}, &err);
    ASSERT_NE(gpu_side_, nullptr) << err;
    ConnectOptions o;
    ASSERT_EQ(
        ConnectQp(host_->qp(), gpu_side_->qpn(), gpu_side_->gid(), o, &err), 0)
        << err;
    ASSERT_EQ(ConnectQp(gpu_side_->qp(), host_->qpn(), host_->gid(), o, &err),
              0)
        << err;
    ASSERT_OK(Driver().UseDevice(0));
  }

  void TearDown() override {
    host_.reset();
    gpu_side_.reset();
    for (ibv_context* c : ctx_) {
      if (c != nullptr) ibv_close_device(c);
    }
  }

  // One signaled work request from the host side; its completion status.
  ibv_wc_status Post(ibv_wr_opcode op, uint64_t wr_id, Buffer* local,
                     uint32_t len, uint64_t remote, uint32_t rkey) {
    if (PostRdma(host_->qp(), op, wr_id, local, 0, len, remote, rkey) != 0) {
      return IBV_WC_GENERAL_ERR;
    }
    ibv_wc wc{};
    if (!PollOne(host_->cq(), &wc) || wc.wr_id != wr_id) {
      return IBV_WC_GENERAL_ERR;
    }
    return wc.status;
  }

  ibv_context* ctx_[2] = {nullptr, nullptr};
  std::unique_ptr<Endpoint> host_;
  std::unique_ptr<Endpoint> gpu_side_;
};

TEST_F(GpuDirectTest, RdmaWriteAndReadMoveDeviceMemoryThroughADmabufMr) {
  const CudaDriver& d = Driver();
  constexpr size_t kBytes = 64 << 10;
  CUdeviceptr dev = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev, kBytes), "cuMemAlloc"));
  ASSERT_OK(d.Check(d.api().cuMemsetD8(dev, 0, kBytes), "cuMemsetD8"));
  ASSERT_OK(d.SetSyncMemops(dev));
  ASSERT_OK_AND_ASSIGN(int fd, d.DmaBufFd(dev, kBytes));
  // The MR's iova is the device address: peers address GPU memory by it.
  ibv_mr* mr = ibv_reg_dmabuf_mr(gpu_side_->pd(), 0, kBytes, dev, fd, kAccess);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  close(fd);

  // WRITE 32 KiB from host memory into the middle of device memory.
  constexpr uint32_t kLen = 32 << 10;
  Buffer* src = host_->Reg(kLen);
  ASSERT_NE(src, nullptr);
  FillPattern(src->data(), kLen, 17);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 1, src, kLen, dev + 4096, mr->rkey),
            IBV_WC_SUCCESS);
  std::vector<uint8_t> seen(kBytes);
  ASSERT_OK(d.CopyFromDevice(seen.data(), dev, kBytes));
  EXPECT_EQ(FirstNotEqual(seen.data(), 4096, 0), -1);
  EXPECT_EQ(FirstPatternMismatch(seen.data() + 4096, kLen, 17), -1);
  EXPECT_EQ(FirstNotEqual(seen.data() + 4096 + kLen, kBytes - 4096 - kLen, 0),
            -1);

  // READ device memory the driver wrote back into host memory.
  std::vector<uint8_t> pattern(kLen);
  FillPattern(pattern.data(), kLen, 23);
  ASSERT_OK(d.CopyToDevice(dev + kBytes - kLen, pattern.data(), kLen));
  Buffer* dst = host_->Reg(kLen);
  ASSERT_NE(dst, nullptr);
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 2, dst, kLen, dev + kBytes - kLen, mr->rkey),
            IBV_WC_SUCCESS);
  EXPECT_EQ(FirstPatternMismatch(dst->data(), kLen, 23), -1);

  // Past the registered device memory: the NIC refuses it.
  EXPECT_EQ(Post(IBV_WR_RDMA_WRITE, 3, src, 1, dev + kBytes, mr->rkey),
            IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
}

TEST_F(GpuDirectTest, TheMrOutlivesTheAllocationLikeADmabufAttachment) {
  const CudaDriver& d = Driver();
  constexpr size_t kBytes = 16 << 10;
  CUdeviceptr dev = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev, kBytes), "cuMemAlloc"));
  ASSERT_OK_AND_ASSIGN(int fd, d.DmaBufFd(dev, kBytes));
  ibv_mr* mr = ibv_reg_dmabuf_mr(gpu_side_->pd(), 0, kBytes, dev, fd, kAccess);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  close(fd);
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
  // New device memory, zeroed; it may well take the freed address.
  CUdeviceptr next = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&next, kBytes), "cuMemAlloc"));
  ASSERT_OK(d.Check(d.api().cuMemsetD8(next, 0, kBytes), "cuMemsetD8"));
  // The old pages stay while the MR holds them: a late WRITE and READ
  // through it use them, never the new allocation.
  Buffer* src = host_->Reg(kBytes);
  Buffer* back = host_->Reg(kBytes);
  ASSERT_NE(src, nullptr);
  ASSERT_NE(back, nullptr);
  FillPattern(src->data(), kBytes, 5);
  ASSERT_EQ(Post(IBV_WR_RDMA_WRITE, 1, src, kBytes, dev, mr->rkey),
            IBV_WC_SUCCESS);
  ASSERT_EQ(Post(IBV_WR_RDMA_READ, 2, back, kBytes, dev, mr->rkey),
            IBV_WC_SUCCESS);
  EXPECT_EQ(FirstPatternMismatch(back->data(), kBytes, 5), -1);
  std::vector<uint8_t> fresh(kBytes);
  ASSERT_OK(d.CopyFromDevice(fresh.data(), next, kBytes));
  EXPECT_EQ(FirstNotEqual(fresh.data(), kBytes, 0), -1);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  ASSERT_OK(d.Check(d.api().cuMemFree(next), "cuMemFree"));
}

TEST_F(GpuDirectTest, PlainRegMrOfDeviceMemoryIsEfaultWithoutPeermem) {
  const CudaDriver& d = Driver();
  CUdeviceptr dev = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev, 1 << 16), "cuMemAlloc"));
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(gpu_side_->pd(), reinterpret_cast<void*>(dev),
                          1 << 16, kAccess);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(errno, EFAULT);
  if (mr != nullptr) ibv_dereg_mr(mr);
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
}

}  // namespace
}  // namespace ferry
