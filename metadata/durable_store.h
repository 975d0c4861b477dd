// DurableStore: the Store (store.h) of tools/metadata_server --data_dir: an
// in-memory SegmentStore whose every change is also appended to a log in
// `dir` and fdatasync()ed before it is acknowledged, so that a restarted
// server (kill -9 included) comes back with every segment it had.
//
// Files: `snapshot` (the whole table as of a log sequence number, replaced
// atomically by rename) and `log` (changes after it). Recovery loads the
// snapshot and replays the log records after its sequence number. A torn
// or corrupt log tail (a crash in mid-append, a bad sector) is detected by
// the records' CRC32C, logged and cut off; the changes in it were never
// acknowledged. A corrupt snapshot fails Open: it is written whole before
// it replaces the old one, so damage there is not a crash artefact.
//
// Leases restart: a leased segment recovered from disk gets a whole TTL
// from the moment of recovery, so live engines have time to renew and a
// dead one's segment still goes away. KeepAlives are not logged.
//
// The log is compacted into a new snapshot once it outgrows the last
// snapshot (and kMinCompactBytes). A failed write or sync of either file
// stops the store from accepting changes (Unavailable): memory and disk
// would disagree from then on. Reads go on.
//
// Thread-safe. Changes are serialized (one log append and sync each);
// reads never wait for them. One process per directory (flock).
#ifndef FERRY_METADATA_DURABLE_STORE_H_
#define FERRY_METADATA_DURABLE_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "metadata/proto/store_log.pb.h"
#include "metadata/segment_store.h"
#include "metadata/store.h"

namespace ferry::metadata {

class DurableStore final : public Store {
 public:
  static constexpr uint64_t kMinCompactBytes = 4 << 20;

  struct Recovery {
    uint64_t segments = 0;       // In the table after recovery.
    uint64_t log_records = 0;    // Replayed from the log.
    uint64_t torn_bytes = 0;     // Cut off the log's tail.
    uint64_t replay_errors = 0;  // Log records that did not apply again.
    bool had_snapshot = false;
  };

  // Opens (creating it if needed) the store in `dir` and recovers its
  // contents. FailedPrecondition if another process holds the directory;
  // DataLoss if the snapshot is corrupt; Internal for I/O errors. Leases
  // expire on `clock` (null: the system clock), which must outlive the
  // store.
  static absl::StatusOr<std::unique_ptr<DurableStore>> Open(
      const std::string& dir, Clock* clock = RealClock());
  ~DurableStore() override;

  absl::StatusOr<uint64_t> Put(const PutSegmentRequest& request) override {
    return PutFrom(request, "");
  }
  absl::StatusOr<uint64_t> PutFrom(const PutSegmentRequest& request,
                                   const std::string& client) override;
  absl::StatusOr<absl::Duration> KeepAlive(
      const KeepAliveRequest& request) override;
  absl::StatusOr<uint64_t> UpdateBuffers(
      const UpdateBuffersRequest& request) override;
  // Quotas of the table (SegmentStore::Limits); before use. A recovered
  // segment counts against its client again (the log records who put it).
  void SetLimits(const SegmentStore::Limits& limits) { mem_.SetLimits(limits); }
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override;
  absl::Status Remove(const RemoveSegmentRequest& request) override;
  absl::StatusOr<std::vector<std::string>> List() override;
  std::string Describe() const override { return dir_; }
  SegmentStore* watchable() override { return &mem_; }

  const Recovery& recovery() const { return recovery_; }
  // Snapshots written since Open.
  uint64_t compactions() const;

 private:
  DurableStore(std::string dir, Clock* clock)
      : dir_(std::move(dir)), mem_(clock) {}
  absl::Status Recover();
  absl::Status RecoverLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Replays one log record into mem_.
  absl::Status ApplyLocked(const LogRecord& record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // The write-ahead hook of mem_ (SegmentStore::SetWriteAhead): appends
  // pending_, with `version`, and syncs it, before mem_ applies it. Runs
  // within a mem_ call made under write_mu_.
  absl::Status LogPending(uint64_t version);
  // Appends `record` (given the next LSN) and syncs it.
  absl::Status AppendLocked(LogRecord record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Snapshots the table once the log has outgrown the last snapshot.
  void MaybeCompactLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  absl::Status CompactLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  absl::Status Refuse() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  const std::string dir_;
  SegmentStore mem_;
  Recovery recovery_;
  int lock_fd_ = -1;

  mutable Mutex write_mu_;
  int log_fd_ ABSL_GUARDED_BY(write_mu_) = -1;
  uint64_t lsn_ ABSL_GUARDED_BY(write_mu_) = 0;
  uint64_t log_bytes_ ABSL_GUARDED_BY(write_mu_) = 0;
  uint64_t snapshot_bytes_ ABSL_GUARDED_BY(write_mu_) = 0;
  uint64_t compactions_ ABSL_GUARDED_BY(write_mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(write_mu_);
  // The change being made, logged by LogPending once mem_ has checked it.
  LogRecord pending_ ABSL_GUARDED_BY(write_mu_);
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_DURABLE_STORE_H_
