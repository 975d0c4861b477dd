// The TCP initiator's GPU staging (gpu_staging.h) against a peer that
// never answers, on softgpu and a SimulatedClock: a slice that waited for
// the only staging buffer past its deadline fails uncopied, and Shutdown
// completes every staged slice exactly once.
#include <memory>
#include <string>
#include <vector>

#include "common/simulated_clock.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"
#include "testing/process_usage.h"
#include "transport/tcp/tcp_test_util.h"
#include "transport/tcp/tcp_transport.h"

namespace ferry::tcp {
namespace {

using ::ferry::tcp::testing::RecordingSink;

class GpuStagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const gpu::CudaDriver& d = gpu::SoftgpuDriver(1);
    ASSERT_OK(d.UseDevice(0));
    ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev_, kBytes), "cuMemAlloc"));
    TransportOptions opts;
    opts.tcp.staging_buffers = 1;
    opts.tcp.max_slice_bytes = kBytes;
    transport_ = std::make_unique<TcpTransport>(opts);
    TransportEnv env;
    env.local_segment = "i";
    env.listen_host = "127.0.0.1";
    env.incarnation = 7;
    env.clock = &clock_;
    descriptor::TransportEndpoint ep;
    ASSERT_OK(transport_->Install(env, &ep));
    MemoryRegion r;
    r.addr = dev_;
    r.length = kBytes;
    r.cuda_device = 0;
    ASSERT_OK_AND_ASSIGN(handle_, transport_->RegisterMemory(r, nullptr));
    ASSERT_NE(handle_, nullptr);  // A GPU buffer's handle names its GPU.
    // A peer that accepts and never answers.
    auto listener = ListenTcp("127.0.0.1", 0, &port_);
    ASSERT_OK(listener);
    listener_ = std::move(*listener);
    descriptor::SegmentDescriptor desc;
    desc.set_name("silent");
    desc.set_incarnation(7);
    auto* t = desc.add_transports();
    t->set_transport("tcp");
    t->set_address("127.0.0.1:" + std::to_string(port_));
    auto* b = desc.add_buffers();
    b->set_addr(0x10000);
    b->set_length(1 << 20);
    b->set_tcp_key(1);
    view_ = *SegmentView::Create(desc);
  }
  void TearDown() override {
    if (transport_ != nullptr) transport_->Shutdown();
    transport_.reset();
    gpu::SoftgpuDriver(1).api().cuMemFree(dev_);
  }

  Slice Write(absl::Duration deadline) {
    Slice s;
    s.op = OpCode::kWrite;
    s.local = reinterpret_cast<void*>(dev_);
    s.remote = 0x10000;
    s.length = kBytes;
    s.target = view_.get();
    s.remote_buffer = 0;
    s.local_handle = handle_;
    s.deadline = clock_.Now() + deadline;
    s.sink = &sink_;
    return s;
  }

  static constexpr size_t kBytes = 64 << 10;
  SimulatedClock clock_;
  CUdeviceptr dev_ = 0;
  uint16_t port_ = 0;
  UniqueFd listener_;
  std::shared_ptr<const SegmentView> view_;
  RecordingSink sink_;
  MemoryHandle handle_ = nullptr;
  std::unique_ptr<TcpTransport> transport_;
};

TEST_F(GpuStagingTest, ASliceThatWaitedPastItsDeadlineFailsUncopied) {
  Slice a = Write(absl::Seconds(2));
  Slice b = Write(absl::Seconds(1));
  Slice* ss[] = {&a, &b};
  transport_->Submit(ss);
  // `a` holds the one buffer: copied out, then on the wire to the silent
  // peer; `b` waits.
  ASSERT_TRUE(::ferry::testing::WaitUntil(
      [&] { return transport_->Stats().connects_started == 1; },
      absl::Seconds(10)));
  EXPECT_EQ(transport_->Stats().staging_waits, 1u);
  clock_.Advance(absl::Seconds(2) + absl::Milliseconds(20));
  auto st = sink_.Wait(2, absl::Seconds(10));
  ASSERT_EQ(st.size(), 2u);
  EXPECT_STATUS(st[0], absl::StatusCode::kDeadlineExceeded);
  EXPECT_STATUS(st[1], absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(st[1].message().find("staging buffer"), std::string::npos) << st[1];
  // Only `a` was copied: `b` expired while it waited.
  EXPECT_EQ(transport_->Stats().staging_copies, 1u);
  EXPECT_EQ(sink_.count(&a), 1);
  EXPECT_EQ(sink_.count(&b), 1);
}

TEST_F(GpuStagingTest, ShutdownCompletesEveryStagedSliceOnce) {
  std::vector<Slice> slices;
  slices.reserve(4);
  for (int i = 0; i < 4; ++i) slices.push_back(Write(absl::Seconds(60)));
  std::vector<Slice*> ss;
  for (Slice& s : slices) ss.push_back(&s);
  transport_->Submit(absl::MakeConstSpan(ss));
  ASSERT_TRUE(::ferry::testing::WaitUntil(
      [&] { return transport_->Stats().connects_started == 1; },
      absl::Seconds(10)));
  transport_->Shutdown();
  auto st = sink_.Wait(4, absl::Seconds(10));
  ASSERT_EQ(st.size(), 4u);
  for (const absl::Status& s : st) {
    EXPECT_STATUS(s, absl::StatusCode::kCancelled);
  }
  for (Slice& s : slices) EXPECT_EQ(sink_.count(&s), 1);
}

}  // namespace
}  // namespace ferry::tcp
