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
// Thread-safe. The destructor waits for every queued and running task.
#ifndef FERRY_METADATA_CALL_POOL_H_
#define FERRY_METADATA_CALL_POOL_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "grpcpp/grpcpp.h"
#include "metadata/auth.h"
#include "metadata/grpc_status.h"

namespace ferry::metadata {

struct CallPoolOptions {
  // Threads, started as the load needs them and kept.
  int max_threads = 16;
  // Tasks waiting or running, over all callers.
  int max_tasks = 1024;
  // Tasks waiting or running for one caller (CallerAddress).
  int max_tasks_per_caller = 64;
};

class CallPool {
 public:
  // Options below 1 are taken as 1.
  explicit CallPool(CallPoolOptions options = {});
  ~CallPool();
  CallPool(const CallPool&) = delete;
  CallPool& operator=(const CallPool&) = delete;

  // Runs `task` on a pool thread, on behalf of `caller`. ResourceExhausted
  // (and `task` is dropped) if the pool or the caller is at its cap;
  // Unavailable if no thread runs and none can be started (RLIMIT_NPROC,
  // say): the caller answers the call itself then.
  absl::Status Submit(const std::string& caller, std::function<void()> task);

  // Returns once no task is queued or running. Everything the tasks did
  // happens before the return.
  void WaitIdle();

  // Threads started so far (for tests).
  int threads() const;

 private:
  struct Task {
    std::string caller;
    std::function<void()> fn;
  };
  void Worker();

  const CallPoolOptions options_;
  mutable Mutex mu_;
  CondVar wake_;
  CondVar drained_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> per_caller_ ABSL_GUARDED_BY(mu_);
  int tasks_ ABSL_GUARDED_BY(mu_) = 0;  // Queued or running.
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

// Serves one unary call of a callback-API service: `handler` (returning
// grpc::Status, filling the response) runs on `pool` and its status ends
// the call. The call must already have passed its authentication check:
// only callers that may use the service take pool slots.
template <typename Handler>
grpc::ServerUnaryReactor* ServeOnPool(CallPool* pool,
                                      grpc::CallbackServerContext* ctx,
                                      Handler handler) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status s = pool->Submit(
      CallerAddress(*ctx), [reactor, handler = std::move(handler)]() mutable {
        reactor->Finish(handler());
      });
  if (!s.ok()) reactor->Finish(ToGrpcStatus(s));
  return reactor;
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
