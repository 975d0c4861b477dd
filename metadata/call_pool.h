// CallPool: the threads that run the unary handlers of Ferry's gRPC
// services (metadata and peer), and ServeOnPool, which hands a callback-API
// call to it.
//
// Why a pool of our own. With gRPC's synchronous API a thread serves a call
// until its response is on the wire, so a client that opens calls and then
// stops reading (an HTTP/2 receive window of zero) holds one thread per
// call for as long as it likes: 64 such calls froze a service for every
// other caller (issue 26). With the callback API a call holds no thread
// while its response waits for the window; the handler only computes the
// response. Handlers may still block (an etcd round trip, a transport's
// handshake), and gRPC's own callback threads must not, so handlers run
// here: a bounded set of threads, a bounded queue, and a cap per caller
// address, so that one caller's burst cannot take every slot.
//
// Calls are capped from admission until gRPC is done with them, not only
// while their handler runs: a response waiting for a client that stopped
// reading still holds its call's share, and its bytes count against a
// byte cap, so such a client pins at most its share of calls and bytes.
// And shares are fair across callers: when the pool is full, a newcomer
// takes the slot of a call whose response has waited cancel_after for a
// caller that holds at least two more calls than the newcomer would
// (max-min), by cancelling it; so many addresses each at its share cannot
// shut out another (a probe had 16 fill every slot).
//
// Thread-safe. The destructor waits for every queued and running task;
// the server must be shut down first (no call left to release).
#ifndef FERRY_METADATA_CALL_POOL_H_
#define FERRY_METADATA_CALL_POOL_H_

#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/clock.h"
#include "common/happens_before.h"
#include "common/mutex.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "metadata/auth.h"
#include "metadata/grpc_status.h"

namespace ferry::metadata {

struct CallPoolOptions {
  // Threads, started as the load needs them and kept.
  int max_threads = 16;
  // Calls admitted and not yet over -- queued, running, or answered with
  // a response still on its way to a client that may not be reading --
  // over all callers, and per caller (AddressGroup(CallerAddress): an
  // IPv4 address, an IPv6 /64).
  int max_calls = 1024;
  int max_calls_per_caller = 64;
  // Bytes of responses admitted calls hold until their client has them,
  // over all callers and per caller: what a client that stops reading can
  // pin in the server's memory.
  size_t max_response_bytes = size_t{512} << 20;
  size_t max_response_bytes_per_caller = size_t{64} << 20;
  // A call may be cancelled for a newcomer (see above) once its response
  // has waited this long for its client: a client that reads has it in a
  // round trip, so only one that does not loses a call.
  absl::Duration cancel_after = absl::Seconds(1);
  // Where that wait is timed (null: the system clock; must outlive the
  // pool).
  Clock* clock = nullptr;
};

class CallPool {
 public:
  // Counts below 1 are taken as 1.
  explicit CallPool(CallPoolOptions options = {});
  ~CallPool();
  CallPool(const CallPool&) = delete;
  CallPool& operator=(const CallPool&) = delete;

  // Admits one call of `caller`: ResourceExhausted, naming the limit, if
  // the caller is at its call cap, or the pool is at its own and no call
  // could be cancelled to make room (see above; the cancelled call's
  // handler has already run: only its response is lost, and its client
  // sees CANCELLED). An admitted call is Release()d when it is over.
  absl::Status Admit(const std::string& caller);
  // Says that admitted call `call` of `caller` has run its handler and its
  // response now waits for its client: Admit may cancel it through `ctx`,
  // which must stay valid until the call's Release.
  void Delivering(const std::string& caller, const void* call,
                  grpc::ServerContextBase* ctx);
  // Charges an admitted call's response of `bytes`: ResourceExhausted if
  // the caller's or the pool's undelivered responses would pass their cap
  // (the call then ends with that error instead of the response).
  absl::Status Charge(const std::string& caller, size_t bytes);
  // Ends an admitted call that was charged `bytes`; `call` as given to
  // Delivering, if it was. Waits while another thread is cancelling it
  // (its context must outlive that).
  void Release(const std::string& caller, size_t bytes,
               const void* call = nullptr);

  // Runs `task` on a pool thread. Unavailable (and `task` is dropped) if
  // no thread runs and none can be started (RLIMIT_NPROC, say), or the
  // pool is being destroyed: the caller answers the call itself then.
  absl::Status Run(std::function<void()> task);

  // Returns once no task is queued or running. Everything the tasks did
  // happens before the return.
  void WaitIdle();

  // Threads started so far, and calls admitted now (for tests).
  int threads() const;
  int calls() const;

 private:
  struct Waiting {
    const void* call;
    grpc::ServerContextBase* ctx;
    absl::Time since;  // Its response was ready.
  };
  struct Share {
    int calls = 0;
    size_t bytes = 0;
    std::vector<Waiting> waiting;  // Oldest first.
  };
  // A call that has waited cancel_after, of the caller that holds the most
  // such, if that caller holds at least two more calls than `have`: taken
  // off its waiting list and out of the counts (its Release then gives
  // back only its bytes); else null.
  std::optional<Waiting> PickVictimLocked(const std::string& caller, int have,
                                          absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Worker();

  const CallPoolOptions options_;
  Clock* const clock_;
  mutable Mutex mu_;
  CondVar wake_;
  CondVar drained_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Share> shares_ ABSL_GUARDED_BY(mu_);
  // Calls cancelled and not yet released: their slots are their
  // newcomers' already (counted out of calls_ and their shares). `in_try`
  // while the thread `by` is inside the call's TryCancel, which needs its
  // context.
  struct Cancel {
    std::thread::id by;
    bool in_try = true;
  };
  absl::flat_hash_map<const void*, Cancel> cancelling_ ABSL_GUARDED_BY(mu_);
  CondVar cancelled_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int tasks_ ABSL_GUARDED_BY(mu_) = 0;  // Queued or running.
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

// The reactor of a call served by ServeOnPool: gives the call's share of
// the pool back when gRPC is done with it (its response delivered, or the
// call cancelled), not when the handler returns.
class PooledReactor final : public grpc::ServerUnaryReactor {
 public:
  // Made on the gRPC thread that took the call (ordered after the
  // service's set-up); OnDone runs on another gRPC thread, ordered after
  // the task's Finish by gRPC's own (uninstrumented) synchronization:
  // tell TSan (common/happens_before.h), as every reactor here does.
  PooledReactor(CallPool* pool, grpc::CallbackServerContext* ctx,
                std::string caller)
      : pool_(pool), ctx_(ctx), caller_(std::move(caller)) {
    HappensBefore(this);
  }
  void OnDone() override {
    HappensAfter(this);
    pool_->Release(caller_, charged_, this);
    delete this;
  }
  // Ends the call; from the pool's thread. From here until OnDone the
  // pool may cancel it to make room.
  void FinishFromTask(const grpc::Status& status) {
    HappensBefore(this);
    pool_->Delivering(caller_, this, ctx_);
    Finish(status);
  }
  const std::string& caller() const { return caller_; }
  // Set by the task before it finishes the call.
  size_t charged_ = 0;

 private:
  CallPool* const pool_;
  grpc::CallbackServerContext* const ctx_;
  const std::string caller_;
};

// Serves one unary call of a callback-API service: `handler` (returning
// grpc::Status, filling `response`) runs on `pool` and its status ends the
// call, unless the client has gone meanwhile (CANCELLED, the handler not
// run) or the response would pass the pool's byte caps. The call must
// already have passed its authentication check: only callers that may use
// the service take pool slots.
template <typename Handler>
grpc::ServerUnaryReactor* ServeOnPool(CallPool* pool,
                                      grpc::CallbackServerContext* ctx,
                                      const google::protobuf::Message* response,
                                      Handler handler) {
  // Shared by host: an IPv6 caller's /64 is one caller (AddressGroup).
  std::string caller = AddressGroup(CallerAddress(*ctx));
  if (absl::Status s = pool->Admit(caller); !s.ok()) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  auto* reactor = new PooledReactor(pool, ctx, std::move(caller));
  absl::Status s = pool->Run([pool, ctx, reactor, response,
                              handler = std::move(handler)]() mutable {
    if (ctx->IsCancelled()) {
      // Its client gave up while it queued: a late PutSegment must
      // not take effect, and live calls should not wait behind it.
      reactor->FinishFromTask(grpc::Status::CANCELLED);
      return;
    }
    grpc::Status st = handler();
    if (st.ok()) {
      const size_t bytes = response->ByteSizeLong();
      if (absl::Status c = pool->Charge(reactor->caller(), bytes); !c.ok()) {
        st = ToGrpcStatus(c);
      } else {
        reactor->charged_ = bytes;
      }
    }
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      // The handler ran (its own limit, or the response over the byte
      // caps), so the client's retry policy (ChannelArgs) must not run it
      // again: only admission refusals are retried.
      ctx->AddTrailingMetadata("grpc-retry-pushback-ms", "-1");
    }
    reactor->FinishFromTask(st);
  });
  if (!s.ok()) reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

// The first step of every call of a callback service: what set the
// service up (its constructor, SetAuthToken) is ordered before the call by
// gRPC's own, uninstrumented synchronization, which TSan is told here
// (rpc_server.cc marks HappensBefore(service)); then the token check
// (auth.h), before the call takes a pool slot.
inline grpc::Status AdmitCall(const grpc::Service* service,
                              const grpc::CallbackServerContext& ctx,
                              const std::string& token) {
  HappensAfter(service);
  return CheckAuthToken(ctx, token);
}

// Ends a call at once with `status` (an authentication or validation
// failure found before the call takes a pool slot).
inline grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx,
                                           const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_CALL_POOL_H_
