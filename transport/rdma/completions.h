// The RDMA transport's completion side: per NIC, which QP's completions
// go to which endpoint (the QP map) and which endpoints wait for the NIC's
// work-request budget; and the worker threads that reap completions while
// no application thread does, sleep on the completion channels and read
// the devices' async events.
//
// It decides nothing about endpoints or slices. Each completion, each
// endpoint whose budget came back, each port change and each fatal device
// goes to the CompletionHandler (SlicePath): calls go one way, and the
// handler never calls back into Completions while it holds a NIC's
// poll_mu except through Park, Untrack and TakeParked, which take only
// map_mu.
//
// Who reaps: an application thread waiting for its batch calls Poll; a
// worker (one per NIC, or `worker_threads` serving the NICs round robin)
// spins briefly, then sleeps until a completion, a wake-up or an async
// event (an idle engine uses no CPU), and stays off the CQs while
// application threads poll (Poll bumps an epoch the workers watch).
//
// Thread-safe. Locks: a NIC's poll_mu (one thread polls a CQ at a time;
// held while the handler runs), then its map_mu (a leaf).
#ifndef FERRY_TRANSPORT_RDMA_COMPLETIONS_H_
#define FERRY_TRANSPORT_RDMA_COMPLETIONS_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "common/mutex.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/nic.h"

namespace ferry::rdma {

// Where a QP's completions go: its endpoint and the QP's index there.
struct QpRef {
  std::shared_ptr<Endpoint> ep;
  int qp = 0;
};

// What the completion side reports. Called on a worker or on an
// application thread inside Poll, with that NIC's poll_mu held for
// OnCompletion and PostParked (so never twice at once for one NIC), and
// with no lock held for the async events.
class CompletionHandler {
 public:
  virtual ~CompletionHandler() = default;
  // A completion of a QP in the map.
  virtual void OnCompletion(const QpRef& ref, const ibv_wc& wc) = 0;
  // Completions freed budget on the NIC that `ep` waited for.
  virtual void PostParked(const std::shared_ptr<Endpoint>& ep) = 0;
  // IBV_EVENT_PORT_ERR / PORT_ACTIVE of NIC `nic`.
  virtual void OnPortChange(int nic, bool up) = 0;
  // IBV_EVENT_DEVICE_FATAL of NIC `nic` (reported once).
  virtual void OnDeviceFatal(int nic) = 0;
};

class Completions {
 public:
  struct Options {
    // Worker threads (0: one per NIC; more than the NICs: one per NIC).
    int worker_threads = 0;
    // Cores the workers are pinned to, round robin (empty: none).
    std::vector<int> worker_cpus;
    // Empty polls a worker spins (yielding) before it sleeps.
    int spin_polls = 0;
  };

  // `handler` outlives this object.
  Completions(CompletionHandler* handler, Options options);
  Completions(const Completions&) = delete;
  Completions& operator=(const Completions&) = delete;
  // Stops the workers if Stop was not called.
  ~Completions();

  // Adds the next NIC (its index is the order of calls). Before Start.
  // A null `nic` (tests) has a QP map and a park list but is never polled.
  void AddNic(Nic* nic);
  // Creates the workers' wake-up fds and starts the workers. On failure
  // (out of fds, a pids limit) the workers that did start run until Stop.
  absl::Status Start();
  // Shutdown begins: workers leave their loops at their next check.
  void BeginStop() { stopping_.store(true, std::memory_order_release); }
  // Wakes and joins the workers. Idempotent.
  void Stop();
  // After Stop: closes the workers' fds and forgets the NICs (Poll then
  // reaps nothing). Before the NICs are closed.
  void Close();

  // Reaps the completions of every NIC no other thread is reaping, on this
  // thread; returns how many. Tells the workers to keep off the CQs.
  size_t Poll();

  // Routes QP `qpn` of NIC `nic` to `ref` (before anything is posted on
  // it), and stops routing `ep`'s QPs `qpns` (once they are drained).
  void Track(int nic, uint32_t qpn, QpRef ref);
  void Untrack(int nic, const std::vector<uint32_t>& qpns, const Endpoint& ep);
  // `ep` waits for NIC `nic`'s budget: handed to PostParked after that
  // NIC's next completions.
  void Park(int nic, std::shared_ptr<Endpoint> ep);
  // The endpoints parked for NIC `nic`, taken off the list.
  std::vector<std::shared_ptr<Endpoint>> TakeParked(int nic);
  // Shutdown, after Stop: every endpoint the maps and lists reference
  // (the maps are emptied).
  std::vector<std::shared_ptr<Endpoint>> TakeAll();

  // Worker threads running.
  size_t threads() const { return started_; }

 private:
  struct PerNic {
    Nic* nic = nullptr;
    int index = 0;
    Mutex poll_mu;  // One thread polls the CQ at a time.
    Mutex map_mu;
    absl::flat_hash_map<uint32_t, QpRef> by_qpn ABSL_GUARDED_BY(map_mu);
    // Endpoints that had slices to post but no room in the NIC's budget.
    std::vector<std::shared_ptr<Endpoint>> parked ABSL_GUARDED_BY(map_mu);
    std::atomic<bool> any_parked{false};
    // The async-event fd reported an error: left out of the poll set.
    bool async_dead = false;  // Its worker's only.
  };
  struct Worker {
    std::vector<PerNic*> nics;
    int index = 0;
    int wake_fd = -1;
    std::thread thread;
  };

  // Polls `n`'s CQ once (poll_mu held); returns the completions seen.
  size_t PollNicLocked(PerNic* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(n->poll_mu);
  void WorkerLoop(Worker* w);
  // Sleeps until an event on the worker's fds (its NICs' completion
  // channels only if `channels`) or `timeout_us`, and handles what came.
  // False if it slept the whole `timeout_us` with nothing to wake it.
  bool WaitEvents(Worker* w, int64_t timeout_us, bool channels);

  CompletionHandler* const handler_;
  const Options options_;
  std::vector<std::unique_ptr<PerNic>> nics_;
  std::vector<std::unique_ptr<Worker>> workers_;
  size_t started_ = 0;
  std::atomic<bool> stopping_{false};
  // Bumped by every Poll: application threads are reaping completions, so
  // the workers stay away.
  std::atomic<uint64_t> driver_epoch_{0};
};

}  // namespace ferry::rdma

#endif  // FERRY_TRANSPORT_RDMA_COMPLETIONS_H_
