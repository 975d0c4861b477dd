#include "metadata/peer_service.h"

#include <algorithm>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "metadata/auth.h"
#include "metadata/grpc_deadline.h"
#include "metadata/grpc_status.h"
#include "metadata/metadata_client.h"
#include "metadata/validation.h"

namespace ferry::metadata {
namespace {

// A receiver that cannot check the sender right now (its lookups busy, its
// metadata slow) marks its refusal "retry later" (receivers of the release
// before the mark said it in words only). Such a call is made again, 10 ms
// doubling to 400 ms apart (each wait drawn from its upper half, so that
// the senders of a storm, refused together, do not come back together),
// each try within `timeout`, until it ends otherwise or kBusyPatience of
// real time (gRPC's, not an engine's clock) would pass: a handshake or a
// notification is not lost to a busy receiver, which answers, only to one
// that does not. `attempt` gets the deadline of its try.
constexpr absl::Duration kBusyPatience = absl::Seconds(15);
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(10);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(400);

bool SaysRetryLater(const absl::Status& s) {
  return IsRetryLater(s) ||
         (s.code() == absl::StatusCode::kUnavailable &&
          absl::StrContains(s.message(),
                            "receiver cannot check the sender now, try again"));
}

const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// A try is not started with less than this left (its deadline would
// pass before a busy receiver answered, and DEADLINE_EXCEEDED would hide
// the receiver's own answer).
constexpr absl::Duration kMinTry = absl::Milliseconds(100);

// `patient`: while true, tries go on for kBusyPatience; else for `timeout`.
template <typename Attempt>
auto RetryingLater(absl::Duration timeout, const std::atomic<bool>& patient,
                   Attempt attempt) -> decltype(attempt(absl::Time())) {
  const absl::Time start = absl::Now();
  absl::Duration backoff = kFirstBackoff;
  thread_local absl::InsecureBitGen bits;
  while (true) {
    const absl::Time give_up = start + (patient.load(std::memory_order_relaxed)
                                            ? std::max(timeout, kBusyPatience)
                                            : timeout);
    auto result = attempt(std::min(absl::Now() + timeout, give_up));
    const absl::Duration wait =
        backoff / 2 + absl::Nanoseconds(absl::Uniform<int64_t>(
                          bits, 0, absl::ToInt64Nanoseconds(backoff / 2) + 1));
    if (result.ok() || !SaysRetryLater(StatusOf(result)) ||
        absl::Now() + wait + std::min(timeout, kMinTry) >= give_up) {
      return result;
    }
    absl::SleepFor(wait);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

}  // namespace

void PeerServiceImpl::SetExchangeHandler(const std::string& transport,
                                         ExchangeHandler handler) {
  auto h = std::make_shared<Handler>();
  h->fn = std::move(handler);
  MutexLock lock(&mu_);
  handlers_[transport] = std::move(h);
}

void PeerServiceImpl::RemoveExchangeHandler(const std::string& transport) {
  MutexLock lock(&mu_);
  auto it = handlers_.find(transport);
  if (it == handlers_.end()) return;
  std::shared_ptr<Handler> h = std::move(it->second);
  handlers_.erase(it);
  while (h->calls > 0) call_done_.Wait(&mu_);
}

void PeerServiceImpl::SetNotifyHandler(NotifyHandler handler) {
  MutexLock lock(&mu_);
  notify_ =
      handler ? std::make_shared<NotifyHandler>(std::move(handler)) : nullptr;
}

grpc::Status PeerServiceImpl::Admit(const grpc::CallbackServerContext& ctx) {
  return AdmitCall(this, ctx, token_);
}

grpc::ServerUnaryReactor* PeerServiceImpl::Exchange(
    grpc::CallbackServerContext* ctx, const ExchangeRequest* request,
    ExchangeResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  if (absl::Status s = descriptor::ValidateSegmentName(request->from_segment());
      !s.ok()) {
    return FinishNow(ctx, ToGrpcStatus(s));
  }
  if (request->payload().size() > kMaxExchangePayloadBytes) {
    return FinishNow(
        ctx,
        ToGrpcStatus(absl::InvalidArgumentError("exchange payload too large")));
  }
  return ServeOnPool(&pool_, ctx, response, [this, ctx, request, response] {
    return ServeExchange(*request, CallerAddress(*ctx), response);
  });
}

void PeerServiceImpl::SetSenderVerifier(SenderVerifier verifier) {
  MutexLock lock(&mu_);
  verifier_ = verifier ? std::make_shared<SenderVerifier>(std::move(verifier))
                       : nullptr;
}

grpc::Status PeerServiceImpl::ServeExchange(const ExchangeRequest& request,
                                            const std::string& caller,
                                            ExchangeResponse* response) {
  // The transport first: an Exchange for one this engine does not run is
  // refused at no cost, before the sender check, which may read the
  // metadata service (a stranger must not make this engine do that for
  // free).
  {
    MutexLock lock(&mu_);
    if (!handlers_.contains(request.transport())) {
      return ToGrpcStatus(absl::UnimplementedError(absl::StrCat(
          "this engine has no '", request.transport(), "' transport")));
    }
  }
  std::shared_ptr<SenderVerifier> verifier;
  {
    MutexLock lock(&mu_);
    verifier = verifier_;
  }
  if (verifier != nullptr) {
    // Before the transport sees it: a handshake or rail notice that does
    // not come from the segment it names changes nothing.
    const absl::Status v =
        (*verifier)(request.from_segment(), caller, ExchangeContent(request),
                    request.signature(), request.seq());
    if (!v.ok()) {
      // Unavailable: the sender could not be checked now; a Ferry sender
      // may try again (metadata::IsRetryLater).
      const absl::Status refused(
          v.code(), absl::StrCat("exchange refused: ", v.message()));
      return ToGrpcStatus(v.code() == absl::StatusCode::kUnavailable
                              ? MarkRetryLater(refused)
                              : refused);
    }
  }
  std::shared_ptr<Handler> handler;
  {
    MutexLock lock(&mu_);
    auto it = handlers_.find(request.transport());
    if (it != handlers_.end()) {
      handler = it->second;
      ++handler->calls;
    }
  }
  if (handler == nullptr) {  // Removed while the sender was checked.
    return ToGrpcStatus(absl::UnimplementedError(absl::StrCat(
        "this engine has no '", request.transport(), "' transport")));
  }
  auto reply = handler->fn(request.from_segment(), request.payload());
  {
    MutexLock lock(&mu_);
    if (--handler->calls == 0) call_done_.SignalAll();
  }
  if (!reply.ok()) return ToGrpcStatus(reply.status());
  response->set_payload(std::move(*reply));
  return grpc::Status::OK;
}

void PeerServiceImpl::SetDescriptorSource(Store* source) {
  MutexLock lock(&mu_);
  descriptor_source_ = source;
}

grpc::ServerUnaryReactor* PeerServiceImpl::GetDescriptor(
    grpc::CallbackServerContext* ctx, const GetSegmentRequest* request,
    GetSegmentResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  if (absl::Status s = descriptor::ValidateSegmentName(request->name());
      !s.ok()) {
    return FinishNow(ctx, ToGrpcStatus(s));
  }
  return ServeOnPool(&pool_, ctx, response, [this, request, response] {
    return ServeGetDescriptor(*request, response);
  });
}

grpc::Status PeerServiceImpl::ServeGetDescriptor(
    const GetSegmentRequest& request, GetSegmentResponse* response) {
  Store* source;
  {
    MutexLock lock(&mu_);
    source = descriptor_source_;
  }
  if (source == nullptr) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "this engine does not run in P2PHANDSHAKE mode: ask "
                        "its metadata service for its segment");
  }
  auto d = source->Get(request.name());
  if (!d.ok()) return ToGrpcStatus(d.status());
  *response->mutable_segment() = std::move(*d);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* PeerServiceImpl::Notify(
    grpc::CallbackServerContext* ctx, const NotifyRequest* request,
    NotifyResponse* response) {
  if (grpc::Status a = Admit(*ctx); !a.ok()) return FinishNow(ctx, a);
  if (absl::Status s = descriptor::ValidateSegmentName(request->from_segment());
      !s.ok()) {
    return FinishNow(ctx, ToGrpcStatus(s));
  }
  if (!request->to_segment().empty()) {
    if (absl::Status s = descriptor::ValidateSegmentName(request->to_segment());
        !s.ok()) {
      return FinishNow(ctx, ToGrpcStatus(absl::InvalidArgumentError(
                                absl::StrCat("to_segment: ", s.message()))));
    }
  }
  if (request->name().size() > kMaxNotifyNameBytes ||
      request->message().size() > kMaxNotifyMessageBytes) {
    return FinishNow(ctx, ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
                              "notification name or message too large (limits ",
                              kMaxNotifyNameBytes, " and ",
                              kMaxNotifyMessageBytes, " bytes)"))));
  }
  return ServeOnPool(&pool_, ctx, response, [this, ctx, request] {
    std::shared_ptr<NotifyHandler> handler;
    {
      MutexLock lock(&mu_);
      handler = notify_;
    }
    if (handler == nullptr) {
      return ToGrpcStatus(
          absl::UnavailableError("engine does not accept notifications yet"));
    }
    return ToGrpcStatus((*handler)(*request, CallerAddress(*ctx)));
  });
}

std::shared_ptr<PeerService::Stub> PeerClient::StubFor(
    const std::string& address) {
  MutexLock lock(&mu_);
  auto it = stubs_.find(address);
  if (it != stubs_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return it->second.stub;
  }
  while (stubs_.size() >= max_stubs_ && !lru_.empty()) {
    stubs_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(address);
  CachedStub& c = stubs_[address];
  c.stub = PeerService::NewStub(MakeChannel(address, tls_.get()));
  c.lru = lru_.begin();
  return c.stub;
}

void PeerClient::Forget(const std::string& address) {
  MutexLock lock(&mu_);
  auto it = stubs_.find(address);
  if (it == stubs_.end()) return;
  lru_.erase(it->second.lru);
  stubs_.erase(it);
}

size_t PeerClient::size() const {
  MutexLock lock(&mu_);
  return stubs_.size();
}

absl::StatusOr<std::string> PeerClient::Exchange(
    const std::string& address, const std::string& transport,
    const std::string& from_segment, const std::string& payload) {
  ExchangeRequest req;
  req.set_transport(transport);
  req.set_from_segment(from_segment);
  req.set_payload(payload);
  // Each try is numbered anew (from the notifications' counter: one
  // sequence per sender key), as Notify's are.
  ExchangeResponse resp;
  absl::Status s =
      RetryingLater(rpc_timeout_, patient_, [&](absl::Time deadline) {
        req.set_seq(next_seq_.fetch_add(1, std::memory_order_relaxed));
        if (identity_ != nullptr) {
          auto sig = identity_->Sign(ExchangeContent(req));
          if (!sig.ok()) return sig.status();
          req.set_signature(std::move(*sig));
        }
        grpc::ClientContext ctx;
        AddAuthToken(&ctx, token_);
        ctx.set_deadline(GrpcDeadline(deadline - absl::Now()));
        return FromGrpcStatus(StubFor(address)->Exchange(&ctx, req, &resp),
                              absl::StrCat("peer ", address, " Exchange"));
      });
  if (!s.ok()) return s;
  if (resp.payload().size() > kMaxExchangePayloadBytes) {
    return absl::DataLossError("peer exchange reply too large");
  }
  return std::move(*resp.mutable_payload());
}

absl::StatusOr<descriptor::SegmentDescriptor> PeerClient::GetDescriptor(
    const std::string& address, const std::string& name) {
  grpc::ClientContext ctx;
  AddAuthToken(&ctx, token_);
  ctx.set_deadline(GrpcDeadline(rpc_timeout_));
  GetSegmentRequest req;
  req.set_name(name);
  GetSegmentResponse resp;
  grpc::Status s = StubFor(address)->GetDescriptor(&ctx, req, &resp);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("peer ", address, " GetDescriptor"));
  }
  if (resp.segment().name() != name) {
    return absl::DataLossError(
        absl::StrCat("peer ", address, " answered GetDescriptor('", name,
                     "') with segment '", resp.segment().name(), "'"));
  }
  if (absl::Status v = descriptor::ValidateSegmentDescriptor(resp.segment());
      !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "peer ", address, " sent an invalid descriptor: ", v.message()));
  }
  return std::move(*resp.mutable_segment());
}

absl::Status PeerClient::Notify(const std::string& address,
                                const std::string& from_segment,
                                const std::string& name,
                                const std::string& message,
                                const std::string& to_segment,
                                uint64_t to_incarnation) {
  // Each try is numbered anew: a receiver that found the last number too
  // old to tell from a replay asks for a new one.
  return RetryingLater(rpc_timeout_, patient_, [&](absl::Time deadline) {
    grpc::ClientContext ctx;
    AddAuthToken(&ctx, token_);
    ctx.set_deadline(GrpcDeadline(deadline - absl::Now()));
    NotifyRequest req;
    req.set_from_segment(from_segment);
    req.set_name(name);
    req.set_message(message);
    req.set_seq(next_seq_.fetch_add(1, std::memory_order_relaxed));
    req.set_to_segment(to_segment);
    req.set_to_incarnation(to_incarnation);
    if (identity_ != nullptr) {
      auto sig = identity_->Sign(NotifyContent(req));
      if (!sig.ok()) return sig.status();
      req.set_signature(std::move(*sig));
    }
    NotifyResponse resp;
    return FromGrpcStatus(StubFor(address)->Notify(&ctx, req, &resp),
                          absl::StrCat("peer ", address, " Notify"));
  });
}

std::string ExchangeContent(const ExchangeRequest& request) {
  if (request.seq() == 0) {
    return SignedContent(
        "exchange",
        {request.transport(), request.from_segment(), request.payload()});
  }
  return SignedContent("exchange",
                       {request.transport(), request.from_segment(),
                        request.payload(), absl::StrCat(request.seq())});
}

std::string NotifyContent(const NotifyRequest& request) {
  return SignedContent(
      "notify", {request.from_segment(), request.name(), request.message(),
                 request.to_segment(), absl::StrCat(request.to_incarnation()),
                 absl::StrCat(request.seq())});
}

}  // namespace ferry::metadata
