// PinnedPool and CopyQueue on softgpu: the pool's bound, copies that land
// (checked through the driver's own synchronous copies), callbacks in
// order, and a stopped queue that cancels instead of hanging.
#include "gpu/staging.h"

#include <cstring>
#include <vector>

#include "common/mutex.h"
#include "common/status_testing.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"

namespace ferry::gpu {
namespace {

TEST(PinnedPoolTest, HandsOutAtMostItsBuffersAndTakesThemBack) {
  const CudaDriver& d = SoftgpuDriver();
  PinnedPool pool(&d, 2, 8192);
  ASSERT_OK_AND_ASSIGN(uint8_t * a, pool.TryAcquire());
  ASSERT_OK_AND_ASSIGN(uint8_t * b, pool.TryAcquire());
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  std::memset(a, 1, 8192);  // Host memory: the CPU may write it.
  ASSERT_OK_AND_ASSIGN(uint8_t * c, pool.TryAcquire());
  EXPECT_EQ(c, nullptr);
  EXPECT_EQ(pool.in_use(), 2u);
  pool.Release(a);
  ASSERT_OK_AND_ASSIGN(c, pool.TryAcquire());
  EXPECT_EQ(c, a);
  pool.Release(b);
  pool.Release(c);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(CopyQueueTest, CopiesLandAndCallbacksRunInOrder) {
  const CudaDriver& d = SoftgpuDriver();
  ASSERT_OK(d.UseDevice(0));
  constexpr size_t kBytes = 1 << 20;
  CUdeviceptr dev = 0;
  ASSERT_OK(d.Check(d.api().cuMemAlloc(&dev, kBytes), "cuMemAlloc"));
  PinnedPool pool(&d, 2, kBytes);
  ASSERT_OK_AND_ASSIGN(uint8_t * in, pool.TryAcquire());
  ASSERT_OK_AND_ASSIGN(uint8_t * out, pool.TryAcquire());
  for (size_t i = 0; i < kBytes; ++i) in[i] = static_cast<uint8_t>(i * 7);
  std::memset(out, 0, kBytes);

  CopyQueue q(&d, 2);
  ASSERT_OK(q.Start());
  Mutex mu;
  CondVar cv;
  std::vector<int> order;
  std::vector<absl::Status> statuses;
  auto record = [&](int step) {
    return [&, step](const absl::Status& s) {
      MutexLock lock(&mu);
      order.push_back(step);
      statuses.push_back(s);
      cv.SignalAll();
    };
  };
  // The READ back depends on the first copy: queued from its callback.
  q.ToDevice(0, dev, in, kBytes, [&](const absl::Status& s) {
    record(1)(s);
    q.FromDevice(0, out, dev, kBytes, record(2));
    q.Post([&] { record(3)(absl::OkStatus()); });
  });
  {
    MutexLock lock(&mu);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (order.size() < 3 && !cv.WaitWithDeadline(&mu, deadline)) {
    }
    ASSERT_EQ(order, (std::vector<int>{1, 2, 3}));
    for (const absl::Status& s : statuses) EXPECT_OK(s);
  }
  EXPECT_EQ(std::memcmp(in, out, kBytes), 0);
  EXPECT_EQ(q.copies(), 2u);
  EXPECT_EQ(q.bytes(), 2 * kBytes);

  // A bad device is the copy's error, not a crash.
  absl::Status bad;
  bool done = false;
  q.ToDevice(7, dev, in, 16, [&](const absl::Status& s) {
    MutexLock lock(&mu);
    bad = s;
    done = true;
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!done && !cv.WaitWithDeadline(&mu, deadline)) {
    }
  }
  EXPECT_STATUS(bad, absl::StatusCode::kInvalidArgument);

  q.Stop();
  absl::Status after;
  q.FromDevice(0, out, dev, 16, [&](const absl::Status& s) { after = s; });
  EXPECT_STATUS(after, absl::StatusCode::kCancelled);  // At once.
  pool.Release(in);
  pool.Release(out);
  ASSERT_OK(d.Check(d.api().cuMemFree(dev), "cuMemFree"));
}

}  // namespace
}  // namespace ferry::gpu
