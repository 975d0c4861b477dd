#include "engine/segment_cache.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/host_info.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "metadata/validation.h"

namespace ferry {
namespace {

// handle = tag (16 bits) | generation (28) | slot + 1 (20). Slots are
// reused oldest-freed first, so a slot's generation wraps only after 2^28
// closes of it, ~2^48 closes in all.
constexpr int kSlotBits = 20;
constexpr uint64_t kSlotMask = (uint64_t{1} << kSlotBits) - 1;
constexpr uint32_t kGenerationMask = (uint32_t{1} << 28) - 1;
// While requests are parked, the refresher looks at their deadlines at
// least this often.
constexpr absl::Duration kDeadlineTick = absl::Milliseconds(10);

}  // namespace

SegmentCache::SegmentCache(metadata::Store* client, uint16_t tag, ReadyFn ready,
                           Clock* clock)
    : client_(client),
      clock_(ClockOrReal(clock)),
      tag_(tag),
      ready_(std::move(ready)) {}

SegmentCache::~SegmentCache() { Stop(); }

absl::Status SegmentCache::Start() {
  try {
    fetcher_ = std::thread([this] { FetcherLoop(); });
    refresher_ = std::thread([this] { RefresherLoop(); });
  } catch (const std::system_error& e) {
    Stop();
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot start the descriptor refresher thread: ", e.what()));
  }
  return absl::OkStatus();
}

void SegmentCache::Stop() {
  std::vector<Delivery> cancelled;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    wake_.SignalAll();
    job_cv_.SignalAll();
  }
  {
    absl::flat_hash_map<std::string, std::unique_ptr<metadata::Watch>> watches;
    {
      MutexLock lock(&mu_);
      watches.swap(watches_);
    }
    watches.clear();  // Outside mu_: their last events may be waiting.
  }
  if (refresher_.joinable()) refresher_.join();
  // Bounded by the RPC timeout of a fetch in flight.
  if (fetcher_.joinable()) fetcher_.join();
  {
    MutexLock lock(&mu_);
    for (auto& e : entries_) {
      for (const Parked& p : e->parked) {
        cancelled.push_back({p.task, e->view,
                             absl::CancelledError("the engine shut down while "
                                                  "the request waited for the "
                                                  "target's descriptor")});
      }
      stats_.parked_now -= e->parked.size();
      e->parked.clear();
    }
  }
  Deliver(&cancelled);
}

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentCache::MakeView(
    descriptor::SegmentDescriptor desc) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentDescriptor(desc));
  FERRY_RETURN_IF_ERROR(descriptor::CheckReachable(desc, NetworkIdentity()));
  return SegmentView::Create(std::move(desc));
}

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentCache::Fetch(
    const std::string& name) {
  auto view = [&]() -> absl::StatusOr<std::shared_ptr<const SegmentView>> {
    auto desc = client_->Get(name);
    if (!desc.ok()) return desc.status();
    return MakeView(std::move(*desc));
  }();
  // An unknown name is the caller's business (OpenSegment says so); the
  // rest is what an operator needs to see: the service unreachable, bad
  // or unreachable descriptors.
  if (!view.ok() && view.status().code() != absl::StatusCode::kNotFound) {
    FERRY_LOG_EVERY(kWarn, "metadata", absl::Seconds(1), "cannot use segment '",
                    name, "': ", view.status().message());
  }
  return view;
}

SegmentHandle SegmentCache::HandleOf(size_t slot) const {
  return (static_cast<uint64_t>(tag_) << 48) |
         (static_cast<uint64_t>(entries_[slot]->generation) << kSlotBits) |
         (slot + 1);
}

absl::StatusOr<size_t> SegmentCache::SlotOf(SegmentHandle handle) const {
  const uint64_t slot_plus_one = handle & kSlotMask;
  const uint32_t generation =
      static_cast<uint32_t>((handle >> kSlotBits) & kGenerationMask);
  if ((handle >> 48) != tag_ || slot_plus_one == 0 ||
      slot_plus_one > entries_.size() || !entries_[slot_plus_one - 1]->in_use ||
      entries_[slot_plus_one - 1]->generation != generation) {
    return absl::NotFoundError(absl::StrCat(
        "segment handle 0x", absl::Hex(handle),
        " is not an open segment of this engine (never returned by "
        "OpenSegment, or closed)"));
  }
  return slot_plus_one - 1;
}

absl::StatusOr<SegmentHandle> SegmentCache::Open(const std::string& name) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  {
    MutexLock lock(&mu_);
    auto it = by_name_.find(name);
    if (it != by_name_.end()) return it->second;
  }
  // Fetch without the lock: a slow metadata server must not block lookups
  // of segments that are already open.
  auto view = Fetch(name);
  if (!view.ok()) return view.status();
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it != by_name_.end()) return it->second;  // Lost a race; same result.
  size_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.front();
    free_slots_.pop_front();
  } else {
    if (entries_.size() >= kMaxSegments) {
      return absl::ResourceExhaustedError(
          absl::StrCat(kMaxSegments, " segments are open; close some first"));
    }
    slot = entries_.size();
    entries_.push_back(std::make_unique<Entry>());
  }
  Entry* e = entries_[slot].get();
  e->name = name;
  e->view = std::move(*view);
  e->in_use = true;
  e->stale = false;
  e->last_fetch = clock_->Now();
  const SegmentHandle handle = HandleOf(slot);
  by_name_[name] = handle;
  ++stats_.open;
  StartWatchLocked(name, e->view);
  return handle;
}

void SegmentCache::StartWatchLocked(const std::string& name,
                                    std::shared_ptr<const SegmentView> view) {
  // The stream's own copy of the descriptor, which its events apply to in
  // order (gRPC delivers one stream's events one at a time).
  auto base = std::make_shared<WatchBase>();
  base->descriptor = view->descriptor();
  auto watch = client_->WatchSegment(
      name, base->descriptor.version(),
      [this, name, base](const metadata::SegmentEvent& ev) {
        OnEvent(name, base.get(), ev);
      });
  // A store that cannot push (P2P, a metadata_server on etcd): refresh on
  // a miss, as before.
  // One per open name: Close ends it before the name can be opened again
  // (a watch must never be destroyed under mu_: its last event may wait
  // for mu_).
  if (watch.ok()) watches_[name] = std::move(*watch);
}

void SegmentCache::MarkStale(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return;
  auto slot = SlotOf(it->second);
  if (!slot.ok()) return;
  entries_[*slot]->stale = true;
  QueueLocked(*slot);
}

void SegmentCache::OnEvent(const std::string& name, WatchBase* base,
                           const metadata::SegmentEvent& ev) {
  if (ev.gone()) {
    // Removed, or its lease ran out: requests fetch again and fail with
    // what the service says.
    MarkStale(name);
    return;
  }
  // What the event gives is built aside and checked before it replaces
  // the base: a refused change applied in place would corrupt the base
  // every later delta builds on.
  descriptor::SegmentDescriptor next;
  absl::Status refused;
  if (ev.has_full()) {
    if (ev.full().name() != name) {
      refused = absl::DataLossError(absl::StrCat(
          "the watch of '", name, "' pushed segment '", ev.full().name(), "'"));
    } else {
      next = ev.full();
    }
  } else if (base->broken) {
    // Waits for a whole descriptor; meanwhile each change it cannot apply
    // says "something changed": the view is fetched again (rate-limited).
    MarkStale(name);
    return;
  } else if (ev.version() <= base->descriptor.version()) {
    refused = absl::DataLossError(
        absl::StrCat("a pushed change of '", name, "' has version ",
                     ev.version(), ", not after ", base->descriptor.version()));
  } else {
    // Removals, then additions, by address.
    next = base->descriptor;
    std::map<uint64_t, descriptor::Buffer> bufs;
    for (const descriptor::Buffer& b : next.buffers()) bufs[b.addr()] = b;
    for (uint64_t a : ev.remove_addrs()) bufs.erase(a);
    for (const descriptor::Buffer& b : ev.add()) bufs[b.addr()] = b;
    next.clear_buffers();
    for (auto& [addr, b] : bufs) *next.add_buffers() = std::move(b);
    next.set_version(ev.version());
  }
  absl::StatusOr<std::shared_ptr<const SegmentView>> view =
      refused.ok() ? MakeView(next) : refused;
  if (!view.ok()) {
    FERRY_LOG_EVERY(kWarn, "metadata", absl::Seconds(1),
                    "a pushed change of segment '", name,
                    "' is not usable (the segment is fetched again): ",
                    view.status().message());
    base->broken = true;
    MarkStale(name);
    return;
  }
  base->descriptor = std::move(next);
  base->broken = false;
  MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return;
  auto slot = SlotOf(it->second);
  if (!slot.ok()) return;
  InstallLocked(entries_[*slot].get(), std::move(*view));
  ++stats_.pushes;
}

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentCache::Close(
    SegmentHandle handle) {
  // Ended outside mu_: its last event may be waiting for mu_.
  std::unique_ptr<metadata::Watch> ended;
  std::vector<Delivery> closed;
  std::shared_ptr<const SegmentView> view;
  {
    MutexLock lock(&mu_);
    auto slot = SlotOf(handle);
    if (!slot.ok()) return slot.status();
    Entry* e = entries_[*slot].get();
    view = e->view;
    for (const Parked& p : e->parked) {
      closed.push_back(
          {p.task, view,
           absl::FailedPreconditionError(absl::StrCat(
               "segment '", e->name,
               "' was closed while the request waited for its descriptor"))});
    }
    stats_.parked_now -= e->parked.size();
    e->parked.clear();
    by_name_.erase(e->name);
    if (e->queued) {
      refresh_queue_.erase(
          std::find(refresh_queue_.begin(), refresh_queue_.end(), *slot));
      e->queued = false;
    }
    if (auto w = watches_.find(e->name); w != watches_.end()) {
      ended = std::move(w->second);
      watches_.erase(w);
    }
    e->in_use = false;
    e->view = nullptr;
    e->name.clear();
    e->generation = (e->generation + 1) & kGenerationMask;
    if (e->generation == 0) e->generation = 1;
    free_slots_.push_back(*slot);
    --stats_.open;
  }
  Deliver(&closed);
  return view;
}

absl::StatusOr<SegmentCache::Snapshot> SegmentCache::Get(SegmentHandle handle) {
  MutexLock lock(&mu_);
  auto slot = SlotOf(handle);
  if (!slot.ok()) return slot.status();
  const Entry& e = *entries_[*slot];
  return Snapshot{e.view, !e.stale};
}

void SegmentCache::QueueLocked(size_t slot) {
  Entry* e = entries_[slot].get();
  if (e->queued) return;
  e->queued = true;
  refresh_queue_.push_back(slot);
  wake_.Signal();
}

absl::Status SegmentCache::Park(SegmentHandle handle, Task* task,
                                absl::Time deadline) {
  MutexLock lock(&mu_);
  auto slot = SlotOf(handle);
  if (!slot.ok()) return slot.status();
  if (stopping_) return absl::CancelledError("the engine is shutting down");
  Entry* e = entries_[*slot].get();
  e->parked.push_back({task, deadline, e->fetches_started});
  ++stats_.parked_now;
  ++stats_.parked_total;
  QueueLocked(*slot);
  return absl::OkStatus();
}

void SegmentCache::MarkStale(SegmentHandle handle) {
  MutexLock lock(&mu_);
  auto slot = SlotOf(handle);
  if (!slot.ok()) return;
  entries_[*slot]->stale = true;
  QueueLocked(*slot);
}

void SegmentCache::InstallLocked(Entry* e,
                                 std::shared_ptr<const SegmentView> view) {
  // Versions only compare within one incarnation of the peer and of the
  // server: a different incarnation always wins.
  if (e->view == nullptr || e->view->incarnation() != view->incarnation() ||
      e->view->version() <= view->version()) {
    e->view = std::move(view);
  }
}

absl::StatusOr<std::shared_ptr<const SegmentView>> SegmentCache::Refresh(
    SegmentHandle handle) {
  std::string name;
  {
    MutexLock lock(&mu_);
    auto slot = SlotOf(handle);
    if (!slot.ok()) return slot.status();
    name = entries_[*slot]->name;
  }
  auto view = Fetch(name);
  if (!view.ok()) return view.status();
  MutexLock lock(&mu_);
  auto slot = SlotOf(handle);
  if (!slot.ok()) return slot.status();
  Entry* e = entries_[*slot].get();
  InstallLocked(e, std::move(*view));
  e->stale = false;
  e->last_fetch = clock_->Now();
  return e->view;
}

void SegmentCache::ExpireLocked(absl::Time now, std::vector<Delivery>* out) {
  if (stats_.parked_now == 0) return;
  // Parked tasks wait on segments that are queued for a fetch, or being
  // fetched.
  std::vector<size_t> slots = refresh_queue_;
  if (fetching_) slots.push_back(job_.slot);
  for (size_t slot : slots) {
    Entry* e = entries_[slot].get();
    auto& parked = e->parked;
    for (auto it = parked.begin(); it != parked.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      out->push_back({it->task, e->view,
                      absl::DeadlineExceededError(absl::StrCat(
                          "the request waited for a fresh descriptor of "
                          "segment '",
                          e->name, "' past its deadline"))});
      it = parked.erase(it);
      --stats_.parked_now;
    }
  }
}

void SegmentCache::Deliver(std::vector<Delivery>* deliveries) {
  for (Delivery& d : *deliveries) ready_(d.task, std::move(d.view), d.status);
  deliveries->clear();
}

void SegmentCache::FetcherLoop() {
  mu_.Lock();
  while (true) {
    while (!stopping_ && !job_ready_) job_cv_.Wait(&mu_);
    if (stopping_) break;
    job_ready_ = false;
    const std::string name = job_.name;
    mu_.Unlock();
    auto view = Fetch(name);
    mu_.Lock();
    job_result_ = std::move(view);
    job_done_ = true;
    wake_.Signal();
  }
  mu_.Unlock();
}

void SegmentCache::FinishFetchLocked(std::vector<Delivery>* out) {
  job_done_ = false;
  fetching_ = false;
  Entry* e = entries_[job_.slot].get();
  if (!e->in_use || e->generation != job_.generation) return;  // Closed.
  ++stats_.refreshes;
  if (job_result_.ok()) {
    InstallLocked(e, std::move(*job_result_));
  } else {
    ++stats_.refresh_failures;
  }
  // One refresh per mark, even if it failed: requests then use what is
  // cached rather than wait for a metadata service that is down.
  e->stale = false;
  auto& parked = e->parked;
  for (auto it = parked.begin(); it != parked.end();) {
    if (it->after >= job_.fetch) {
      ++it;  // Parked after this fetch started: wants a newer one.
      continue;
    }
    out->push_back({it->task, e->view, job_result_.status()});
    it = parked.erase(it);
    --stats_.parked_now;
  }
  if (!parked.empty()) QueueLocked(job_.slot);
}

void SegmentCache::RefresherLoop() {
  std::vector<Delivery> out;
  mu_.Lock();
  while (!stopping_) {
    const absl::Time now = clock_->Now();
    ExpireLocked(now, &out);
    if (job_done_) FinishFetchLocked(&out);
    if (!out.empty()) {
      mu_.Unlock();
      Deliver(&out);
      mu_.Lock();
      continue;
    }
    // The first queued segment whose rate limit allows a fetch now.
    absl::Time next = absl::InfiniteFuture();
    if (!fetching_) {
      auto due = refresh_queue_.end();
      for (auto it = refresh_queue_.begin(); it != refresh_queue_.end(); ++it) {
        const absl::Time at = entries_[*it]->last_fetch + kMinRefreshInterval;
        if (at <= now) {
          due = it;
          break;
        }
        next = std::min(next, at);
      }
      if (due != refresh_queue_.end()) {
        const size_t slot = *due;
        refresh_queue_.erase(due);
        Entry* e = entries_[slot].get();
        e->queued = false;
        e->last_fetch = now;
        job_.slot = slot;
        job_.generation = e->generation;
        job_.name = e->name;
        job_.fetch = ++e->fetches_started;
        fetching_ = true;
        job_ready_ = true;
        job_cv_.Signal();
        continue;
      }
    }
    if (stats_.parked_now > 0) next = std::min(next, now + kDeadlineTick);
    clock_->WaitWithDeadline(&wake_, &mu_, next);
  }
  mu_.Unlock();
}

SegmentCache::Stats SegmentCache::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace ferry
