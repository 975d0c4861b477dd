// EventLoop: one thread, one epoll set. The TCP transport runs a fixed
// number of these (TcpOptions::io_threads per side) and no other thread:
// every socket is non-blocking and belongs to one loop, whose thread is the
// only one that does I/O on it. That is what makes aborting a connection
// safe: when the loop thread closes a socket and fails its slices, no
// syscall anywhere can still be reading or writing their memory.
//
// Handlers (one per fd) and everything they own are touched only by the
// loop thread, or by the owner after Stop() returned. Other threads hand
// work over with Post().
//
// Time: the `now` handlers and ticks get, and when a tick is due, come from
// the loop's Clock. epoll_wait's timeout is real time, which a simulated
// clock does not follow: on any clock but RealClock() the loop looks at
// the clock at least every millisecond, so that a tick due after the test
// advanced time runs within about a millisecond of real time.
#ifndef FERRY_TRANSPORT_TCP_EVENT_LOOP_H_
#define FERRY_TRANSPORT_TCP_EVENT_LOOP_H_

#include <sys/epoll.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "common/socket_util.h"

namespace ferry::tcp {

class EventLoop {
 public:
  class Handler {
   public:
    virtual ~Handler() = default;
    // `events` is the EPOLL* mask that fired.
    virtual void OnEvents(uint32_t events, absl::Time now) = 0;
  };

  // Called on the loop thread when the tick is due; returns the delay to
  // the next tick (the loop sleeps at most that long).
  using TickFn = absl::AnyInvocable<absl::Duration(absl::Time now)>;

  // `clock` must outlive the loop.
  EventLoop(std::string name, Clock* clock)
      : name_(std::move(name)), clock_(clock) {}
  ~EventLoop() { Stop(); }
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Creates the epoll set and starts the thread. ResourceExhausted if the
  // system refuses a descriptor or a thread (never throws).
  absl::Status Start(TickFn on_tick);

  // Stops and joins the thread. Tasks posted and not yet run are destroyed
  // without running; handlers stay registered (their owner closes them).
  // Afterwards the owner may touch everything the loop owned.
  void Stop();

  // Loop thread (or before Start / after Stop). Handler pointers must stay
  // valid until Remove, and, as an event of the current batch may still
  // name them, until the batch ends: destroy them with DestroyLater.
  absl::Status Add(int fd, uint32_t events, Handler* handler);
  absl::Status Modify(int fd, uint32_t events, Handler* handler);
  void Remove(int fd);
  void DestroyLater(std::unique_ptr<Handler> handler);
  // Makes the next tick come no later than `at`.
  void TickBy(absl::Time at);

  // Any thread: runs `task` on the loop thread, soon. Never blocks on the
  // network; dropped (destroyed unrun) if the loop is stopped first.
  void Post(absl::AnyInvocable<void()> task);

  bool InLoopThread() const {
    return std::this_thread::get_id() == thread_id_.load();
  }
  bool running() const { return running_.load(); }
  const std::string& name() const { return name_; }

 private:
  void Run();
  void RunTasks();

  const std::string name_;
  Clock* const clock_;
  UniqueFd epoll_;
  UniqueFd wake_;  // eventfd: Post and Stop wake the thread.
  TickFn on_tick_;
  absl::Time next_tick_ = absl::InfinitePast();      // Loop thread only.
  std::vector<std::unique_ptr<Handler>> graveyard_;  // Loop thread only.
  std::atomic<bool> stop_{false};
  std::atomic<bool> running_{false};
  std::atomic<std::thread::id> thread_id_{};
  std::thread thread_;

  Mutex mu_;
  std::vector<absl::AnyInvocable<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool wake_pending_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_EVENT_LOOP_H_
