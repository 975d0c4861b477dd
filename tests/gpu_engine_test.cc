// The engine moving GPU memory over RDMA on the emulators: two engines in
// one process on softrnic's two NICs, each buffer in a different emulated
// GPU's memory (softgpu), registered through dma-bufs. READs and WRITEs go
// GPU to GPU, and the driver's own copies verify every byte (the CPU cannot
// touch device memory: a transport that tried would crash the test).
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "engine/transfer_engine.h"
#include "gpu/cuda_driver.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"
#include "tools/pattern.h"

namespace ferry {
namespace {

using gpu::CudaDriver;

constexpr size_t kBuffer = 8 << 20;

const CudaDriver& Driver() { return gpu::SoftgpuDriver(2); }

// Device memory on GPU `device`, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes) : bytes_(bytes) {
    EXPECT_OK(Driver().UseDevice(device));
    EXPECT_OK(
        Driver().Check(Driver().api().cuMemAlloc(&ptr_, bytes), "cuMemAlloc"));
  }
  ~DeviceBuffer() {
    if (ptr_ != 0) Driver().api().cuMemFree(ptr_);
  }
  uint8_t* get() const { return reinterpret_cast<uint8_t*>(ptr_); }
  CUdeviceptr ptr() const { return ptr_; }

  // The pattern of tools/pattern.h at [off, off + len), through the driver.
  void Fill(size_t off, size_t len, uint64_t seed) {
    std::vector<uint8_t> host(len);
    FillPattern(host.data(), len, off, seed);
    EXPECT_OK(Driver().CopyToDevice(ptr_ + off, host.data(), len));
  }
  size_t Check(size_t off, size_t len, uint64_t seed) {
    std::vector<uint8_t> host(len);
    EXPECT_OK(Driver().CopyFromDevice(host.data(), ptr_ + off, len));
    return CheckPattern(host.data(), len, off, seed);
  }

 private:
  CUdeviceptr ptr_ = 0;
  size_t bytes_;
};

class GpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Driver();
    remote_ = std::make_unique<DeviceBuffer>(1, kBuffer);
    local_ = std::make_unique<DeviceBuffer>(0, kBuffer);
    EngineOptions t;
    t.local_segment_name = "target";
    t.transports = {"rdma"};
    t.transfer_timeout = absl::Seconds(20);
    ASSERT_OK(target_.Init(t));
    EngineOptions i = t;
    i.local_segment_name = "initiator";
    i.metadata_endpoint = target_.metadata_address();
    ASSERT_OK(initiator_.Init(i));
    remote_->Fill(0, kBuffer, 11);
    ASSERT_OK(target_.RegisterLocalMemory(remote_->get(), kBuffer));
    ASSERT_OK(initiator_.RegisterLocalMemory(local_->get(), kBuffer));
    ASSERT_OK_AND_ASSIGN(seg_, initiator_.OpenSegment("target"));
  }

  BatchStatus Run(OpCode op, size_t off, size_t len) {
    TransferRequest r;
    r.opcode = op;
    r.source = local_->get() + off;
    r.target_id = seg_;
    r.target_offset = remote_->ptr() + off;
    r.length = len;
    auto batch = initiator_.AllocateBatch(1);
    EXPECT_OK(batch);
    EXPECT_OK(initiator_.SubmitTransfer(*batch, {r}));
    auto st = initiator_.WaitBatch(*batch, absl::Seconds(60));
    EXPECT_OK(st);
    EXPECT_OK(initiator_.FreeBatch(*batch));
    return st.ok() ? *st : BatchStatus{};
  }

  // Device memory outlives the engines that may access it.
  std::unique_ptr<DeviceBuffer> remote_, local_;
  TransferEngine target_, initiator_;
  SegmentHandle seg_ = 0;
};

TEST_F(GpuEngineTest, ReadAndWriteGpuToGpuEveryByteVerified) {
  const size_t sizes[] = {1, 4095, 65537, 1 << 20, (3 << 20) + 5};
  size_t off = 0;
  for (size_t len : sizes) {
    off = (off + 12345) % (kBuffer - len);
    BatchStatus st = Run(OpCode::kRead, off, len);
    ASSERT_EQ(st.state, TransferState::kCompleted) << len << st.first_error;
    ASSERT_EQ(local_->Check(off, len, 11), len) << "READ of " << len;
    local_->Fill(off, len, 77);
    st = Run(OpCode::kWrite, off, len);
    ASSERT_EQ(st.state, TransferState::kCompleted) << len << st.first_error;
    ASSERT_EQ(remote_->Check(off, len, 77), len) << "WRITE of " << len;
    remote_->Fill(off, len, 11);
  }
}

TEST(GpuEngineErrorsTest, TcpRefusesGpuMemoryByName) {
  DeviceBuffer buf(0, 1 << 20);
  TransferEngine engine;
  EngineOptions o;
  o.local_segment_name = "tcp-only";
  o.transports = {"tcp"};
  ASSERT_OK(engine.Init(o));
  absl::Status s = engine.RegisterLocalMemory(buf.get(), 1 << 20);
  EXPECT_STATUS(s, absl::StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("cuda:0"), std::string::npos) << s;
}

TEST(GpuEngineErrorsTest, LocationMustNameTheGpuHoldingTheBuffer) {
  DeviceBuffer buf(1, 1 << 20);
  TransferEngine engine;
  EngineOptions o;
  o.local_segment_name = "loc";
  o.transports = {"rdma"};
  ASSERT_OK(engine.Init(o));
  absl::Status s = engine.RegisterLocalMemory(buf.get(), 1 << 20, "cuda:0");
  EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cuda:1"), std::string::npos) << s;
  EXPECT_STATUS(engine.RegisterLocalMemory(buf.get(), 1 << 20, "cpu:0"),
                absl::StatusCode::kInvalidArgument);
  // Past the allocation's end.
  EXPECT_STATUS(engine.RegisterLocalMemory(buf.get(), 2 << 20),
                absl::StatusCode::kInvalidArgument);
  ASSERT_OK(engine.RegisterLocalMemory(buf.get(), 1 << 20, "cuda:1"));
  ASSERT_OK(engine.UnregisterLocalMemory(buf.get()));
  ASSERT_OK(engine.RegisterLocalMemory(buf.get(), 1 << 20, "*"));
  ASSERT_OK(engine.UnregisterLocalMemory(buf.get()));
}

}  // namespace
}  // namespace ferry
