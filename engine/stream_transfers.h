// StreamTransfers: transfers ordered on a CUDA stream, as Mooncake TE's
// *_on_cuda calls are. A prefill step can queue "send this layer's KV" on
// the stream that computes it, after the kernels that write it, without
// the host waiting for them first.
//
// Each Enqueue puts one host function on the stream (cuLaunchHostFunc).
// When the stream's earlier work is done, a driver thread runs it: it
// submits the requests as one batch and waits until every request ended
// (the engine's transfer_timeout bounds that), and the stream's later
// work waits for it. The function makes no CUDA call, as CUDA requires:
// GPU memory moves by GPUDirect RDMA, or through the TCP transport's
// staging, set up when the buffer was registered and run by a thread of
// its own. (Two limits: an unregistered source with the MR cache on is
// looked up through the driver, which fails there with a clear error; and
// over TCP the function waits for the staging copies, on streams CUDA does
// not order before it -- the driver runs them, but CUDA does not promise
// to. A stream-memory wait, cuStreamWaitValue32 on a flag Ferry sets,
// would lift both: the function would only hand the batch over.)
//
// A failed transfer cannot fail the stream. Where Mooncake ends the
// process (_exit(1)), Ferry keeps the first failure for TakeError, counts
// every one, and logs it; the application checks after synchronising the
// stream (ferry.mooncake raises it on the next *_on_cuda call).
//
// Thread-safe.
#ifndef FERRY_ENGINE_STREAM_TRANSFERS_H_
#define FERRY_ENGINE_STREAM_TRANSFERS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "ferry/transfer_engine.h"

namespace ferry {

class StreamTransfers {
 public:
  // `engine` must outlive this object (or its Close).
  explicit StreamTransfers(TransferEngine* engine);
  // Closes.
  ~StreamTransfers();
  StreamTransfers(const StreamTransfers&) = delete;
  StreamTransfers& operator=(const StreamTransfers&) = delete;

  // Queues `requests` on `stream`, a CUstream of the process's CUDA driver
  // (0: the legacy default stream), and returns. An error means nothing
  // was queued: no driver (NotFound), an empty or invalid request list
  // (InvalidArgument), or the driver refused (its error, named).
  absl::Status Enqueue(uintptr_t stream, std::vector<TransferRequest> requests);

  // The first failure of a queued transfer since the last call, with how
  // many failed in all; OK if none.
  absl::Status TakeError();

  // Transfers queued but not yet started fail (Cancelled) when their
  // stream reaches them; waits for those running. Enqueue is refused
  // after. Idempotent.
  void Close();

 private:
  struct State;
  struct Job;
  static void Run(void* job);

  std::shared_ptr<State> state_;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_STREAM_TRANSFERS_H_
