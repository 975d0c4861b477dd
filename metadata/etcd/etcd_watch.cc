// EtcdStore::WatchSegment: segment changes pushed from etcd's Watch API
// (etcd_store.h says how).
#include <algorithm>
#include <atomic>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "metadata/etcd/etcd_store.h"
#include "metadata/grpc_deadline.h"
#include "metadata/validation.h"

namespace ferry::metadata {

// One WatchSegment. `version` is what the watcher's copy is at; the rest
// is the watch thread's after creation.
struct EtcdStore::Watcher {
  // Its etcd watch id; a new one each time the watch is created again on
  // the same stream (etcd keeps a compacted watch's id in use). Read and
  // written under the store's watch_mu_.
  int64_t id = 0;
  std::string name;
  std::string meta_key;
  Store::EventFn fn;
  std::atomic<uint64_t> version{0};
  // The oldest revision etcd still has (from a compaction notice): a watch
  // is created no earlier, whatever `version` is (a segment unchanged
  // since before the compaction would otherwise be refused again and
  // again). Events at or below `version` are skipped anyway.
  std::atomic<int64_t> min_start{0};
  // Whether the watcher holds a descriptor deltas apply to (not after
  // `gone`, nor before the first whole push when it asked for one).
  bool known = false;
  bool need_whole = false;
  bool gone_pushed = false;  // The last push was `gone`.
  // A call of `fn` and the end of the watch exclude each other, so that
  // no call follows the end.
  Mutex mu;
  bool active ABSL_GUARDED_BY(mu) = true;

  void Deliver(const SegmentEvent& ev) {
    MutexLock lock(&mu);
    if (active) fn(ev);
  }
};

class EtcdStore::SegmentWatch final : public Watch {
 public:
  SegmentWatch(EtcdStore* store, std::shared_ptr<Watcher> w)
      : store_(store), w_(std::move(w)) {}
  ~SegmentWatch() override { store_->EndWatch(w_); }

 private:
  EtcdStore* const store_;
  const std::shared_ptr<Watcher> w_;
};

EtcdStore::~EtcdStore() {
  {
    MutexLock lock(&watch_mu_);
    stopping_ = true;
    if (stream_ctx_ != nullptr) stream_ctx_->TryCancel();
    watch_cv_.SignalAll();
    outbox_cv_.SignalAll();
  }
  if (watch_thread_.joinable()) watch_thread_.join();
  if (writer_thread_.joinable()) writer_thread_.join();
}

absl::StatusOr<std::unique_ptr<Watch>> EtcdStore::WatchSegment(
    const std::string& name, uint64_t after_version, EventFn fn) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  auto w = std::make_shared<Watcher>();
  w->name = name;
  w->meta_key = keys_.MetaKey(name);
  w->fn = std::move(fn);
  w->version = after_version;
  w->known = after_version != 0;
  w->need_whole = after_version == 0;
  MutexLock lock(&watch_mu_);
  if (stopping_) return absl::CancelledError("the etcd store is closing");
  w->id = next_watch_id_++;
  watchers_[w->id] = w;
  if (!watch_thread_.joinable() || !writer_thread_.joinable()) {
    try {
      if (!watch_thread_.joinable()) {
        watch_thread_ = std::thread([this] { WatchLoop(); });
      }
      if (!writer_thread_.joinable()) {
        writer_thread_ = std::thread([this] { WriteLoop(); });
      }
    } catch (const std::system_error& e) {
      watchers_.erase(w->id);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot start the etcd watch threads: ", e.what()));
    }
  }
  // Only now: a watcher refused above must leave no create request queued
  // on the stream for an id that nobody holds.
  SendCreateLocked(*w);
  return std::unique_ptr<Watch>(new SegmentWatch(this, w));
}

void EtcdStore::EndWatch(const std::shared_ptr<Watcher>& w) {
  {
    MutexLock lock(&watch_mu_);
    watchers_.erase(w->id);
    if (stream_ != nullptr) {
      outbox_.emplace_back().mutable_cancel_request()->set_watch_id(w->id);
      outbox_cv_.Signal();
    }
  }
  MutexLock lock(&w->mu);  // Waits for a call of fn in progress.
  w->active = false;
}

void EtcdStore::SendCreateLocked(const Watcher& w) {
  if (stream_ == nullptr) return;  // WatchLoop creates it on the stream.
  auto* c = outbox_.emplace_back().mutable_create_request();
  c->set_key(w.meta_key);
  c->set_watch_id(w.id);
  // From the next change after what the watcher has; from now if it has
  // nothing yet (it is pushed the whole segment once the watch is there).
  const uint64_t v = w.version.load();
  c->set_start_revision(
      v == 0 ? 0 : std::max(static_cast<int64_t>(v) + 1, w.min_start.load()));
  outbox_cv_.Signal();
}

void EtcdStore::WriteLoop() {
  MutexLock lock(&watch_mu_);
  while (true) {
    while (!stopping_ && (outbox_.empty() || stream_ == nullptr)) {
      outbox_cv_.Wait(&watch_mu_);
    }
    if (stopping_) return;
    etcdserverpb::WatchRequest req = std::move(outbox_.front());
    outbox_.pop_front();
    WatchStream* stream = stream_;
    writing_ = true;
    watch_mu_.Unlock();
    // Fails only on a broken stream, which WatchLoop opens again (and
    // creates every watch on).
    stream->Write(req);
    watch_mu_.Lock();
    writing_ = false;
    outbox_cv_.SignalAll();
  }
}

void EtcdStore::WatchLoop() {
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    grpc::ClientContext ctx;
    std::unique_ptr<WatchStream> stream = watch_->Watch(&ctx);
    {
      MutexLock lock(&watch_mu_);
      if (stopping_) ctx.TryCancel();
      stream_ = stream.get();
      stream_ctx_ = &ctx;
      outbox_.clear();  // Meant for the stream before.
      for (const auto& [id, w] : watchers_) SendCreateLocked(*w);
    }
    bool answered = false;
    etcdserverpb::WatchResponse resp;
    while (stream->Read(&resp)) {
      answered = true;
      HandleWatchResponse(resp);
    }
    {
      MutexLock lock(&watch_mu_);
      stream_ = nullptr;
      stream_ctx_ = nullptr;
      // A write on a broken stream returns: wait for it before the stream
      // goes.
      ctx.TryCancel();
      while (writing_) outbox_cv_.Wait(&watch_mu_);
    }
    stream->Finish().ok();  // Why it ended does not matter: open it again.
    // A stream that worked is reopened at once (a member died; the
    // channel goes to the others); one that never did, after a back-off.
    backoff = answered ? absl::Milliseconds(100)
                       : std::min(backoff * 2, absl::Seconds(2));
    MutexLock lock(&watch_mu_);
    const absl::Time until = clock_->Now() + backoff;
    while (!stopping_ &&
           !clock_->WaitWithDeadline(&watch_cv_, &watch_mu_, until)) {
    }
    if (stopping_) return;
  }
}

void EtcdStore::HandleWatchResponse(const etcdserverpb::WatchResponse& resp) {
  std::shared_ptr<Watcher> w;
  {
    MutexLock lock(&watch_mu_);
    auto it = watchers_.find(resp.watch_id());
    if (it == watchers_.end()) return;  // Ended meanwhile.
    w = it->second;
  }
  if (resp.canceled()) {
    if (resp.compact_revision() > 0) {
      w->min_start = resp.compact_revision();
      // The versions after the watcher's are compacted away: push the
      // whole segment, and watch again from there.
      PushWhole(w.get());
      MutexLock lock(&watch_mu_);
      auto it = watchers_.find(w->id);
      if (it == watchers_.end() || it->second != w) return;  // Ended.
      watchers_.erase(it);
      w->id = next_watch_id_++;
      watchers_[w->id] = w;
      SendCreateLocked(*w);
      return;
    }
    // Refused for another reason: nothing is pushed until the stream is
    // opened again (the reader refreshes on a miss meanwhile).
    FERRY_LOG_EVERY(kWarn, "metadata", absl::Seconds(10),
                    "etcd ended the watch of segment '", w->name,
                    "': ", resp.cancel_reason());
    return;
  }
  if (resp.created() && w->need_whole) {
    w->need_whole = false;
    PushWhole(w.get());
  }
  for (const mvccpb::Event& ev : resp.events()) OnMetaEvent(w.get(), ev);
}

void EtcdStore::PushWhole(Watcher* w) {
  auto d = Get(w->name);
  SegmentEvent ev;
  if (!d.ok()) {
    // Gone (or etcd unreachable for a while: the watcher's reader then
    // fetches on its own, and a later change is pushed whole).
    w->known = false;
    if (d.status().code() != absl::StatusCode::kNotFound) return;
    if (w->gone_pushed) return;  // Said already.
    w->gone_pushed = true;
    ev.set_version(w->version.load());
    ev.set_gone(true);
    w->Deliver(ev);
    return;
  }
  if (w->known && d->version() == w->version.load()) return;  // Has it.
  w->version = d->version();
  w->known = true;
  w->gone_pushed = false;
  ev.set_version(d->version());
  *ev.mutable_full() = std::move(*d);
  w->Deliver(ev);
}

void EtcdStore::OnMetaEvent(Watcher* w, const mvccpb::Event& ev) {
  const uint64_t rev = static_cast<uint64_t>(ev.kv().mod_revision());
  if (rev <= w->version.load()) return;  // Already in what it has.
  if (ev.type() == mvccpb::Event::DELETE) {
    w->version = rev;
    w->known = false;
    if (w->gone_pushed) return;
    w->gone_pushed = true;
    SegmentEvent gone;
    gone.set_version(rev);
    gone.set_gone(true);
    w->Deliver(gone);
    return;
  }
  EtcdSegmentMeta meta;
  if (!meta.ParseFromString(ev.kv().value())) return PushWhole(w);
  // A change written in several transactions: its last meta says it all.
  if (meta.pending()) return;
  if (!w->known || meta.change_base() == 0 ||
      meta.change_base() != w->version.load()) {
    return PushWhole(w);  // A publication, or a change it missed.
  }
  SegmentEvent delta;
  delta.set_version(rev);
  for (uint64_t a : meta.change_removed()) delta.add_remove_addrs(a);
  if (meta.change_added_size() > 0) {
    std::set<uint64_t> added(meta.change_added().begin(),
                             meta.change_added().end());
    // The added buffers, as that revision has them: one range from the
    // lowest to the highest (one key for a single registration).
    etcdserverpb::RangeRequest req;
    req.set_key(keys_.BufKey(w->name, *added.begin()));
    req.set_range_end(keys_.BufKey(w->name, *added.rbegin()) + '\0');
    req.set_revision(static_cast<int64_t>(rev));
    etcdserverpb::RangeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(GrpcDeadline(options_.rpc_timeout));
    if (!kv_->Range(&ctx, req, &resp).ok()) return PushWhole(w);
    for (const auto& kv : resp.kvs()) {
      descriptor::Buffer b;
      if (!b.ParseFromString(kv.value())) return PushWhole(w);
      if (added.count(b.addr()) > 0) *delta.add_add() = std::move(b);
    }
    if (static_cast<size_t>(delta.add_size()) != added.size()) {
      return PushWhole(w);  // Not what the meta says: read it all.
    }
  }
  w->version = rev;
  w->Deliver(delta);
}

}  // namespace ferry::metadata
