// NIC choice follows the GPU, end to end: an engine on softrnic's two NICs
// and softgpu's two GPUs, with a fake sysfs tree (rdma.sysfs_root) that
// puts each NIC under the PCIe switch of one GPU. softgpu numbers its GPUs
// against PCI order (FERRY_SOFTGPU_DEVICES lists 0000:81:00.0 first), as
// CUDA's default fastest-first order may: a buffer on cuda:N must go out
// through the NIC beside the GPU the driver calls N, every byte of it.
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gpu/cuda_driver.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"
#include "transport/rdma/fake_sysfs_testing.h"

namespace ferry {
namespace {

constexpr size_t kBytes = 8 << 20;

// GPU 0000:01:00.0 and softrnic0 under one switch (NUMA node 0); GPU
// 0000:81:00.0 and softrnic1 under another (node 1).
class FakeSysfs : public rdma::testing::FakeSysfs {
 public:
  FakeSysfs() {
    Device("pci0000:00/0000:00:01.0/0000:01:00.0", "0x030200", "0x10de", 0);
    Device("pci0000:00/0000:00:01.0/0000:01:01.0", "0x020700", "0x15b3", 0);
    Device("pci0000:80/0000:80:01.0/0000:81:00.0", "0x030200", "0x10de", 1);
    Device("pci0000:80/0000:80:01.0/0000:81:01.0", "0x020700", "0x15b3", 1);
    Nic("softrnic0", "pci0000:00/0000:00:01.0/0000:01:01.0");
    Nic("softrnic1", "pci0000:80/0000:80:01.0/0000:81:01.0");
  }
};

const gpu::CudaDriver& Driver() {
  return gpu::SoftgpuDriverWith("0000:81:00.0,0000:01:00.0");
}

uint64_t NicBytes(const TransferEngine& e, const std::string& nic) {
  for (const TransportStats& t : e.GetTransportStats()) {
    for (const NicStats& n : t.nics) {
      if (n.name == nic) return n.bytes;
    }
  }
  return 0;
}

TEST(GpuAffinityTest, ABuffersSlicesGoThroughTheNicBesideItsGpu) {
  ASSERT_EQ(Driver().device_count(), 2);
  ASSERT_OK_AND_ASSIGN(std::string id0, Driver().PciBusId(0));
  ASSERT_EQ(id0, "0000:81:00.0");
  FakeSysfs sysfs;
  std::vector<uint8_t> remote(kBytes, 0);
  TransferEngine target, initiator;
  EngineOptions t;
  t.local_segment_name = "affinity-target";
  t.transports = {"rdma"};
  ASSERT_OK(target.Init(t));
  ASSERT_OK(target.RegisterLocalMemory(remote.data(), kBytes));
  EngineOptions i = t;
  i.local_segment_name = "affinity-initiator";
  i.metadata_endpoint = target.metadata_address();
  i.rdma.sysfs_root = sysfs.root();
  ASSERT_OK(initiator.Init(i));
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg,
                       initiator.OpenSegment("affinity-target"));
  // cuda:0 is 0000:81:00.0 (beside softrnic1), cuda:1 is 0000:01:00.0.
  const char* beside[] = {"softrnic1", "softrnic0"};
  const char* far[] = {"softrnic0", "softrnic1"};
  for (int device = 0; device < 2; ++device) {
    SCOPED_TRACE(device);
    ASSERT_OK(Driver().UseDevice(device));
    CUdeviceptr buf = 0;
    ASSERT_OK(Driver().Check(Driver().api().cuMemAlloc(&buf, kBytes), "alloc"));
    ASSERT_OK(Driver().Check(
        Driver().api().cuMemsetD8(buf, 0x40 + device, kBytes), "memset"));
    ASSERT_OK(
        initiator.RegisterLocalMemory(reinterpret_cast<void*>(buf), kBytes));
    const uint64_t near_before = NicBytes(initiator, beside[device]);
    const uint64_t far_before = NicBytes(initiator, far[device]);
    TransferRequest r;
    r.opcode = OpCode::kWrite;
    r.source = reinterpret_cast<void*>(buf);
    r.target_id = seg;
    r.target_offset = reinterpret_cast<uint64_t>(remote.data());
    r.length = kBytes;
    ASSERT_OK_AND_ASSIGN(BatchId b, initiator.AllocateBatch(1));
    ASSERT_OK(initiator.SubmitTransfer(b, {r}));
    ASSERT_OK_AND_ASSIGN(BatchStatus st,
                         initiator.WaitBatch(b, absl::Seconds(60)));
    ASSERT_EQ(st.state, TransferState::kCompleted) << st.first_error;
    ASSERT_OK(initiator.FreeBatch(b));
    EXPECT_EQ(NicBytes(initiator, beside[device]) - near_before, kBytes);
    EXPECT_EQ(NicBytes(initiator, far[device]) - far_before, 0u);
    EXPECT_EQ(remote[0], 0x40 + device);
    EXPECT_EQ(remote[kBytes - 1], 0x40 + device);
    ASSERT_OK(initiator.UnregisterLocalMemory(reinterpret_cast<void*>(buf)));
    Driver().api().cuMemFree(buf);
  }
}

}  // namespace
}  // namespace ferry
