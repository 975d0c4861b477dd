// Engines on etcd directly (etcd://, no Ferry metadata service) are pushed
// the changes of the segments they opened, from etcd's Watch API: a buffer
// registered after the open and its unregistration, with no fetch by the
// reader, and a restarted peer's new descriptor.
#include <vector>

#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"
#include "metadata/etcd/etcd_testing.h"

namespace ferry {
namespace {

bool WaitUntil(const std::function<bool()>& pred) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!pred() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  return pred();
}

TEST(EtcdWatchTest, EnginesOnEtcdArePushedChanges) {
  ASSERT_OK_AND_ASSIGN(auto cluster, metadata::EtcdCluster::Start(1));
  EngineOptions o;
  o.metadata_endpoint = cluster->address();
  o.listen_host = "127.0.0.1";
  o.local_segment_name = "target";
  std::vector<uint8_t> remote(4096, 0x42), late(8192, 0x11);
  auto target = std::make_unique<TransferEngine>();
  ASSERT_OK(target->Init(o));
  ASSERT_OK(
      target->RegisterLocalMemory(remote.data(), remote.size(), "cpu:0", true));
  EngineOptions ro = o;
  ro.local_segment_name = "reader";
  TransferEngine reader;
  ASSERT_OK(reader.Init(ro));
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, reader.OpenSegment("target"));
  const uint64_t fetches = reader.GetEngineStats().descriptor_refreshes;
  auto has = [&](const void* p) {
    auto bufs = reader.GetSegmentBuffers(h);
    if (!bufs.ok()) return false;
    for (const RemoteBuffer& r : *bufs) {
      if (r.addr == reinterpret_cast<uint64_t>(p)) return true;
    }
    return false;
  };
  ASSERT_OK(
      target->RegisterLocalMemory(late.data(), late.size(), "cpu:0", true));
  EXPECT_TRUE(WaitUntil([&] { return has(late.data()); }))
      << "the registration was not pushed";
  ASSERT_OK(target->UnregisterLocalMemory(late.data()));
  EXPECT_TRUE(WaitUntil([&] { return !has(late.data()); }))
      << "the unregistration was not pushed";
  EXPECT_GE(reader.GetEngineStats().descriptor_pushes, 2u);
  EXPECT_EQ(reader.GetEngineStats().descriptor_refreshes, fetches)
      << "pushed, not fetched";

  // The target restarts (a new run, a new buffer): pushed whole. (Its
  // removal is pushed as `gone`, which has the reader fetch once too.)
  ASSERT_OK(target->UnregisterLocalMemory(remote.data()));
  EXPECT_TRUE(WaitUntil([&] { return !has(remote.data()); }));
  const uint64_t pushes = reader.GetEngineStats().descriptor_pushes;
  target->Shutdown();
  target = std::make_unique<TransferEngine>();
  ASSERT_OK(target->Init(o));
  ASSERT_OK(
      target->RegisterLocalMemory(late.data(), late.size(), "cpu:0", true));
  EXPECT_TRUE(WaitUntil([&] {
    return has(late.data()) && !has(remote.data());
  })) << "the restarted target's descriptor did not arrive";
  EXPECT_TRUE(WaitUntil([&] {
    return reader.GetEngineStats().descriptor_pushes > pushes;
  })) << "the watch did not go on after the segment went";
  ASSERT_OK(target->UnregisterLocalMemory(late.data()));
}

}  // namespace
}  // namespace ferry
