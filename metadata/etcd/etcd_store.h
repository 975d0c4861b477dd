// EtcdStore: the Store (metadata/store.h) on an etcd v3 cluster, through
// etcd's own gRPC API (KV, Lease) with Ferry's gRPC stack. Several
// metadata_servers, or engines directly (metadata address
// "etcd://host:port[,host:port...]"), share one etcd cluster; etcd's Raft
// gives the high availability.
//
// Layout, under a key prefix (default "ferry/"; a namespace per cluster
// makes several share one etcd), with the segment name escaped ('/' and
// '%' as %2F, %25):
//   <prefix>owner/<name>       the owner key (the only compare target)
//   <prefix>meta/<name>        EtcdSegmentMeta: the descriptor without
//                              buffers, lease, counts
//   <prefix>buf/<name>/<addr>  one Buffer per key, addr as 16 hex digits,
//                              so key order is address order
// All three hang off the segment's etcd lease, so etcd itself removes a
// dead engine's segment when the lease runs out. Every change is one
// transaction that compares the owner key (and, for buffer updates, the
// meta key's revision read before), so another client can neither take
// over a live name nor change what it does not own; an update of k
// buffers reads only their neighbours (the next buffer up, and those in
// the window below that the segment's longest buffer could reach from)
// and writes only them. Versions are
// etcd revisions. A change larger than one transaction may hold (etcd's
// --max-txn-ops, 128 by default) is written in several, with the meta
// marked pending meanwhile; readers wait for it.
//
// Watches (WatchSegment) use etcd's Watch API: one stream per store, on
// its own thread, with one etcd watch per watched segment, on its meta
// key. Each finished change (never a pending one) says in the meta what it
// added and removed since which version, so a watcher reads only the added
// buffers, at that revision, and pushes a delta; a publication, a gap (a
// version it did not see) or a compacted history makes it read the whole
// segment and push it whole; a deleted meta (removed, lease ended) pushes
// `gone`. When the stream breaks (a member died), it is opened again on
// the live members and every watch resumes from the version it had.
//
// etcd leases have whole seconds: a TTL is rounded up, and etcd raises it
// to its minimum (about 2 s with default election timeouts).
//
// Who can read etcd can read owner keys: etcd's own authentication is the
// boundary there. Thread-safe. Calls that fail with UNAVAILABLE (a member
// down) are retried on the other endpoints until the RPC timeout.
#ifndef FERRY_METADATA_ETCD_ETCD_STORE_H_
#define FERRY_METADATA_ETCD_ETCD_STORE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "ferry/etcd_limits.h"
#include "metadata/etcd/etcd_keys.h"
#include "metadata/etcd/etcd_usage.h"
#include "metadata/proto/store_log.pb.h"
#include "metadata/store.h"
#include "rpc.grpc.pb.h"

namespace ferry::metadata {

// The limits (etcd_limits.h) and how to reach etcd.
struct EtcdOptions : EtcdLimits {
  // host:port of each member (or of any subset).
  std::vector<std::string> endpoints;
  // Every key starts with it.
  std::string prefix = "ferry/";
  absl::Duration rpc_timeout = absl::Seconds(3);
  // What the store's own waits run on (null: the system clock; it must
  // outlive the store): each operation's deadline, the pauses between
  // retries and while a large change is half written, the watch's
  // back-off. gRPC gets the time left as a real-time deadline; etcd's
  // leases run on etcd's clock.
  Clock* clock = nullptr;
  // Operations per transaction (etcd's --max-txn-ops, 128 by default).
  int max_txn_ops = 120;
};

class EtcdStore final : public Store {
 public:
  // Checks the options; does not connect yet (the first call does).
  static absl::StatusOr<std::unique_ptr<EtcdStore>> Create(EtcdOptions options);
  // Ends every watch (their callbacks are not called again).
  ~EtcdStore() override;

  absl::StatusOr<uint64_t> Put(const PutSegmentRequest& request) override {
    return PutFrom(request, "");
  }
  // Charged to `client` (EtcdOptions::max_client_bytes); ResourceExhausted
  // past a limit, changing nothing.
  absl::StatusOr<uint64_t> PutFrom(const PutSegmentRequest& request,
                                   const std::string& client) override;
  absl::StatusOr<absl::Duration> KeepAlive(
      const KeepAliveRequest& request) override;
  absl::StatusOr<uint64_t> UpdateBuffers(
      const UpdateBuffersRequest& request) override;
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override;
  absl::Status Remove(const RemoveSegmentRequest& request) override;
  absl::StatusOr<std::vector<std::string>> List() override;
  std::string Describe() const override;
  // Never calls `fn` before returning, and never waits for etcd: events,
  // the first one too, come from the store's watch thread.
  absl::StatusOr<std::unique_ptr<Watch>> WatchSegment(const std::string& name,
                                                      uint64_t after_version,
                                                      EventFn fn) override;

 private:
  class SegmentWatch;
  struct Watcher;
  using WatchStream = grpc::ClientReaderWriter<etcdserverpb::WatchRequest,
                                               etcdserverpb::WatchResponse>;

  // The watch thread: opens the stream, (re)creates every watch on it,
  // handles what comes back; again after a break, until the store ends.
  void WatchLoop();
  void HandleWatchResponse(const etcdserverpb::WatchResponse& resp);
  // Pushes the change a meta event describes to `w` (on the watch thread).
  void OnMetaEvent(Watcher* w, const mvccpb::Event& ev);
  // Reads the whole segment and pushes it (or `gone`).
  void PushWhole(Watcher* w);
  // Queues the create request of `w` for the current stream, if any.
  void SendCreateLocked(const Watcher& w)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_);
  void EndWatch(const std::shared_ptr<Watcher>& w);
  // The writer thread: sends what is queued on the current stream, so
  // that no caller (an engine holding its lock, a gRPC callback) ever
  // waits for a write to etcd.
  void WriteLoop();
  explicit EtcdStore(EtcdOptions options);

  // One attempt of Put; Aborted if its own segment changed since the read.
  absl::StatusOr<uint64_t> PutOnce(const PutSegmentRequest& request,
                                   const std::string& client,
                                   absl::Duration ttl, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // EtcdUsage::Check, on the records counted again if they are stale.
  absl::Status CheckQuota(const std::string& client, uint64_t old_client_bytes,
                          uint64_t old_bytes, uint64_t bytes, bool new_segment,
                          absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // After a write of `bytes` (net) by `client` at `revision`: counts it
  // until the next read of the records, and compacts the history (by age,
  // or by what CountWritten counted since the last compaction): at most
  // one Compact RPC.
  void AfterWrite(const std::string& client, int64_t bytes, int segments,
                  int64_t revision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // What one consistent read of a segment found.
  struct Snapshot {
    bool exists = false;    // Owner key and record both there.
    std::string owner_key;  // The owner key, if there (even without a record).
    EtcdSegmentMeta meta;
    int64_t meta_revision = 0;
    // The buffers read: all of them, or those around an update's addresses.
    std::map<uint64_t, descriptor::Buffer> buffers;
    // A window below an added address held more than kWindowKeys buffers
    // (etcd_read.cc): the one that matters may be missing; read the whole
    // segment instead.
    bool window_truncated = false;
  };
  // Waits (up to the RPC timeout) while a large change is half written,
  // unless `wait_pending` is false (what is there, as it is).
  absl::StatusOr<Snapshot> ReadSegment(const std::string& name,
                                       bool all_buffers,
                                       const UpdateBuffersRequest* around,
                                       bool wait_pending = true);
  // Runs `txn`, retrying UNAVAILABLE until the deadline.
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(
      const etcdserverpb::TxnRequest& txn, absl::Time deadline);
  absl::StatusOr<int64_t> GrantLease(absl::Duration ttl, absl::Time deadline);
  void RevokeLease(int64_t id, absl::Time deadline);
  // Renews lease `id` once: the TTL etcd gives it now (0 or less: expired).
  absl::StatusOr<int64_t> RenewLease(int64_t id, absl::Time deadline);
  // Writes `ops` in as many transactions as needed: the first guarded by
  // `first_compares` (and marking the meta pending if more follow), the
  // rest by the meta's revision staying put, then the final meta.
  absl::StatusOr<uint64_t> WriteChanges(
      const std::string& name,
      std::vector<etcdserverpb::Compare> first_compares,
      std::vector<etcdserverpb::RequestOp> ops, EtcdSegmentMeta meta,
      absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Counts what `txn` (answered `resp`) wrote into etcd's history toward
  // compaction by volume.
  void CountWritten(const etcdserverpb::TxnRequest& txn,
                    const etcdserverpb::TxnResponse& resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  static absl::Status NotRegistered(const std::string& name);
  static absl::Status HeldByAnother(const std::string& name);

  const EtcdOptions options_;
  Clock* const clock_;  // Never null.
  const EtcdKeys keys_;
  std::unique_ptr<etcdserverpb::KV::Stub> kv_;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease_;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch_;
  // Changes from this process are serialized: an engine changes only its
  // own segment, and its changes then never race each other's compares.
  Mutex write_mu_;
  EtcdUsage usage_ ABSL_GUARDED_BY(write_mu_);
  EtcdCompaction compaction_ ABSL_GUARDED_BY(write_mu_);

  Mutex watch_mu_;
  // By etcd watch id (chosen here, one per WatchSegment).
  std::map<int64_t, std::shared_ptr<Watcher>> watchers_
      ABSL_GUARDED_BY(watch_mu_);
  int64_t next_watch_id_ ABSL_GUARDED_BY(watch_mu_) = 1;
  // The current stream and its context (null while it is being opened).
  WatchStream* stream_ ABSL_GUARDED_BY(watch_mu_) = nullptr;
  grpc::ClientContext* stream_ctx_ ABSL_GUARDED_BY(watch_mu_) = nullptr;
  bool stopping_ ABSL_GUARDED_BY(watch_mu_) = false;
  CondVar watch_cv_;  // Wakes WatchLoop's back-off when stopping.
  // Requests for the current stream, and whether the writer is writing
  // one (the stream is not finished under a write).
  std::deque<etcdserverpb::WatchRequest> outbox_ ABSL_GUARDED_BY(watch_mu_);
  bool writing_ ABSL_GUARDED_BY(watch_mu_) = false;
  CondVar outbox_cv_;
  // Started by the first WatchSegment.
  std::thread watch_thread_;
  std::thread writer_thread_;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_ETCD_ETCD_STORE_H_
