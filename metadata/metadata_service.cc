#include "metadata/metadata_service.h"

#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/happens_before.h"
#include "metadata/auth.h"
#include "metadata/forward_watch.h"
#include "metadata/grpc_status.h"
#include "metadata/tls.h"
#include "metadata/validation.h"

namespace ferry::metadata {

MetadataServiceImpl::MetadataServiceImpl(Clock* clock)
    : own_store_(std::make_unique<SegmentStore>(clock)),
      store_(own_store_.get()) {}

struct MetadataServiceImpl::WatchState {
  Mutex mu;
  WatchReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;  // Null once done.
  bool queued = false;  // In poked_; guarded by the service's mu_.
};

// One WatchSegment stream: writes one event at a time, each computed from
// the store when the previous write is done or a change is noticed, and
// charged to the service's WatchBudget while it is written.
class MetadataServiceImpl::WatchReactor final
    : public grpc::ServerWriteReactor<SegmentEvent> {
 public:
  WatchReactor(MetadataServiceImpl* service, SegmentStore* table,
               std::string name, uint64_t after, std::string caller)
      : service_(service),
        table_(table),
        name_(std::move(name)),
        caller_(std::move(caller)),
        version_(after),
        state_(std::make_shared<WatchState>()) {
    {
      MutexLock lock(&state_->mu);
      state_->reactor = this;
    }
    std::weak_ptr<WatchState> weak = state_;
    subscription_ = table_->Subscribe(name_, [service, weak] {
      if (auto s = weak.lock()) service->Poke(std::move(s));
    });
    MutexLock lock(&state_->mu);
    NextLocked();
    HappensBefore(this);  // Callbacks run on gRPC's threads after this.
  }

  // A change may be there: write it unless a write is out.
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (writing_ || finished_) return;
    std::optional<SegmentEvent> ev = table_->EventSince(name_, version_);
    if (!ev.has_value()) return;
    // `gone` once; the watch goes on, and a publication under the name
    // later comes whole (a restarted engine, or one whose lease ran out).
    if (ev->gone() && gone_sent_) return;
    // Held until written, which a client that does not read never lets
    // happen: counted with the rest its caller's streams hold.
    const size_t bytes = ev->ByteSizeLong();
    if (absl::Status charged = service_->watch_budget_.Charge(caller_, bytes);
        !charged.ok()) {
      FinishLocked(ToGrpcStatus(charged));
      return;
    }
    charged_ = bytes;
    gone_sent_ = ev->gone();
    event_ = std::move(*ev);
    if (!event_.gone()) version_ = event_.version();
    writing_ = true;
    StartWrite(&event_);
  }

  void OnWriteDone(bool ok) override {
    HappensAfter(this);
    MutexLock lock(&state_->mu);
    writing_ = false;
    // The event is gRPC's no more (written, or the call is over): free
    // it, rather than keep it until the next one, and give its bytes back.
    event_ = SegmentEvent();
    ReleaseLocked();
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
    } else {
      NextLocked();
    }
  }
  void OnCancel() override {
    HappensAfter(this);
    MutexLock lock(&state_->mu);
    FinishLocked(grpc::Status::CANCELLED);
  }
  void OnDone() override {
    HappensAfter(this);
    table_->Unsubscribe(subscription_);
    {
      MutexLock lock(&state_->mu);
      state_->reactor = nullptr;
      // A write in flight was done before OnDone (and gave its bytes back
      // then); should a charge be left, it must not stay the caller's for
      // ever.
      ReleaseLocked();
    }
    service_->Release(caller_);
    delete this;
  }
  // From the notifier, which holds state_->mu (it is the WatchState's mu,
  // which the analysis cannot connect to this reactor).
  void Poked() {
    state_->mu.AssertHeld();
    NextLocked();
  }

 private:
  // A write in flight keeps its event, and its charge, until OnWriteDone.
  void FinishLocked(const grpc::Status& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    if (finished_) return;
    finished_ = true;
    Finish(s);
  }
  void ReleaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    service_->watch_budget_.Release(caller_, charged_);
    charged_ = 0;
  }

  MetadataServiceImpl* const service_;
  SegmentStore* const table_;
  const std::string name_;
  const std::string caller_;  // Its share of the watches (AddressGroup).
  uint64_t version_;
  std::shared_ptr<WatchState> state_;
  uint64_t subscription_ = 0;
  SegmentEvent event_;
  size_t charged_ = 0;  // event_'s bytes in the budget, while written.
  bool writing_ = false;
  bool finished_ = false;
  bool gone_sent_ = false;  // The last event written was `gone`.
};

MetadataServiceImpl::~MetadataServiceImpl() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  wake_.SignalAll();
  if (notifier_.joinable()) notifier_.join();
}

void MetadataServiceImpl::Release(const std::string& caller) {
  MutexLock lock(&mu_);
  --watches_;
  auto it = watches_of_.find(caller);
  if (it != watches_of_.end() && --it->second <= 0) watches_of_.erase(it);
}

void MetadataServiceImpl::Poke(std::shared_ptr<WatchState> state) {
  // Called with the store's lock held: only queue.
  MutexLock lock(&mu_);
  if (state->queued || stopping_) return;
  state->queued = true;
  poked_.push_back(std::move(state));
  wake_.Signal();
}

void MetadataServiceImpl::NotifierLoop() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    if (poked_.empty()) {
      wake_.Wait(&mu_);
      continue;
    }
    std::shared_ptr<WatchState> s = std::move(poked_.front());
    poked_.pop_front();
    s->queued = false;
    mu_.Unlock();
    {
      MutexLock state_lock(&s->mu);
      if (s->reactor != nullptr) s->reactor->Poked();
    }
    mu_.Lock();
  }
}

grpc::ServerWriteReactor<SegmentEvent>* MetadataServiceImpl::WatchSegment(
    grpc::CallbackServerContext* ctx, const WatchSegmentRequest* request) {
  class Refused final : public grpc::ServerWriteReactor<SegmentEvent> {
   public:
    explicit Refused(const grpc::Status& s) { Finish(s); }
    void OnDone() override { delete this; }
  };
  if (grpc::Status a = Admit(*ctx); !a.ok()) return new Refused(a);
  if (absl::Status s = descriptor::ValidateSegmentName(request->name());
      !s.ok()) {
    return new Refused(ToGrpcStatus(s));
  }
  SegmentStore* table = store_->watchable();
  // Shared by host, as unary calls are (CallPool): an IPv6 caller's /64 is
  // one caller. Only after the token check: a caller without the token
  // takes no share.
  std::string caller = AddressGroup(CallerAddress(*ctx));
  {
    MutexLock lock(&mu_);
    if (watches_ >= kMaxWatches) {
      return new Refused(ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrCat("this metadata service serves ", kMaxWatches,
                       " watches, its limit"))));
    }
    auto held = watches_of_.find(caller);
    if (held != watches_of_.end() && held->second >= kMaxWatchesPerCaller) {
      return new Refused(ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "caller ", caller, " holds ", held->second,
          " watch streams of this metadata service, the most one address "
          "(an IPv6 /64) may hold at once (kMaxWatchesPerCaller = ",
          kMaxWatchesPerCaller,
          "): end one first; an unwatched segment is refreshed on a miss"))));
    }
    if (!notifier_.joinable()) {
      try {
        notifier_ = std::thread([this] { NotifierLoop(); });
      } catch (const std::system_error& e) {
        return new Refused(ToGrpcStatus(absl::UnavailableError(absl::StrCat(
            "cannot start the watch notifier thread: ", e.what()))));
      }
    }
    ++watches_;
    ++watches_of_[caller];
  }
  if (table == nullptr) {
    // A store that pushes by itself (etcd), or cannot (then the stream
    // ends UNIMPLEMENTED and the watcher refreshes on a miss).
    return new ForwardWatchReactor(store_, request->name(),
                                   request->after_version(), &watch_budget_,
                                   caller, [this, caller] { Release(caller); });
  }
  return new WatchReactor(this, table, request->name(),
                          request->after_version(), std::move(caller));
}

grpc::Status MetadataServiceImpl::Admit(
    const grpc::CallbackServerContext& ctx) {
  return AdmitCall(this, ctx, token_);
}

grpc::ServerUnaryReactor* MetadataServiceImpl::PutSegment(
    grpc::CallbackServerContext* ctx, const PutSegmentRequest* request,
    PutSegmentResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  if (token_.empty() && request->lease_ttl_ms() == 0 &&
      !(ctx->auth_context() != nullptr &&
        ctx->auth_context()->IsPeerAuthenticated())) {
    // Such a segment stays until removed: on an open service anyone could
    // take a name for ever, and the real engine's Init would fail.
    return FinishNow(
        ctx, ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
                 "segment '", request->segment().name(),
                 "' has no lease (lease_ttl_ms=0), which this metadata "
                 "service allows only with an auth token or mutual TLS "
                 "(anyone could hold a name for ever): publish with a lease, "
                 "or give the cluster a token"))));
  }
  if (absl::Status named = CertificateMayPublish(ctx->auth_context().get(),
                                                 request->segment().name());
      !named.ok()) {
    return FinishNow(ctx, ToGrpcStatus(named));
  }
  return ServeOnPool(&pool_, ctx, response, [this, ctx, request, response] {
    auto version =
        store_->PutFrom(*request,
                        // Charged per host: an IPv6 caller's /64 is one client,
                        // as its call share is (call_pool.h).
                        AddressGroup(CallerAddress(*ctx)));
    if (!version.ok()) return ToGrpcStatus(version.status());
    response->set_version(*version);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* MetadataServiceImpl::KeepAlive(
    grpc::CallbackServerContext* ctx, const KeepAliveRequest* request,
    KeepAliveResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  return ServeOnPool(&pool_, ctx, response, [this, request, response] {
    auto ttl = store_->KeepAlive(*request);
    if (!ttl.ok()) return ToGrpcStatus(ttl.status());
    response->set_lease_ttl_ms(
        static_cast<uint32_t>(absl::ToInt64Milliseconds(*ttl)));
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* MetadataServiceImpl::UpdateBuffers(
    grpc::CallbackServerContext* ctx, const UpdateBuffersRequest* request,
    UpdateBuffersResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  return ServeOnPool(&pool_, ctx, response, [this, request, response] {
    auto version = store_->UpdateBuffers(*request);
    if (!version.ok()) return ToGrpcStatus(version.status());
    response->set_version(*version);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* MetadataServiceImpl::GetSegment(
    grpc::CallbackServerContext* ctx, const GetSegmentRequest* request,
    GetSegmentResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  if (absl::Status s = descriptor::ValidateSegmentName(request->name());
      !s.ok()) {
    return FinishNow(ctx, ToGrpcStatus(s));
  }
  return ServeOnPool(&pool_, ctx, response, [this, request, response] {
    auto segment = store_->Get(request->name());
    if (!segment.ok()) return ToGrpcStatus(segment.status());
    *response->mutable_segment() = std::move(*segment);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* MetadataServiceImpl::RemoveSegment(
    grpc::CallbackServerContext* ctx, const RemoveSegmentRequest* request,
    RemoveSegmentResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  return ServeOnPool(&pool_, ctx, response, [this, request] {
    return ToGrpcStatus(store_->Remove(*request));
  });
}

grpc::ServerUnaryReactor* MetadataServiceImpl::ListSegments(
    grpc::CallbackServerContext* ctx, const ListSegmentsRequest*,
    ListSegmentsResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  return ServeOnPool(&pool_, ctx, response, [this, response] {
    auto names = store_->List();
    if (!names.ok()) return ToGrpcStatus(names.status());
    for (std::string& name : *names) response->add_names(std::move(name));
    return grpc::Status::OK;
  });
}

}  // namespace ferry::metadata
