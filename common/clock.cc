#include "common/clock.h"

namespace ferry {
namespace {

// The only place Ferry's production code reads and waits on the system
// clock directly.
class SystemClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  void SleepUntil(absl::Time deadline) override {
    // absl::SleepFor may return early on a signal: sleep again until the
    // deadline has passed.
    for (absl::Time now = absl::Now(); now < deadline; now = absl::Now()) {
      absl::SleepFor(deadline - now);
    }
  }
  bool WaitWithDeadline(CondVar* cv, Mutex* mu, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return cv->WaitWithDeadline(mu, deadline);
  }
};

}  // namespace

Clock* RealClock() {
  static Clock* const clock = new SystemClock();
  return clock;
}

}  // namespace ferry
