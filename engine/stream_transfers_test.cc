// StreamTransfers on softgpu with two TCP engines in this process: a
// transfer queued on a stream sees the bytes of the stream's earlier copy
// and is done before the stream's later work; failures are kept for
// TakeError, not lost; a transfer the stream reaches after Close fails
// instead of touching the engine.
#include "engine/stream_transfers.h"

#include <vector>

#include "common/pattern.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gpu/softgpu/softgpu_control.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using gpu::CudaDriver;

constexpr size_t kBytes = 4 << 20;

const CudaDriver& Driver() { return gpu::SoftgpuDriver(2); }

CUdeviceptr Alloc(int device) {
  CUdeviceptr p = 0;
  EXPECT_OK(Driver().UseDevice(device));
  EXPECT_OK(Driver().Check(Driver().api().cuMemAlloc(&p, kBytes), "alloc"));
  return p;
}

class StreamTransfersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    remote_ = Alloc(1);
    local_ = Alloc(0);
    EngineOptions t;
    t.local_segment_name = "stream-target";
    t.transports = {"tcp"};
    t.transfer_timeout = absl::Seconds(20);
    ASSERT_OK(target_.Init(t));
    EngineOptions i = t;
    i.local_segment_name = "stream-initiator";
    i.metadata_endpoint = target_.metadata_address();
    ASSERT_OK(initiator_.Init(i));
    ASSERT_OK(target_.RegisterLocalMemory(Ptr(remote_), kBytes));
    ASSERT_OK(initiator_.RegisterLocalMemory(Ptr(local_), kBytes));
    ASSERT_OK_AND_ASSIGN(seg_, initiator_.OpenSegment("stream-target"));
    ASSERT_OK(Driver().UseDevice(0));
    ASSERT_OK(Driver().Check(
        Driver().api().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING),
        "cuStreamCreate"));
  }
  void TearDown() override {
    softgpu::HoldStreams(false);
    if (stream_ != nullptr) Driver().api().cuStreamDestroy(stream_);
    initiator_.Shutdown();
    target_.Shutdown();
    Driver().api().cuMemFree(local_);
    Driver().api().cuMemFree(remote_);
  }

  static void* Ptr(CUdeviceptr p) { return reinterpret_cast<void*>(p); }
  TransferRequest Write() const {
    TransferRequest r;
    r.opcode = OpCode::kWrite;
    r.source = Ptr(local_);
    r.target_id = seg_;
    r.target_offset = remote_;
    r.length = kBytes;
    return r;
  }
  size_t RemoteMatches(uint64_t seed) {
    std::vector<uint8_t> host(kBytes);
    EXPECT_OK(Driver().CopyFromDevice(host.data(), remote_, kBytes));
    return CheckPattern(host.data(), kBytes, 0, seed);
  }

  CUdeviceptr remote_ = 0, local_ = 0;
  TransferEngine target_, initiator_;
  SegmentHandle seg_ = 0;
  CUstream stream_ = nullptr;
};

TEST_F(StreamTransfersTest, RunsAfterTheStreamsEarlierWork) {
  StreamTransfers streams(&initiator_);
  std::vector<uint8_t> host(kBytes);
  FillPattern(host.data(), kBytes, 0, 42);
  // Held: the copy cannot have run when the transfer is queued, so the
  // transfer sees its bytes only if it runs in stream order.
  ASSERT_EQ(softgpu::HoldStreams(true), 0);
  ASSERT_OK(Driver().Check(
      Driver().api().cuMemcpyHtoDAsync(local_, host.data(), kBytes, stream_),
      "cuMemcpyHtoDAsync"));
  ASSERT_OK(streams.Enqueue(reinterpret_cast<uintptr_t>(stream_), {Write()}));
  ASSERT_EQ(softgpu::HoldStreams(false), 0);
  ASSERT_OK(Driver().Check(Driver().api().cuStreamSynchronize(stream_),
                           "cuStreamSynchronize"));
  // Synchronising the stream waited for the transfer.
  EXPECT_EQ(RemoteMatches(42), kBytes);
  EXPECT_OK(streams.TakeError());
}

TEST_F(StreamTransfersTest, FailuresAreKeptAndCounted) {
  StreamTransfers streams(&initiator_);
  EXPECT_STATUS(streams.Enqueue(reinterpret_cast<uintptr_t>(stream_), {}),
                absl::StatusCode::kInvalidArgument);
  TransferRequest bad = Write();
  bad.target_offset = remote_ + kBytes;  // Past the target's buffer.
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK(streams.Enqueue(reinterpret_cast<uintptr_t>(stream_), {bad}));
  }
  ASSERT_OK(Driver().Check(Driver().api().cuStreamSynchronize(stream_),
                           "cuStreamSynchronize"));
  absl::Status s = streams.TakeError();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("2 transfer(s)"), std::string::npos) << s;
  EXPECT_OK(streams.TakeError());  // Taken.
}

TEST_F(StreamTransfersTest, ATransferReachedAfterCloseFailsCleanly) {
  StreamTransfers streams(&initiator_);
  ASSERT_EQ(softgpu::HoldStreams(true), 0);
  ASSERT_OK(streams.Enqueue(reinterpret_cast<uintptr_t>(stream_), {Write()}));
  streams.Close();
  EXPECT_STATUS(
      streams.Enqueue(reinterpret_cast<uintptr_t>(stream_), {Write()}),
      absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(softgpu::HoldStreams(false), 0);
  ASSERT_OK(Driver().Check(Driver().api().cuStreamSynchronize(stream_),
                           "cuStreamSynchronize"));
  EXPECT_STATUS(streams.TakeError(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace ferry
