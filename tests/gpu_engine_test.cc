// The engine moving GPU memory on the emulators, over RDMA (softrnic's two
// NICs; buffers registered through dma-bufs) and over TCP (staged through
// pinned host buffers on both sides): two engines in one process, buffers
// in different emulated GPUs' memory (softgpu) or in host memory. READs
// and WRITEs go GPU to GPU, host to GPU and GPU to host, and the driver's
// own copies verify every byte (the CPU cannot touch device memory: a
// transport that tried would crash the test).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/pattern.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gpu/cuda_driver.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"

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
  ~DeviceBuffer() { Free(); }
  // Gives the memory back to the driver now (as an application may while
  // it is still registered).
  void Free() {
    if (ptr_ != 0)
      EXPECT_OK(Driver().Check(Driver().api().cuMemFree(ptr_), "cuMemFree"));
    ptr_ = 0;
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

// Where a test's buffers live: device memory of a GPU, or host memory.
class TestBuffer {
 public:
  TestBuffer(int device, size_t bytes) {
    if (device >= 0) {
      gpu_ = std::make_unique<DeviceBuffer>(device, bytes);
    } else {
      host_.resize(bytes);
    }
  }
  uint8_t* get() const { return gpu_ ? gpu_->get() : host_ptr(); }
  void Fill(size_t off, size_t len, uint64_t seed) {
    if (gpu_) return gpu_->Fill(off, len, seed);
    FillPattern(host_ptr() + off, len, off, seed);
  }
  size_t Check(size_t off, size_t len, uint64_t seed) {
    if (gpu_) return gpu_->Check(off, len, seed);
    return CheckPattern(host_ptr() + off, len, off, seed);
  }

 private:
  uint8_t* host_ptr() const { return const_cast<uint8_t*>(host_.data()); }
  std::unique_ptr<DeviceBuffer> gpu_;
  std::vector<uint8_t> host_;
};

struct Case {
  const char* transport;
  int local_device;            // -1: host memory.
  int remote_device;           // -1: host memory.
  int staging_buffers;         // The initiator's.
  int target_staging_buffers;  // The target's.
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.transport << " local " << c.local_device << " remote "
      << c.remote_device << " staging " << c.staging_buffers << "/"
      << c.target_staging_buffers;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  auto where = [](int d) {
    return d < 0 ? std::string("Host") : "Gpu" + std::to_string(d);
  };
  std::string name = absl::StrReplaceAll(info.param.transport, {{",", "_"}}) +
                     "_" + where(info.param.local_device) + "_" +
                     where(info.param.remote_device);
  if (info.param.staging_buffers != 8 ||
      info.param.target_staging_buffers != 8) {
    name += "_" + std::to_string(info.param.staging_buffers) + "To" +
            std::to_string(info.param.target_staging_buffers) + "Buffers";
  }
  return name;
}

class GpuEngineTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    Driver();
    const Case& c = GetParam();
    remote_ = std::make_unique<TestBuffer>(c.remote_device, kBuffer);
    local_ = std::make_unique<TestBuffer>(c.local_device, kBuffer);
    EngineOptions t;
    t.local_segment_name = "target";
    t.transports = absl::StrSplit(c.transport, ',');
    t.transfer_timeout = absl::Seconds(20);
    t.tcp.staging_buffers = c.target_staging_buffers;
    ASSERT_OK(target_.Init(t));
    EngineOptions i = t;
    i.tcp.staging_buffers = c.staging_buffers;
    i.rdma.staging_buffers = c.staging_buffers;
    i.shm.staging_buffers = c.staging_buffers;
    if (c.target_staging_buffers == 1) {
      // Many requests in a row on one connection: the target's session
      // reads several before it answers one, so they wait for its buffer.
      i.tcp.max_slice_bytes = 256 << 10;
      i.tcp.connections_per_peer = 1;
    }
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
    r.target_offset = reinterpret_cast<uint64_t>(remote_->get()) + off;
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
  std::unique_ptr<TestBuffer> remote_, local_;
  TransferEngine target_, initiator_;
  SegmentHandle seg_ = 0;
};

TEST_P(GpuEngineTest, ReadAndWriteEveryByteVerified) {
  // Up to three 4 MiB slices (TCP's default max_slice_bytes): more slices
  // than staging buffers where the case has one.
  const size_t sizes[] = {1,       4095,          65537,
                          1 << 20, (3 << 20) + 5, (9 << 20) / 2};
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
  // Staged where the path cannot reach device memory: TCP always, RDMA
  // where the NICs cannot register it (no GPUDirect), shm into the peer's
  // host memory (into its GPU memory the GPU copies, through CUDA IPC).
  const bool gpudirect = *Driver().DmaBufSupported(0);
  const std::string transport = GetParam().transport;
  const bool staged =
      GetParam().local_device >= 0 &&
      (transport == "tcp" || (transport == "rdma" && !gpudirect) ||
       (transport == "shm,tcp" && GetParam().remote_device < 0));
  TransportStats st;
  for (const TransportStats& t : initiator_.GetTransportStats()) {
    st.staged_slices += t.staged_slices;
    st.staging_copy_bytes += t.staging_copy_bytes;
  }
  EXPECT_EQ(st.staged_slices > 0, staged) << st.staged_slices;
  EXPECT_EQ(st.staging_copy_bytes > 0, staged) << st.staging_copy_bytes;
  // shm reaches all of it, host and GPU memory; TCP stays idle.
  if (transport == "shm,tcp") {
    const std::vector<TransportStats> all = initiator_.GetTransportStats();
    EXPECT_GT(all[0].nics[0].bytes, 0u);
    EXPECT_EQ(all[1].nics[0].bytes, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transports, GpuEngineTest,
    // The last two: slices wait for the initiator's one buffer; frames
    // wait for the target's one buffer (two connections, so they contend).
    ::testing::Values(Case{"rdma", 0, 1, 8, 8}, Case{"rdma", -1, 1, 8, 8},
                      Case{"rdma", 0, -1, 8, 8}, Case{"tcp", 0, 1, 8, 8},
                      Case{"tcp", -1, 1, 8, 8}, Case{"tcp", 0, -1, 8, 8},
                      Case{"tcp", 0, 1, 1, 8}, Case{"tcp", 0, 1, 8, 1},
                      Case{"shm,tcp", 0, -1, 8, 8},
                      Case{"shm,tcp", -1, 1, 8, 8},
                      Case{"shm,tcp", 0, 1, 8, 8}),
    CaseName);

// A driver that cannot export dma-bufs and no nvidia-peermem (softgpu with
// FERRY_SOFTGPU_DMABUF=0; the gpu_engine_no_gpudirect_test target): the
// RDMA transport stages this engine's GPU memory through pinned host
// buffers, registered as host memory; 8 of them, or 1 for which slices
// wait.
INSTANTIATE_TEST_SUITE_P(NoGpuDirect, GpuEngineTest,
                         ::testing::Values(Case{"rdma", 0, -1, 8, 8},
                                           Case{"rdma", 0, -1, 1, 8}),
                         CaseName);

// The target's GPU memory in another process on this host, over shm: the
// initiator opens the driver's IPC handle once and copies with the GPU,
// from host memory and from its own GPU memory; TCP stays idle and nothing
// is staged. An unregistered buffer is then never touched.
TEST(GpuShmIpcTest, AnotherProcesssGpuMemoryOverCudaIpc) {
  constexpr size_t kBytes = 4 << 20;
  Driver();  // softgpu; FERRY_CUDA_LIBRARY is inherited by the peer.
  TransferEngine engine;
  EngineOptions o;
  o.local_segment_name = "initiator";
  o.transports = {"shm", "tcp"};
  ASSERT_OK(engine.Init(o));
  auto peer = testing::Subprocess::Start(
      {testing::RunfilePath("tests/engine_peer"), "--name=peer",
       absl::StrCat("--metadata=", engine.metadata_address()),
       absl::StrCat("--buffer_size=", kBytes), "--transport=shm,tcp", "--gpu=1",
       "--seed=3"});
  ASSERT_OK(peer);
  auto ready = (*peer)->ReadLine(absl::Seconds(30));
  ASSERT_OK(ready);
  std::vector<std::string> parts = absl::StrSplit(*ready, ' ');
  ASSERT_EQ(parts[0], "READY") << *ready;
  const uint64_t remote = std::stoull(parts[1]);
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, engine.OpenSegment("peer"));
  TestBuffer host(-1, kBytes), device(0, kBytes);
  ASSERT_OK(engine.RegisterLocalMemory(host.get(), kBytes));
  ASSERT_OK(engine.RegisterLocalMemory(device.get(), kBytes));
  auto run = [&](OpCode op, uint8_t* local) {
    TransferRequest r;
    r.opcode = op;
    r.source = local;
    r.target_id = seg;
    r.target_offset = remote;
    r.length = kBytes;
    auto batch = engine.AllocateBatch(1);
    EXPECT_OK(batch);
    EXPECT_OK(engine.SubmitTransfer(*batch, {r}));
    auto st = engine.WaitBatch(*batch, absl::Seconds(30));
    EXPECT_OK(st);
    EXPECT_OK(engine.FreeBatch(*batch));
    return st.ok() ? *st : BatchStatus{};
  };
  BatchStatus st = run(OpCode::kRead, host.get());
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(host.Check(0, kBytes, 3), kBytes);
  device.Fill(0, kBytes, 21);
  st = run(OpCode::kWrite, device.get());
  ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
  EXPECT_EQ(*(*peer)->Ask(absl::StrCat("check 0 ", kBytes, " 21")), "OK");
  std::vector<TransportStats> stats = engine.GetTransportStats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].nics[0].bytes, 2 * kBytes);
  EXPECT_EQ(stats[0].staged_slices, 0u);
  EXPECT_EQ(stats[1].nics[0].bytes, 0u);

  ASSERT_EQ(*(*peer)->Ask("unregister"), "OK");
  device.Fill(0, kBytes, 22);
  st = run(OpCode::kWrite, device.get());
  EXPECT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(*(*peer)->Ask(absl::StrCat("check 0 ", kBytes, " 21")), "OK");
}

// A target stages GPU memory through buffers of its own max_slice_bytes:
// a longer frame is refused with what to change, and moves nothing.
TEST(GpuEngineErrorsTest, TcpFrameLongerThanTheTargetsStagingBuffers) {
  DeviceBuffer remote(1, 4 << 20), local(0, 4 << 20);
  remote.Fill(0, 4 << 20, 5);
  local.Fill(0, 4 << 20, 6);
  TransferEngine target, initiator;
  EngineOptions t;
  t.local_segment_name = "small-staging";
  t.transports = {"tcp"};
  t.tcp.max_slice_bytes = 1 << 20;
  ASSERT_OK(target.Init(t));
  EngineOptions i;
  i.local_segment_name = "big-slices";
  i.transports = {"tcp"};
  i.metadata_endpoint = target.metadata_address();
  ASSERT_OK(initiator.Init(i));
  ASSERT_OK(target.RegisterLocalMemory(remote.get(), 4 << 20));
  ASSERT_OK(initiator.RegisterLocalMemory(local.get(), 4 << 20));
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg,
                       initiator.OpenSegment(t.local_segment_name));
  TransferRequest r;
  r.opcode = OpCode::kRead;
  r.source = local.get();
  r.target_id = seg;
  r.target_offset = remote.ptr();
  r.length = 2 << 20;
  ASSERT_OK_AND_ASSIGN(BatchId batch, initiator.AllocateBatch(1));
  ASSERT_OK(initiator.SubmitTransfer(batch, {r}));
  ASSERT_OK_AND_ASSIGN(BatchStatus st,
                       initiator.WaitBatch(batch, absl::Seconds(30)));
  EXPECT_EQ(st.state, TransferState::kFailed);
  EXPECT_NE(st.first_error.message().find("max_slice_bytes"), std::string::npos)
      << st.first_error;
  EXPECT_OK(initiator.FreeBatch(batch));
  EXPECT_EQ(local.Check(0, 2 << 20, 6), size_t{2} << 20);  // Untouched.
}

// Two engines in one process on `transport` (a comma-separated list, in
// order of preference), each with one buffer of `bytes` registered, the
// target's remote-accessible (both in GPU memory).
class GpuPair {
 public:
  GpuPair(const std::string& transport, size_t mr_cache_bytes)
      : transport_(absl::StrReplaceAll(transport, {{",", "-"}})) {
    EngineOptions t;
    t.local_segment_name = "freed-target-" + transport_;
    t.transports = absl::StrSplit(transport, ',');
    t.transfer_timeout = absl::Seconds(20);
    EXPECT_OK(target.Init(t));
    EngineOptions i = t;
    i.local_segment_name = "freed-initiator-" + transport_;
    i.metadata_endpoint = target.metadata_address();
    i.mr_cache_bytes = mr_cache_bytes;
    EXPECT_OK(initiator.Init(i));
  }

  // One request from `source` to `remote`, run to its end; its status.
  absl::Status Run(OpCode op, uint8_t* source, CUdeviceptr remote,
                   size_t length) {
    auto seg = initiator.OpenSegment("freed-target-" + transport_);
    if (!seg.ok()) return seg.status();
    TransferRequest r;
    r.opcode = op;
    r.source = source;
    r.target_id = *seg;
    r.target_offset = remote;
    r.length = length;
    auto batch = initiator.AllocateBatch(1);
    if (!batch.ok()) return batch.status();
    absl::Status s = initiator.SubmitTransfer(*batch, {r});
    if (s.ok()) {
      auto st = initiator.WaitBatch(*batch, absl::Seconds(30));
      s = !st.ok()                                 ? st.status()
          : st->state == TransferState::kCompleted ? absl::OkStatus()
                                                   : st->first_error;
    }
    EXPECT_OK(initiator.FreeBatch(*batch));
    return s;
  }

  TransferEngine target, initiator;

 private:
  std::string transport_;
};

class GpuFreedTest : public ::testing::TestWithParam<std::string> {};

// The MR cache registers GPU memory on first use as the driver's whole
// allocation. An allocation freed and replaced (at the same address or
// not) is noticed: its registration goes, the new one is registered, and
// the bytes that move are the new allocation's.
TEST_P(GpuFreedTest, MrCacheRegistersGpuMemoryAndNoticesItFreed) {
  constexpr size_t kBytes = 1 << 20;
  DeviceBuffer remote(1, kBytes);
  auto first = std::make_unique<DeviceBuffer>(0, kBytes);
  GpuPair p(GetParam(), 64 << 20);
  ASSERT_OK(p.target.RegisterLocalMemory(remote.get(), kBytes));
  first->Fill(0, kBytes, 21);
  // Never registered by the application.
  ASSERT_OK(
      p.Run(OpCode::kWrite, first->get() + 4096, remote.ptr() + 4096, 65536));
  EXPECT_EQ(remote.Check(4096, 65536, 21), 65536u);
  EngineStats st = p.initiator.GetEngineStats();
  EXPECT_EQ(st.mr_cache_registrations, 1u);
  EXPECT_EQ(st.mr_cache_bytes, kBytes);  // The allocation, not the request.
  EXPECT_EQ(st.mr_cache_invalidations, 0u);

  uint8_t* const was = first->get();
  first->Free();
  DeviceBuffer second(0, kBytes);
  // As NVIDIA's driver does, softgpu gives the address out again, with no
  // munmap the memory hooks could see: only the driver's allocation id
  // tells the cached registration is stale.
  ASSERT_EQ(second.get(), was);
  second.Fill(0, kBytes, 22);
  ASSERT_OK(p.Run(OpCode::kWrite, second.get(), remote.ptr(), kBytes));
  EXPECT_EQ(remote.Check(0, kBytes, 22), kBytes);
  st = p.initiator.GetEngineStats();
  EXPECT_EQ(st.mr_cache_invalidations, 1u);
  EXPECT_EQ(st.mr_cache_registrations, 1u);
  EXPECT_EQ(st.mr_cache_bytes, kBytes);
  // And READs land in it.
  ASSERT_OK(p.Run(OpCode::kRead, second.get(), remote.ptr(), kBytes));
  EXPECT_EQ(second.Check(0, kBytes, 22), kBytes);

  // Freed, with the next allocation elsewhere (another size): the stale
  // registration goes at the miss, not left to hold device memory.
  second.Free();
  DeviceBuffer third(0, kBytes / 2);
  ASSERT_NE(third.get(), was);
  third.Fill(0, kBytes / 2, 23);
  ASSERT_OK(p.Run(OpCode::kWrite, third.get(), remote.ptr(), kBytes / 2));
  EXPECT_EQ(remote.Check(0, kBytes / 2, 23), kBytes / 2);
  st = p.initiator.GetEngineStats();
  EXPECT_EQ(st.mr_cache_invalidations, 2u);
  EXPECT_EQ(st.mr_cache_registrations, 1u);
  EXPECT_EQ(st.mr_cache_bytes, kBytes / 2);
}

// GPU memory the application registered and then freed is refused with
// what happened and what to do, on the initiator before anything moves.
TEST_P(GpuFreedTest, FreedLocalGpuMemoryIsAnError) {
  constexpr size_t kBytes = 1 << 20;
  DeviceBuffer remote(1, kBytes), local(0, kBytes);
  GpuPair p(GetParam(), 0);
  ASSERT_OK(p.target.RegisterLocalMemory(remote.get(), kBytes));
  ASSERT_OK(p.initiator.RegisterLocalMemory(local.get(), kBytes));
  uint8_t* const gone = local.get();
  ASSERT_OK(p.Run(OpCode::kWrite, gone, remote.ptr(), 4096));
  local.Free();
  absl::Status s = p.Run(OpCode::kWrite, gone, remote.ptr(), 4096);
  EXPECT_STATUS(s, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("freed"), std::string::npos) << s;
  EXPECT_NE(s.message().find("Unregister"), std::string::npos) << s;
  // Also once another allocation is at the address.
  DeviceBuffer now(0, kBytes);
  ASSERT_EQ(now.get(), gone);
  s = p.Run(OpCode::kRead, gone, remote.ptr(), 4096);
  EXPECT_STATUS(s, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("another allocation"), std::string::npos) << s;
  ASSERT_OK(p.initiator.UnregisterLocalMemory(gone));
  ASSERT_OK(p.initiator.RegisterLocalMemory(now.get(), kBytes));
  ASSERT_OK(p.Run(OpCode::kRead, now.get(), remote.ptr(), 4096));
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuFreedTest,
                         ::testing::Values("rdma", "tcp"));

// A TCP target copies into its GPU memory itself: a peer's frame to an
// allocation the target freed under its registration is refused there
// (the copy would land in whatever is now at that address).
TEST(GpuEngineErrorsTest, TcpTargetRefusesFramesToFreedGpuMemory) {
  constexpr size_t kBytes = 1 << 20;
  DeviceBuffer remote(1, kBytes), local(0, kBytes);
  GpuPair p("tcp", 0);
  ASSERT_OK(p.target.RegisterLocalMemory(remote.get(), kBytes));
  ASSERT_OK(p.initiator.RegisterLocalMemory(local.get(), kBytes));
  const CUdeviceptr gone = remote.ptr();
  ASSERT_OK(p.Run(OpCode::kWrite, local.get(), gone, 4096));
  remote.Free();
  // Another allocation where the registered one was: it must not be hit.
  DeviceBuffer now(1, kBytes);
  ASSERT_EQ(now.ptr(), gone);
  now.Fill(0, kBytes, 31);
  local.Fill(0, kBytes, 32);
  for (OpCode op : {OpCode::kWrite, OpCode::kRead}) {
    absl::Status s = p.Run(op, local.get(), gone, 4096);
    EXPECT_STATUS(s, absl::StatusCode::kInternal);
    EXPECT_NE(s.message().find("GPU memory there"), std::string::npos) << s;
  }
  EXPECT_EQ(now.Check(0, kBytes, 31), kBytes);
  EXPECT_EQ(local.Check(0, kBytes, 32), kBytes);
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

// Peers cannot READ or WRITE staged GPU memory over RDMA (only this
// engine's transfers are staged): the error says why and what reaches it.
TEST(NoGpuDirectErrorsTest, PeersCannotReachStagedGpuMemoryOverRdma) {
  ASSERT_FALSE(*Driver().DmaBufSupported(1)) << "needs FERRY_SOFTGPU_DMABUF=0";
  DeviceBuffer remote(1, 1 << 20);
  std::vector<uint8_t> local(1 << 20, 1);
  GpuPair p("rdma", 0);
  ASSERT_OK(p.target.RegisterLocalMemory(remote.get(), 1 << 20));
  ASSERT_OK(p.initiator.RegisterLocalMemory(local.data(), 1 << 20));
  for (OpCode op : {OpCode::kWrite, OpCode::kRead}) {
    absl::Status s = p.Run(op, local.data(), remote.ptr(), 4096);
    EXPECT_STATUS(s, absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("no RDMA key"), std::string::npos) << s;
    EXPECT_NE(s.message().find("TCP"), std::string::npos) << s;
  }
}

// Engines that run tcp beside rdma reach such memory over TCP, per buffer:
// the target's host memory stays on RDMA.
TEST(NoGpuDirectErrorsTest, PeersRunningTcpTooReachStagedGpuMemoryOverTcp) {
  ASSERT_FALSE(*Driver().DmaBufSupported(1)) << "needs FERRY_SOFTGPU_DMABUF=0";
  constexpr size_t kBytes = 1 << 20;
  DeviceBuffer remote(1, kBytes);
  std::vector<uint8_t> host_remote(kBytes, 0);
  std::vector<uint8_t> local(kBytes);
  GpuPair p("rdma,tcp", 0);
  ASSERT_OK(p.target.RegisterLocalMemory(remote.get(), kBytes));
  ASSERT_OK(p.target.RegisterLocalMemory(host_remote.data(), kBytes));
  ASSERT_OK(p.initiator.RegisterLocalMemory(local.data(), kBytes));
  for (size_t i = 0; i < kBytes; ++i) local[i] = static_cast<uint8_t>(i * 7);
  const auto host_addr = reinterpret_cast<CUdeviceptr>(host_remote.data());
  // Slices each transport of the initiator moved.
  auto slices = [&](const char* name) {
    uint64_t n = 0;
    for (const TransportStats& t : p.initiator.GetTransportStats()) {
      if (t.transport != name) continue;
      for (const NicStats& nic : t.nics) n += nic.slices;
    }
    return n;
  };
  ASSERT_OK(p.Run(OpCode::kWrite, local.data(), remote.ptr(), kBytes));
  const uint64_t rdma_before = slices("rdma");
  EXPECT_GT(slices("tcp"), 0u);
  std::fill(local.begin(), local.end(), 0);
  ASSERT_OK(p.Run(OpCode::kRead, local.data(), remote.ptr(), kBytes));
  for (size_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(local[i], static_cast<uint8_t>(i * 7)) << "byte " << i;
  }
  EXPECT_EQ(slices("rdma"), rdma_before);
  // Host memory of the same segment: RDMA.
  ASSERT_OK(p.Run(OpCode::kWrite, local.data(), host_addr, kBytes));
  EXPECT_GT(slices("rdma"), rdma_before);
  EXPECT_EQ(host_remote, local);
}

// rdma.gpu_staging = false: registration fails, saying what is missing.
TEST(NoGpuDirectErrorsTest, WithoutStagingRegistrationSaysWhatIsMissing) {
  ASSERT_FALSE(*Driver().DmaBufSupported(0)) << "needs FERRY_SOFTGPU_DMABUF=0";
  DeviceBuffer buf(0, 1 << 20);
  TransferEngine engine;
  EngineOptions o;
  o.local_segment_name = "no-staging";
  o.transports = {"rdma"};
  o.rdma.gpu_staging = false;
  ASSERT_OK(engine.Init(o));
  absl::Status s = engine.RegisterLocalMemory(buf.get(), 1 << 20);
  EXPECT_STATUS(s, absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("nvidia-peermem"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rdma.gpu_staging"), std::string::npos) << s;
}

}  // namespace
}  // namespace ferry
