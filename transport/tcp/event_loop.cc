#include "transport/tcp/event_loop.h"

#include <errno.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry::tcp {
namespace {

constexpr int kMaxEvents = 256;
// On a clock other than the real one, the longest real wait between two
// looks at its time (it may have been advanced meanwhile).
constexpr int kOtherClockPollMs = 1;

}  // namespace

absl::Status EventLoop::Start(TickFn on_tick) {
  epoll_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_.valid()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name_, ": epoll_create1: ", std::strerror(errno)));
  }
  wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_.valid()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name_, ": eventfd: ", std::strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // The wake fd; every other fd has a handler.
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &ev) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name_, ": epoll_ctl: ", std::strerror(errno)));
  }
  on_tick_ = std::move(on_tick);
  stop_.store(false);
  try {
    thread_ = std::thread([this] { Run(); });
  } catch (const std::system_error& e) {
    // A pids limit or memory pressure: fail the caller, never the process.
    return absl::ResourceExhaustedError(
        absl::StrCat(name_, ": cannot start a thread: ", e.what()));
  }
  running_.store(true);
  return absl::OkStatus();
}

void EventLoop::Stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  uint64_t one = 1;
  ssize_t n = ::write(wake_.get(), &one, sizeof(one));
  (void)n;  // EAGAIN: a wake-up is pending anyway.
  thread_.join();
  running_.store(false);
  thread_id_.store(std::thread::id());
  std::vector<absl::AnyInvocable<void()>> dropped;
  {
    MutexLock lock(&mu_);
    dropped.swap(tasks_);
    wake_pending_ = false;
  }
  dropped.clear();
  graveyard_.clear();
}

absl::Status EventLoop::Add(int fd, uint32_t events, Handler* handler) {
  epoll_event ev{};
  ev.events = events;
  ev.data.ptr = handler;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("epoll_ctl(ADD): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status EventLoop::Modify(int fd, uint32_t events, Handler* handler) {
  epoll_event ev{};
  ev.events = events;
  ev.data.ptr = handler;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, fd, &ev) != 0) {
    return absl::InternalError(
        absl::StrCat("epoll_ctl(MOD): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

void EventLoop::Remove(int fd) {
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
}

void EventLoop::DestroyLater(std::unique_ptr<Handler> handler) {
  if (running()) {
    graveyard_.push_back(std::move(handler));
  }  // Else the owner runs the show single-threaded: destroy at once.
}

void EventLoop::TickBy(absl::Time at) {
  if (at < next_tick_) next_tick_ = at;
}

void EventLoop::Post(absl::AnyInvocable<void()> task) {
  {
    MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
    if (wake_pending_) return;  // One eventfd write per batch of posts.
    wake_pending_ = true;
  }
  uint64_t one = 1;
  ssize_t n = ::write(wake_.get(), &one, sizeof(one));
  (void)n;
}

void EventLoop::RunTasks() {
  uint64_t count;
  ssize_t n = ::read(wake_.get(), &count, sizeof(count));
  (void)n;
  std::vector<absl::AnyInvocable<void()>> tasks;
  {
    MutexLock lock(&mu_);
    tasks.swap(tasks_);
    wake_pending_ = false;
  }
  for (auto& task : tasks) task();
}

void EventLoop::Run() {
  thread_id_.store(std::this_thread::get_id());
  epoll_event events[kMaxEvents];
  const bool real_clock = clock_ == RealClock();
  next_tick_ = clock_->Now();
  while (!stop_.load(std::memory_order_relaxed)) {
    const absl::Duration wait = next_tick_ - clock_->Now();
    int timeout_ms = 0;
    if (wait > absl::ZeroDuration()) {
      // Round up: waking a little late is fine, spinning awake is not.
      timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(
          wait + absl::Milliseconds(1) - absl::Nanoseconds(1)));
      if (!real_clock) timeout_ms = std::min(timeout_ms, kOtherClockPollMs);
    }
    // Real time (the kernel's): bounded above on other clocks.
    const int n = ::epoll_wait(epoll_.get(), events, kMaxEvents, timeout_ms);
    if (stop_.load(std::memory_order_relaxed)) break;
    const absl::Time now = clock_->Now();
    for (int i = 0; i < n; ++i) {
      auto* handler = static_cast<Handler*>(events[i].data.ptr);
      if (handler == nullptr) {
        RunTasks();
      } else {
        handler->OnEvents(events[i].events, now);
      }
    }
    const absl::Time after = clock_->Now();
    if (after >= next_tick_) {
      next_tick_ = absl::InfiniteFuture();  // The tick may call TickBy.
      const absl::Time next = after + on_tick_(after);
      if (next < next_tick_) next_tick_ = next;
    }
    graveyard_.clear();
  }
}

}  // namespace ferry::tcp
