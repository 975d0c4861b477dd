// How a slice's status crosses threads: the transport's thread makes it and
// hands a copy to the sink; the application's thread reads and drops its
// copies; the transport's thread drops its own last. Each copy is used by
// one thread only, which absl::Status allows, so this must be clean under
// every sanitizer. Under TSan it is the check that bazel/tsan.supp covers
// the refcount drop made inside Debian's uninstrumented libabsl_status (CI
// once failed on exactly this order in tcp_fault_test).
#include <atomic>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "transport/transport.h"

namespace ferry {
namespace {

class CopyingSink : public SliceSink {
 public:
  void OnSliceDone(Slice*, const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    statuses_.push_back(status);
  }
  std::vector<absl::Status> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(statuses_);
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return statuses_.size();
  }

 private:
  std::mutex mu_;
  std::vector<absl::Status> statuses_;
};

TEST(SliceSinkTest, StatusMadeOnOneThreadDroppedLastOnIt) {
  constexpr int kSlices = 64;
  CopyingSink sink;
  std::vector<Slice> slices(kSlices);
  for (Slice& s : slices) s.sink = &sink;
  // Relaxed on purpose: nothing TSan can see orders the transport's drop
  // after the application's, as in the transports (their threads never
  // wait for the application).
  std::atomic<bool> dropped{false};
  std::thread transport([&] {
    const absl::Status gone = absl::UnavailableError("peer gone");
    for (Slice& s : slices) s.Complete(gone);  // One rep, many copies.
    for (int i = 0; i < 10'000'000 && !dropped.load(std::memory_order_relaxed);
         ++i) {
      std::this_thread::yield();
    }
  });  // `gone` is freed here, by the last reference.
  for (int i = 0; i < 10'000'000 && sink.size() < kSlices; ++i) {
    std::this_thread::yield();
  }
  {
    std::vector<absl::Status> got = sink.Take();
    EXPECT_EQ(got.size(), kSlices);
    std::vector<absl::Status> copies = got;  // The application's own refs.
    for (const absl::Status& s : copies) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_EQ(s.message(), "peer gone") << s;
    }
  }
  dropped.store(true, std::memory_order_relaxed);
  transport.join();
}

}  // namespace
}  // namespace ferry
