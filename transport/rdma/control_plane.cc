#include "transport/rdma/control_plane.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry::rdma {

ControlPlane::~ControlPlane() {
  queue_->BeginFarewell(absl::InfinitePast());
  Stop();
}

absl::Status ControlPlane::Start(Clock* clock, JobRunner run, Sweep sweep) {
  clock_ = clock;
  queue_->SetClock(clock);
  try {
    for (int i = 0; i < kControlThreads; ++i) {
      control_threads_.emplace_back([this, run] {
        while (std::optional<ControlJob> job = queue_->Take()) {
          run(*job);
          queue_->Done(*job);
        }
      });
    }
    housekeeper_ = std::thread(
        [this, sweep = std::move(sweep)] { HousekeeperLoop(sweep); });
  } catch (const std::system_error& e) {
    // A pids limit or memory pressure: the caller fails (its Shutdown
    // joins what did start), the process does not.
    return absl::ResourceExhaustedError(
        absl::StrCat("rdma: cannot start a thread: ", e.what()));
  }
  return absl::OkStatus();
}

void ControlPlane::Stop() {
  for (auto& t : control_threads_) t.join();
  control_threads_.clear();
  {
    MutexLock lock(&housekeeper_mu_);
    stop_housekeeper_ = true;
    housekeeper_cv_.SignalAll();
  }
  if (housekeeper_.joinable()) housekeeper_.join();
}

int ControlPlane::threads() const {
  return static_cast<int>(control_threads_.size()) +
         (housekeeper_.joinable() ? 1 : 0);
}

void ControlPlane::HousekeeperLoop(Sweep sweep) {
  absl::Duration interval = kHousekeepingInterval;
  while (true) {
    {
      MutexLock lock(&housekeeper_mu_);
      const absl::Time next = clock_->Now() + interval;
      while (
          !stop_housekeeper_ && !woken_ &&
          !clock_->WaitWithDeadline(&housekeeper_cv_, &housekeeper_mu_, next)) {
      }
      if (stop_housekeeper_) return;
      woken_ = false;
    }
    interval = std::clamp(sweep(clock_->NowNanos()), kHousekeepingInterval,
                          kIdleHousekeepingInterval);
    idle_.store(interval > kHousekeepingInterval, std::memory_order_relaxed);
  }
}

}  // namespace ferry::rdma
