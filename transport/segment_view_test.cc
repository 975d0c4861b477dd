#include "transport/segment_view.h"

#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(SegmentViewTest, FindsBuffersAndTransports) {
  metadata::SegmentDescriptor d;
  d.set_name("seg");
  for (uint64_t a : {0x5000, 0x1000, 0x3000}) {
    auto* b = d.add_buffers();
    b->set_addr(a);
    b->set_length(0x1000);
  }
  d.add_transports()->set_transport("tcp");
  auto view = SegmentView::Create(d);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_NE((*view)->FindTransport("tcp"), nullptr);
  EXPECT_EQ((*view)->FindTransport("rdma"), nullptr);
  EXPECT_EQ((*view)->FindBuffer(0x3000, 0x1000)->addr(), 0x3000u);
  EXPECT_EQ((*view)->FindBuffer(0x5fff, 1)->addr(), 0x5000u);
  EXPECT_EQ((*view)->FindBuffer(0x2000, 1), nullptr);
  EXPECT_EQ((*view)->FindBuffer(0xfff, 1), nullptr);
  EXPECT_EQ((*view)->FindBuffer(0x1fff, 2), nullptr);
  EXPECT_EQ((*view)->FindBuffer(0x1000, ~uint64_t{0}), nullptr);
}

TEST(SegmentViewTest, RejectsInvalidDescriptor) {
  metadata::SegmentDescriptor d;
  EXPECT_FALSE(SegmentView::Create(d).ok());  // No name.
}

}  // namespace
}  // namespace ferry
