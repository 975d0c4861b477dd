#include "transport/rdma/completions.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry::rdma {
namespace {

constexpr int kPollBatch = 64;
// While application threads reap completions themselves, the worker
// checks back this often (and otherwise keeps off the CQ).
constexpr int64_t kDeferUs = 200;
// Upper bound of an idle worker's sleep; completions, port events and
// Stop wake it earlier. Not shorter: an engine's idle worker must cost
// next to nothing (a process with a thousand engines, bench/storm_bench,
// spent half a core waking them every 100 ms).
constexpr int64_t kIdleSleepUs = 1'000'000;

}  // namespace

Completions::Completions(CompletionHandler* handler, Options options)
    : handler_(handler), options_(std::move(options)) {}

Completions::~Completions() { Close(); }

void Completions::AddNic(Nic* nic) {
  auto n = std::make_unique<PerNic>();
  n->nic = nic;
  n->index = static_cast<int>(nics_.size());
  nics_.push_back(std::move(n));
}

absl::Status Completions::Start() {
  // One worker per NIC, or fewer serving the NICs round robin.
  const size_t threads =
      options_.worker_threads > 0
          ? std::min<size_t>(options_.worker_threads, nics_.size())
          : nics_.size();
  for (size_t t = 0; t < threads; ++t) {
    auto w = std::make_unique<Worker>();
    w->index = static_cast<int>(t);
    w->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (w->wake_fd < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("eventfd: ", std::strerror(errno)));
    }
    for (size_t i = t; i < nics_.size(); i += threads) {
      w->nics.push_back(nics_[i].get());
    }
    workers_.push_back(std::move(w));
  }
  try {
    for (auto& w : workers_) {
      Worker* raw = w.get();
      w->thread = std::thread([this, raw] { WorkerLoop(raw); });
      ++started_;
    }
  } catch (const std::system_error& e) {
    // A pids limit or memory pressure: the caller fails (Stop joins what
    // did start), the process does not.
    return absl::ResourceExhaustedError(
        absl::StrCat("rdma: cannot start a thread: ", e.what()));
  }
  return absl::OkStatus();
}

void Completions::Stop() {
  stopping_.store(true, std::memory_order_release);
  for (auto& w : workers_) {
    if (!w->thread.joinable()) continue;
    uint64_t one = 1;
    ssize_t n = ::write(w->wake_fd, &one, sizeof(one));
    (void)n;
    w->thread.join();
  }
}

void Completions::Close() {
  Stop();
  for (auto& w : workers_) {
    if (w->wake_fd >= 0) ::close(w->wake_fd);
  }
  workers_.clear();
  nics_.clear();
}

size_t Completions::Poll() {
  driver_epoch_.fetch_add(1, std::memory_order_relaxed);
  size_t n = 0;
  for (auto& p : nics_) {
    if (p->nic == nullptr || !p->poll_mu.TryLock()) continue;  // Busy.
    n += PollNicLocked(p.get());
    p->poll_mu.Unlock();
  }
  return n;
}

size_t Completions::PollNicLocked(PerNic* p) {
  if (p->nic->fatal()) return 0;
  ibv_wc wcs[kPollBatch];
  const int n = ibv_poll_cq(p->nic->cq(), kPollBatch, wcs);
  if (n > 0) p->nic->completions.fetch_add(n, std::memory_order_relaxed);
  for (int i = 0; i < n; ++i) {
    QpRef ref;
    {
      MutexLock lock(&p->map_mu);
      auto it = p->by_qpn.find(wcs[i].qp_num);
      if (it == p->by_qpn.end()) continue;  // A QP we already let go of.
      ref = it->second;
    }
    handler_->OnCompletion(ref, wcs[i]);
  }
  // Completions freed WR budget on this NIC: post what waited for it.
  if (p->any_parked.load(std::memory_order_acquire)) {
    for (auto& ep : TakeParked(p->index)) handler_->PostParked(ep);
  }
  return n > 0 ? static_cast<size_t>(n) : 0;
}

void Completions::Track(int nic, uint32_t qpn, QpRef ref) {
  PerNic* p = nics_[nic].get();
  MutexLock lock(&p->map_mu);
  p->by_qpn[qpn] = std::move(ref);
}

void Completions::Untrack(int nic, const std::vector<uint32_t>& qpns,
                          const Endpoint& ep) {
  PerNic* p = nics_[nic].get();
  MutexLock lock(&p->map_mu);
  for (uint32_t qpn : qpns) {
    auto it = p->by_qpn.find(qpn);
    if (it != p->by_qpn.end() && it->second.ep.get() == &ep) {
      p->by_qpn.erase(it);
    }
  }
}

void Completions::Park(int nic, std::shared_ptr<Endpoint> ep) {
  PerNic* p = nics_[nic].get();
  MutexLock lock(&p->map_mu);
  p->parked.push_back(std::move(ep));
  p->any_parked.store(true, std::memory_order_release);
}

std::vector<std::shared_ptr<Endpoint>> Completions::TakeParked(int nic) {
  PerNic* p = nics_[nic].get();
  std::vector<std::shared_ptr<Endpoint>> parked;
  MutexLock lock(&p->map_mu);
  parked.swap(p->parked);
  p->any_parked.store(false, std::memory_order_relaxed);
  return parked;
}

std::vector<std::shared_ptr<Endpoint>> Completions::TakeAll() {
  std::vector<std::shared_ptr<Endpoint>> eps;
  for (auto& p : nics_) {
    MutexLock lock(&p->map_mu);
    for (auto& [qpn, ref] : p->by_qpn) eps.push_back(std::move(ref.ep));
    p->by_qpn.clear();
    for (auto& ep : p->parked) eps.push_back(std::move(ep));
    p->parked.clear();
    p->any_parked.store(false, std::memory_order_relaxed);
  }
  return eps;
}

bool Completions::WaitEvents(Worker* w, int64_t timeout_us, bool channels) {
  // Per NIC its completion channel and async event fd, then the wake-up.
  constexpr size_t kMaxFds = 2 * 64 + 1;
  pollfd fds[kMaxFds];
  size_t n = 0;
  for (PerNic* p : w->nics) {
    // A dead device's channel may stay readable forever: not polled.
    const bool live = !p->nic->fatal();
    fds[n++] = {channels && live ? p->nic->channel()->fd : -1, POLLIN, 0};
    fds[n++] = {p->async_dead ? -1 : p->nic->context()->async_fd, POLLIN, 0};
  }
  fds[n++] = {w->wake_fd, POLLIN, 0};
  const timespec ts = {static_cast<time_t>(timeout_us / 1000000),
                       static_cast<long>((timeout_us % 1000000) * 1000)};
  // Real time: a bound on the sleep only (events wake it; nothing timed is
  // decided here).
  if (::ppoll(fds, n, &ts, nullptr) <= 0) return false;
  for (size_t k = 0; k < w->nics.size(); ++k) {
    PerNic* p = w->nics[k];
    Nic* nic = p->nic;
    if (fds[2 * k].revents & POLLIN) {
      ibv_cq* cq;
      void* ctx;
      if (ibv_get_cq_event(nic->channel(), &cq, &ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
      }
    }
    if (fds[2 * k + 1].revents & POLLIN) {
      ibv_async_event ev;
      if (ibv_get_async_event(nic->context(), &ev) == 0) {
        const ibv_event_type type = ev.event_type;
        ibv_ack_async_event(&ev);
        switch (type) {
          case IBV_EVENT_PORT_ERR:
            handler_->OnPortChange(p->index, false);
            break;
          case IBV_EVENT_PORT_ACTIVE:
            handler_->OnPortChange(p->index, true);
            break;
          case IBV_EVENT_DEVICE_FATAL:
            if (!nic->fatal()) handler_->OnDeviceFatal(p->index);
            break;
          case IBV_EVENT_GID_CHANGE:
            // Connections made from now on carry the new GID; existing
            // ones fail if the old address stops working, and are made
            // again.
            nic->RefreshGid();
            break;
          default:
            // QP and CQ events: the completions report those errors.
            break;
        }
      }
    } else if (fds[2 * k + 1].revents & (POLLERR | POLLHUP | POLLNVAL)) {
      p->async_dead = true;  // Never again in the poll set.
    }
  }
  if (fds[n - 1].revents & POLLIN) {
    uint64_t v;
    ssize_t r = ::read(w->wake_fd, &v, sizeof(v));
    (void)r;
  }
  return true;
}

void Completions::WorkerLoop(Worker* w) {
  if (!options_.worker_cpus.empty()) {
    // Pin to the configured core (e.g. one near the NICs' NUMA node).
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(options_.worker_cpus[w->index % options_.worker_cpus.size()], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  auto poll_all = [&] {
    size_t n = 0;
    for (PerNic* p : w->nics) {
      MutexLock lock(&p->poll_mu);
      n += PollNicLocked(p);
    }
    return n;
  };
  int spins = 0;
  uint64_t seen = driver_epoch_.load(std::memory_order_relaxed);
  while (!stopping_.load(std::memory_order_acquire)) {
    const uint64_t epoch = driver_epoch_.load(std::memory_order_relaxed);
    if (epoch != seen) {
      // Application threads reap completions themselves (Poll): polling
      // here as well would bounce every cache line between cores. Check
      // back shortly; port events are still handled.
      seen = epoch;
      spins = 0;
      WaitEvents(w, kDeferUs, /*channels=*/false);
      continue;
    }
    if (poll_all() > 0) {
      spins = 0;
      continue;
    }
    if (++spins < options_.spin_polls) {
      std::this_thread::yield();
      continue;
    }
    spins = 0;
    // Sleep until a completion, a wake-up or a port event. Arm first, then
    // poll once more: a completion between the last poll and arming would
    // otherwise raise no event.
    for (PerNic* p : w->nics) {
      if (!p->nic->fatal()) ibv_req_notify_cq(p->nic->cq(), 0);
    }
    if (poll_all() > 0) continue;
    // Slept the whole bound: nothing is coming, so straight back to sleep
    // (armed, polled once more) without spinning first.
    if (!WaitEvents(w, kIdleSleepUs, /*channels=*/true)) {
      spins = options_.spin_polls;
    }
  }
}

}  // namespace ferry::rdma
