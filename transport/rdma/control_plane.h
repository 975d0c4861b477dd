// ControlPlane: the RDMA transport's control threads and its
// housekeeper. The control threads take jobs from a ControlQueue (which
// decides what runs next) and hand each to a runner -- RailLifecycle's
// RunJob: handshakes, notices, closes, failures, deferred posts. The
// housekeeper runs a sweep every kHousekeepingInterval on the engine's
// clock (a simulated clock drives it) while the sweep says it has timed
// work, and every kIdleHousekeepingInterval (at most) otherwise.
//
// Only threads live here: what a job or a sweep does, and what runs
// next, are RailLifecycle's and ControlQueue's, each tested without
// threads. Start, BeginFarewell and Stop are called by the transport's
// lifecycle (one thread); threads() from any.
#ifndef FERRY_TRANSPORT_RDMA_CONTROL_PLANE_H_
#define FERRY_TRANSPORT_RDMA_CONTROL_PLANE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "transport/rdma/control_queue.h"

namespace ferry::rdma {

class ControlPlane {
 public:
  // Control threads: a silent peer holds one for up to the RPC timeout
  // per handshake, so four silent peers at once delay others' handshakes
  // by up to that.
  static constexpr int kControlThreads = 4;
  static constexpr absl::Duration kHousekeepingInterval =
      absl::Milliseconds(50);
  // An engine with nothing timed -- no slice on an endpoint, no handshake,
  // only idle connections to probe now and then -- is swept this often:
  // a process with a thousand idle engines spent most of a core on 50 ms
  // sweeps (bench/storm_bench). A slice submitted meanwhile is at most
  // this late to its deadline.
  static constexpr absl::Duration kIdleHousekeepingInterval =
      absl::Milliseconds(250);

  using JobRunner = std::function<void(const ControlJob& job)>;
  // One sweep at `now_ns`; returns how soon the next is due (clamped to
  // [kHousekeepingInterval, kIdleHousekeepingInterval]; zero: busy).
  using Sweep = std::function<absl::Duration(int64_t now_ns)>;

  // `queue` outlives this object.
  explicit ControlPlane(ControlQueue* queue) : queue_(queue) {}
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;
  // Stops the threads if Stop was not called.
  ~ControlPlane();

  // Starts kControlThreads threads running `run` on each job and the
  // housekeeper running `sweep`, all reading `clock`. On failure (a pids
  // limit) the threads that did start run until Stop.
  absl::Status Start(Clock* clock, JobRunner run, Sweep sweep);
  // Shutdown: from now on only notices run, until `deadline` (see
  // ControlQueue::BeginFarewell).
  void BeginFarewell(absl::Time deadline) { queue_->BeginFarewell(deadline); }
  // Waits for the control threads to leave (after a finite farewell) and
  // stops the housekeeper. Idempotent.
  void Stop();
  // Threads running.
  int threads() const;
  // A submission to an engine whose housekeeper sleeps its idle interval:
  // sweep now, and every kHousekeepingInterval while there is timed work,
  // so a request's deadline is kept within that interval. Cheap when the
  // housekeeper is not idle (one relaxed load). Best effort: a submission
  // racing the end of a sweep that found nothing may wait for the next
  // idle round.
  void WakeIfIdle() {
    if (!idle_.load(std::memory_order_relaxed)) return;
    MutexLock lock(&housekeeper_mu_);
    idle_.store(false, std::memory_order_relaxed);
    woken_ = true;
    housekeeper_cv_.SignalAll();
  }

 private:
  void HousekeeperLoop(Sweep sweep);

  ControlQueue* const queue_;
  Clock* clock_ = RealClock();
  std::vector<std::thread> control_threads_;
  // The housekeeper's timed wait is on clock_, so a simulated clock drives
  // it (an absl::Notification's timeout would be real time).
  Mutex housekeeper_mu_;
  CondVar housekeeper_cv_;
  bool stop_housekeeper_ ABSL_GUARDED_BY(housekeeper_mu_) = false;
  bool woken_ ABSL_GUARDED_BY(housekeeper_mu_) = false;
  // The housekeeper sleeps its idle interval (the last sweep found nothing
  // timed).
  std::atomic<bool> idle_{false};
  std::thread housekeeper_;
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_CONTROL_PLANE_H_
