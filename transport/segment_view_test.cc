#include "transport/segment_view.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(SegmentViewTest, FindsBuffersAndTransports) {
  descriptor::SegmentDescriptor d;
  d.set_name("seg");
  for (uint64_t a : {0x5000, 0x1000, 0x3000}) {
    auto* b = d.add_buffers();
    b->set_addr(a);
    b->set_length(0x1000);
  }
  auto* tcp = d.add_transports();
  tcp->set_transport("tcp");
  tcp->set_address("127.0.0.1:9");
  auto view = SegmentView::Create(d);
  ASSERT_OK(view);
  EXPECT_NE((*view)->FindTransport("tcp"), nullptr);
  EXPECT_EQ((*view)->FindTransport("rdma"), nullptr);
  const SegmentView& v = **view;
  ASSERT_GE(v.FindBufferIndex(0x3000, 0x1000), 0);
  EXPECT_EQ(v.buffer(v.FindBufferIndex(0x3000, 0x1000)).addr(), 0x3000u);
  ASSERT_GE(v.FindBufferIndex(0x5fff, 1), 0);
  EXPECT_EQ(v.buffer(v.FindBufferIndex(0x5fff, 1)).addr(), 0x5000u);
  EXPECT_EQ(v.FindBufferIndex(0x2000, 1), -1);
  EXPECT_EQ(v.FindBufferIndex(0xfff, 1), -1);
  EXPECT_EQ(v.FindBufferIndex(0x1fff, 2), -1);
  EXPECT_EQ(v.FindBufferIndex(0x1000, ~uint64_t{0}), -1);
}

TEST(SegmentViewTest, IndexesDeviceKeysByTransportBufferAndDevice) {
  descriptor::SegmentDescriptor d;
  d.set_name("seg");
  auto* tcp = d.add_transports();
  tcp->set_transport("tcp");
  tcp->set_address("127.0.0.1:9");
  auto* rdma = d.add_transports();
  rdma->set_transport("rdma");
  for (const char* nic : {"mlx5_0", "mlx5_1"}) {
    auto* dev = rdma->add_devices();
    dev->set_name(nic);
    dev->set_gid(std::string(16, '\1'));
  }
  auto* b0 = d.add_buffers();
  b0->set_addr(0x1000);
  b0->set_length(0x1000);
  auto* k = b0->add_keys();
  k->set_nic("mlx5_1");
  k->set_rkey(77);
  auto* b1 = d.add_buffers();
  b1->set_addr(0x3000);
  b1->set_length(0x1000);
  for (uint32_t i = 0; i < 2; ++i) {
    k = b1->add_keys();
    k->set_nic(i == 0 ? "mlx5_0" : "mlx5_1");
    k->set_rkey(100 + i);
  }
  auto view = SegmentView::Create(d);
  ASSERT_OK(view);
  const SegmentView& v = **view;
  ASSERT_EQ(v.FindTransportIndex("rdma"), 1);
  EXPECT_EQ(v.FindTransportIndex("none"), -1);
  ASSERT_EQ(v.FindBufferIndex(0x3800, 16), 1);
  EXPECT_EQ(v.FindBufferIndex(0x2000, 16), -1);
  uint32_t key = 0;
  EXPECT_FALSE(v.DeviceKey(1, 0, 0, &key));  // No key for mlx5_0.
  ASSERT_TRUE(v.DeviceKey(1, 0, 1, &key));
  EXPECT_EQ(key, 77u);
  ASSERT_TRUE(v.DeviceKey(1, 1, 0, &key));
  EXPECT_EQ(key, 100u);
  ASSERT_TRUE(v.DeviceKey(1, 1, 1, &key));
  EXPECT_EQ(key, 101u);
  EXPECT_FALSE(v.DeviceKey(0, 1, 0, &key));  // TCP has no devices.
}

TEST(SegmentViewTest, RejectsInvalidDescriptor) {
  descriptor::SegmentDescriptor d;
  EXPECT_FALSE(SegmentView::Create(d).ok());  // No name.
}

}  // namespace
}  // namespace ferry
