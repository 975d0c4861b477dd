// The shm transport with both ends in this process (process_vm_* on one's
// own pid takes the same path as on another's); tests/shm_e2e_test runs
// the target in a process of its own.
#include "transport/shm/shm_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "common/mutex.h"
#include "common/pattern.h"
#include "common/status_testing.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"

namespace ferry::shm {
namespace {

class Sink final : public SliceSink {
 public:
  void OnSliceDone(Slice* slice, const absl::Status& status) override {
    MutexLock lock(&mu_);
    statuses_.push_back(status);
    cv_.SignalAll();
  }
  std::vector<absl::Status> Wait(size_t n) {
    MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (statuses_.size() < n && !cv_.WaitWithDeadline(&mu_, deadline)) {
    }
    return statuses_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

constexpr size_t kBytes = 1 << 20;

class ShmTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.shm.slice_bytes = 64 << 10;
    target_ = std::make_unique<ShmTransport>(options_);
    initiator_ = std::make_unique<ShmTransport>(options_);
    endpoint_.set_transport("shm");
    ASSERT_OK(target_->Install(TransportEnv{}, &endpoint_));
    descriptor::TransportEndpoint ignored;
    ignored.set_transport("shm");
    ASSERT_OK(initiator_->Install(TransportEnv{}, &ignored));
    remote_.resize(kBytes);
    local_.resize(kBytes);
    ASSERT_OK(Register(remote_.data(), kBytes, &buffer_));
  }
  void TearDown() override {
    initiator_->Shutdown();
    target_->Shutdown();
  }

  absl::Status Register(uint8_t* p, size_t n, descriptor::Buffer* b) {
    MemoryRegion r;
    r.addr = reinterpret_cast<uintptr_t>(p);
    r.length = n;
    r.location = "cpu:0";
    r.remote_accessible = true;
    b->set_addr(r.addr);
    b->set_length(n);
    b->set_location("cpu:0");
    return target_->RegisterMemory(r, b).status();
  }

  std::shared_ptr<const SegmentView> View(
      const descriptor::TransportEndpoint& ep) {
    descriptor::SegmentDescriptor d;
    d.set_name("target");
    d.set_incarnation(incarnation_);
    *d.add_transports() = ep;
    *d.add_buffers() = buffer_;
    auto v = SegmentView::Create(d);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : nullptr;
  }

  // Moves [offset, offset + n) in `slices` slices and returns the statuses.
  std::vector<absl::Status> Move(const SegmentView& view, OpCode op,
                                 size_t offset, size_t n, size_t slices,
                                 absl::Time deadline = absl::InfiniteFuture()) {
    std::vector<Slice> s(slices);
    std::vector<Slice*> ptrs;
    const size_t each = n / slices;
    for (size_t i = 0; i < slices; ++i) {
      s[i].op = op;
      s[i].local = local_.data() + offset + i * each;
      s[i].remote =
          reinterpret_cast<uintptr_t>(remote_.data()) + offset + i * each;
      s[i].length = each;
      s[i].target = &view;
      s[i].remote_buffer = 0;
      s[i].deadline = deadline;
      s[i].sink = &sink_;
      ptrs.push_back(&s[i]);
    }
    const size_t before = sink_.Wait(0).size();
    initiator_->Submit(ptrs);
    std::vector<absl::Status> all = sink_.Wait(before + slices);
    return std::vector<absl::Status>(all.begin() + before, all.end());
  }

  TransportOptions options_;
  std::unique_ptr<ShmTransport> target_;
  std::unique_ptr<ShmTransport> initiator_;
  descriptor::TransportEndpoint endpoint_;
  descriptor::Buffer buffer_;
  uint64_t incarnation_ = 42;
  std::vector<uint8_t> remote_;
  std::vector<uint8_t> local_;
  Sink sink_;
};

TEST_F(ShmTransportTest, WritesAndReads) {
  auto view = View(endpoint_);
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(initiator_->CanReach(*view));
  EXPECT_NE(buffer_.shm_key(), 0u);
  // Small (copied on this thread) and large (on the copy threads).
  for (size_t n : {size_t{4096}, kBytes}) {
    FillPattern(local_.data(), n, 0, 7 + n);
    for (const absl::Status& s : Move(*view, OpCode::kWrite, 0, n, 16)) {
      ASSERT_OK(s);
    }
    EXPECT_EQ(CheckPattern(remote_.data(), n, 0, 7 + n), n);
    FillPattern(remote_.data(), n, 0, 99 + n);
    for (const absl::Status& s : Move(*view, OpCode::kRead, 0, n, 16)) {
      ASSERT_OK(s);
    }
    EXPECT_EQ(CheckPattern(local_.data(), n, 0, 99 + n), n);
  }
  TransportStats st = initiator_->Stats();
  ASSERT_EQ(st.nics.size(), 1u);
  EXPECT_EQ(st.nics[0].slices, 64u);
  EXPECT_EQ(st.nics[0].bytes, 2 * (4096 + kBytes));
  EXPECT_EQ(st.nics[0].errors, 0u);
  EXPECT_EQ(st.connects_started, 1u);
  EXPECT_EQ(st.peers, 1u);
}

// A buffer unregistered after the descriptor was read is never touched.
TEST_F(ShmTransportTest, AStaleDescriptorTouchesNothing) {
  auto view = View(endpoint_);
  ASSERT_NE(view, nullptr);
  ASSERT_OK(
      target_->UnregisterMemory(reinterpret_cast<uintptr_t>(remote_.data())));
  std::memset(remote_.data(), 0xee, 4096);
  FillPattern(local_.data(), 4096, 0, 3);
  for (const absl::Status& s : Move(*view, OpCode::kWrite, 0, 4096, 1)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "unregistered")) << s;
  }
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(remote_[i], 0xee) << i;
}

// An engine that shuts down drops its registrations without unregistering
// them one by one: its peers must still find every buffer withdrawn.
TEST_F(ShmTransportTest, AShutDownTargetIsWithdrawnFromPeers) {
  auto view = View(endpoint_);
  ASSERT_NE(view, nullptr);
  for (const absl::Status& s : Move(*view, OpCode::kWrite, 0, 4096, 1)) {
    ASSERT_OK(s);
  }
  target_->Shutdown();
  std::memset(remote_.data(), 0xee, 4096);
  for (const absl::Status& s : Move(*view, OpCode::kWrite, 0, 4096, 1)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  }
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(remote_[i], 0xee) << i;
}

// A target buffer without an shm key (GPU memory) is refused, saying what
// to list.
TEST_F(ShmTransportTest, ABufferWithoutAKeyIsRefusedSayingWhy) {
  buffer_.set_shm_key(0);
  auto view = View(endpoint_);
  ASSERT_NE(view, nullptr);
  for (const absl::Status& s : Move(*view, OpCode::kWrite, 0, 4096, 1)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "list tcp or rdma")) << s;
  }
}

// The target's GPU memory (softgpu), reached with the GPU: from host
// memory and from GPU memory, and never once withdrawn. Both engines are
// in this process, so the initiator uses the device pointer as it is;
// tests/gpu_engine_test opens a handle from another process.
TEST_F(ShmTransportTest, GpuMemoryIsCopiedWithTheGpuUntilWithdrawn) {
  const gpu::CudaDriver& driver = gpu::SoftgpuDriver(2);
  const auto& api = driver.api();
  constexpr size_t kGpuBytes = 1 << 20;
  CUdeviceptr remote = 0, local = 0;
  ASSERT_OK(driver.UseDevice(1));
  ASSERT_OK(driver.Check(api.cuMemAlloc(&remote, kGpuBytes), "cuMemAlloc"));
  ASSERT_OK(driver.UseDevice(0));
  ASSERT_OK(driver.Check(api.cuMemAlloc(&local, kGpuBytes), "cuMemAlloc"));
  MemoryRegion r;
  r.addr = remote;
  r.length = kGpuBytes;
  r.location = "cuda:1";
  r.remote_accessible = true;
  r.cuda_device = 1;
  descriptor::Buffer b;
  b.set_addr(remote);
  b.set_length(kGpuBytes);
  b.set_location("cuda:1");
  ASSERT_OK(target_->RegisterMemory(r, &b).status());
  ASSERT_TRUE(b.has_cuda_ipc());
  ASSERT_NE(b.shm_key(), 0u);
  MemoryRegion l = r;
  l.addr = local;
  l.location = "cuda:0";
  l.remote_accessible = false;
  l.cuda_device = 0;
  descriptor::Buffer unused;
  ASSERT_OK_AND_ASSIGN(MemoryHandle local_handle,
                       initiator_->RegisterMemory(l, &unused));
  buffer_ = b;
  auto view = View(endpoint_);
  ASSERT_NE(view, nullptr);
  auto move = [&](OpCode op, void* from, MemoryHandle handle) {
    Slice s;
    s.op = op;
    s.local = from;
    s.remote = remote;
    s.length = kGpuBytes;
    s.target = view.get();
    s.remote_buffer = 0;
    s.local_handle = handle;
    s.sink = &sink_;
    const size_t before = sink_.Wait(0).size();
    Slice* p = &s;
    initiator_->Submit(absl::MakeConstSpan(&p, 1));
    return sink_.Wait(before + 1).back();
  };
  std::vector<uint8_t> host(kGpuBytes), back(kGpuBytes);
  // Host memory to the target's GPU memory, and back.
  FillPattern(host.data(), kGpuBytes, 0, 31);
  ASSERT_OK(move(OpCode::kWrite, host.data(), nullptr));
  ASSERT_OK(driver.CopyFromDevice(back.data(), remote, kGpuBytes));
  EXPECT_EQ(CheckPattern(back.data(), kGpuBytes, 0, 31), kGpuBytes);
  std::fill(host.begin(), host.end(), 0);
  ASSERT_OK(move(OpCode::kRead, host.data(), nullptr));
  EXPECT_EQ(CheckPattern(host.data(), kGpuBytes, 0, 31), kGpuBytes);
  // GPU to GPU.
  FillPattern(host.data(), kGpuBytes, 0, 32);
  ASSERT_OK(driver.CopyToDevice(local, host.data(), kGpuBytes));
  ASSERT_OK(move(OpCode::kWrite, reinterpret_cast<void*>(local), local_handle));
  ASSERT_OK(driver.CopyFromDevice(back.data(), remote, kGpuBytes));
  EXPECT_EQ(CheckPattern(back.data(), kGpuBytes, 0, 32), kGpuBytes);
  EXPECT_EQ(initiator_->Stats().staged_slices, 0u);  // No host bounce.
  // Withdrawn: the stale descriptor reaches nothing.
  ASSERT_OK(target_->UnregisterMemory(remote));
  FillPattern(host.data(), kGpuBytes, 0, 33);
  absl::Status s = move(OpCode::kWrite, host.data(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "unregistered")) << s;
  ASSERT_OK(driver.CopyFromDevice(back.data(), remote, kGpuBytes));
  EXPECT_EQ(CheckPattern(back.data(), kGpuBytes, 0, 32), kGpuBytes);
  ASSERT_OK(initiator_->UnregisterMemory(local));
  ASSERT_OK(driver.UseDevice(1));
  ASSERT_OK(driver.Check(api.cuMemFree(remote), "cuMemFree"));
  ASSERT_OK(driver.UseDevice(0));
  ASSERT_OK(driver.Check(api.cuMemFree(local), "cuMemFree"));
}

TEST_F(ShmTransportTest, ADeadlineThatPassedCopiesNothing) {
  auto view = View(endpoint_);
  ASSERT_NE(view, nullptr);
  std::memset(remote_.data(), 0, 4096);
  FillPattern(local_.data(), 4096, 0, 5);
  for (const absl::Status& s :
       Move(*view, OpCode::kWrite, 0, 4096, 1, absl::InfinitePast())) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(remote_[i], 0) << i;
}

TEST_F(ShmTransportTest, AnotherHostIsNotReached) {
  descriptor::TransportEndpoint ep = endpoint_;
  ep.mutable_shm()->set_host("another-boot-id/pid:1");
  auto view = View(ep);
  ASSERT_NE(view, nullptr);
  EXPECT_FALSE(initiator_->CanReach(*view));
  EXPECT_EQ(initiator_->Stats().connects_started, 0u);  // Not even tried.
}

// An endpoint whose pid or token does not check out is not attached, and
// not tried again at once.
TEST_F(ShmTransportTest, AWrongTokenIsRefused) {
  descriptor::TransportEndpoint ep = endpoint_;
  std::string token = ep.shm().token();
  token[3] ^= 0x40;
  ep.mutable_shm()->set_token(token);
  auto view = View(ep);
  ASSERT_NE(view, nullptr);
  EXPECT_FALSE(initiator_->CanReach(*view));
  EXPECT_FALSE(initiator_->CanReach(*view));
  TransportStats st = initiator_->Stats();
  EXPECT_EQ(st.connects_started, 1u);
  EXPECT_EQ(st.connect_failures, 1u);
  // Slices sent anyway fail with the reason.
  for (const absl::Status& s : Move(*view, OpCode::kWrite, 0, 4096, 1)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "token")) << s;
  }
}

TEST_F(ShmTransportTest, AnExitedProcessIsNotReached) {
  descriptor::TransportEndpoint ep = endpoint_;
  ep.mutable_shm()->set_pid(4194303);  // Unlikely to exist.
  auto view = View(ep);
  ASSERT_NE(view, nullptr);
  EXPECT_FALSE(initiator_->CanReach(*view));
}

TEST_F(ShmTransportTest, OptionsAreChecked) {
  TransportOptions o;
  o.shm.copy_threads = 0;
  ShmTransport t(o);
  descriptor::TransportEndpoint ep;
  absl::Status s = t.Install(TransportEnv{}, &ep);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "shm.copy_threads")) << s;
}

}  // namespace
}  // namespace ferry::shm
