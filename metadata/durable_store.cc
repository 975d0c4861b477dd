#include "metadata/durable_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "metadata/record_file.h"

namespace ferry::metadata {
namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status SyncDir(const std::string& dir) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open", dir);
  absl::Status s = fsync(fd) == 0 ? absl::OkStatus() : Errno("fsync", dir);
  close(fd);
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DurableStore>> DurableStore::Open(
    const std::string& dir, Clock* clock) {
  if (dir.empty()) {
    return absl::InvalidArgumentError("durable store: empty directory name");
  }
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Errno("mkdir", dir);
  }
  std::unique_ptr<DurableStore> store(new DurableStore(dir, clock));
  const std::string lock = dir + "/LOCK";
  store->lock_fd_ = open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (store->lock_fd_ < 0) return Errno("open", lock);
  if (flock(store->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "metadata store ", dir,
        " is in use by another process (a metadata_server already runs "
        "with this --data_dir)"));
  }
  FERRY_RETURN_IF_ERROR(store->Recover());
  // From now on every change is logged before it is applied (the replay
  // above applied logged ones).
  DurableStore* raw = store.get();
  store->mem_.SetWriteAhead(
      [raw](uint64_t version) { return raw->LogPending(version); });
  return store;
}

DurableStore::~DurableStore() {
  MutexLock lock(&write_mu_);
  if (log_fd_ >= 0) close(log_fd_);
  if (lock_fd_ >= 0) close(lock_fd_);  // Releases the flock.
}

absl::Status DurableStore::Recover() {
  MutexLock lock(&write_mu_);
  // What was accepted once comes back whatever the limits are now.
  mem_.EnforceLimits(false);
  absl::Status s = RecoverLocked();
  mem_.EnforceLimits(true);
  return s;
}

absl::Status DurableStore::RecoverLocked() {
  const std::string snap_path = dir_ + "/snapshot";
  uint64_t snap_lsn = 0;
  auto snap = ReadRecordFile(snap_path);
  if (snap.ok()) {
    recovery_.had_snapshot = true;
    snapshot_bytes_ = snap->good_bytes;
    LogRecord header;
    if (snap->torn_bytes != 0 || snap->payloads.empty() ||
        !header.ParseFromString(snap->payloads[0]) || !header.has_snapshot() ||
        header.snapshot().segments() != snap->payloads.size() - 1) {
      return absl::DataLossError(absl::StrCat(
          "metadata store snapshot ", snap_path,
          " is corrupt (it is written whole and renamed into place, so this "
          "is not a torn write): move it away to start empty, or restore it "
          "from a backup"));
    }
    snap_lsn = header.snapshot().lsn();
    for (size_t i = 1; i < snap->payloads.size(); ++i) {
      LogRecord r;
      if (!r.ParseFromString(snap->payloads[i]) || !r.has_put()) {
        return absl::DataLossError(absl::StrCat("metadata store snapshot ",
                                                snap_path, ": record ", i,
                                                " is not a segment"));
      }
      if (auto v = mem_.Restore(r.put(), r.version(), r.client()); !v.ok()) {
        return absl::DataLossError(absl::StrCat("metadata store snapshot ",
                                                snap_path, ": record ", i, ": ",
                                                v.status().message()));
      }
    }
    mem_.AdvanceVersion(header.snapshot().next_version());
  } else if (snap.status().code() != absl::StatusCode::kNotFound) {
    return snap.status();
  }
  lsn_ = snap_lsn;

  const std::string log_path = dir_ + "/log";
  auto log = ReadRecordFile(log_path);
  uint64_t good = 0;
  if (log.ok()) {
    for (const std::string& payload : log->payloads) {
      LogRecord r;
      if (!r.ParseFromString(payload) || r.has_snapshot() ||
          (r.lsn() <= lsn_ && r.lsn() > snap_lsn)) {
        // Intact bytes that are not a record in sequence: treated as the
        // start of a corrupt tail.
        break;
      }
      good += 8 + payload.size();
      if (r.lsn() <= snap_lsn) continue;  // Already in the snapshot.
      // A record that does not apply again means memory would differ from
      // what was acknowledged: count and report it, never silently.
      if (absl::Status a = ApplyLocked(r); !a.ok()) {
        ++recovery_.replay_errors;
        FERRY_LOG(kError, "metadata", "metadata store ", dir_, ": log record ",
                  r.lsn(), " did not apply again: ", a.message());
      }
      lsn_ = r.lsn();
      ++recovery_.log_records;
    }
    recovery_.torn_bytes = log->good_bytes + log->torn_bytes - good;
  } else if (log.status().code() != absl::StatusCode::kNotFound) {
    return log.status();
  }
  log_fd_ = open(log_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (log_fd_ < 0) return Errno("open", log_path);
  if (recovery_.torn_bytes > 0) {
    FERRY_LOG(kWarn, "metadata", "metadata store log ", log_path, ": cut ",
              recovery_.torn_bytes,
              " bytes of torn or corrupt tail after record ", lsn_,
              " (changes never acknowledged)");
    if (ftruncate(log_fd_, static_cast<off_t>(good)) != 0 ||
        fdatasync(log_fd_) != 0) {
      return Errno("truncate", log_path);
    }
  }
  if (lseek(log_fd_, static_cast<off_t>(good), SEEK_SET) < 0) {
    return Errno("lseek", log_path);
  }
  log_bytes_ = good;
  // Stores before 2026-12-07 applied a change in memory just before its
  // record was synced: a crash in between lost a change readers may have
  // seen, with the next version. No later change gets that version. (Now
  // a change is synced before it is applied: what was seen is in the log.)
  mem_.AdvanceVersion(mem_.NextVersion() + 1);
  FERRY_RETURN_IF_ERROR(SyncDir(dir_));
  auto names = mem_.List();
  recovery_.segments = names.ok() ? names->size() : 0;
  return absl::OkStatus();
}

absl::Status DurableStore::ApplyLocked(const LogRecord& r) {
  if (r.has_put()) {
    return mem_.Restore(r.put(), r.version(), r.client()).status();
  }
  if (r.has_update()) {
    mem_.AdvanceVersion(r.version());
    return mem_.UpdateBuffers(r.update()).status();
  }
  if (r.has_remove()) return mem_.Remove(r.remove());
  return absl::OkStatus();
}

absl::Status DurableStore::Refuse() const {
  return absl::UnavailableError(absl::StrCat(
      "metadata store ", dir_,
      " accepts no changes after a failed write (memory and disk may "
      "differ): ",
      failed_.message(), "; restart the metadata_server"));
}

absl::Status DurableStore::AppendLocked(LogRecord record) {
  record.set_lsn(lsn_ + 1);
  const std::string frame = FrameRecord(record.SerializeAsString());
  absl::Status s = WriteAll(log_fd_, frame, /*sync=*/true, dir_ + "/log");
  if (!s.ok()) {
    failed_ = s;
    FERRY_LOG(kError, "metadata", "metadata store: ", s.message());
    return Refuse();
  }
  ++lsn_;
  log_bytes_ += frame.size();
  return absl::OkStatus();
}

absl::Status DurableStore::LogPending(uint64_t version) {
  // mem_ calls this from a change this store makes under write_mu_.
  write_mu_.AssertHeld();
  if (version != 0) pending_.set_version(version);
  return AppendLocked(std::move(pending_));
}

void DurableStore::MaybeCompactLocked() {
  if (log_bytes_ > kMinCompactBytes && log_bytes_ > snapshot_bytes_) {
    if (absl::Status c = CompactLocked(); !c.ok()) {
      // The changes are durable in the log; later ones are refused.
      failed_ = c;
      FERRY_LOG(kError, "metadata", "metadata store compaction: ", c.message());
    }
  }
}

absl::Status DurableStore::CompactLocked() {
  SegmentStore::Snapshot snap = mem_.TakeSnapshot();
  LogRecord header;
  header.mutable_snapshot()->set_lsn(lsn_);
  header.mutable_snapshot()->set_next_version(snap.next_version);
  header.mutable_snapshot()->set_segments(snap.segments.size());
  std::string data = FrameRecord(header.SerializeAsString());
  for (SegmentStore::Snapshot::Segment& seg : snap.segments) {
    LogRecord r;
    r.set_version(seg.version);
    *r.mutable_put() = std::move(seg.put);
    r.set_client(std::move(seg.client));
    data += FrameRecord(r.SerializeAsString());
  }
  const std::string tmp = dir_ + "/snapshot.tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", tmp);
  absl::Status s = WriteAll(fd, data, /*sync=*/true, tmp);
  close(fd);
  if (!s.ok()) return s;
  const std::string path = dir_ + "/snapshot";
  if (rename(tmp.c_str(), path.c_str()) != 0) return Errno("rename", tmp);
  FERRY_RETURN_IF_ERROR(SyncDir(dir_));
  // The snapshot holds everything up to lsn_: the log starts over. A crash
  // before the truncation leaves records the replay skips by LSN.
  if (ftruncate(log_fd_, 0) != 0 || lseek(log_fd_, 0, SEEK_SET) < 0 ||
      fdatasync(log_fd_) != 0) {
    return Errno("truncate", dir_ + "/log");
  }
  snapshot_bytes_ = data.size();
  log_bytes_ = 0;
  ++compactions_;
  return absl::OkStatus();
}

uint64_t DurableStore::compactions() const {
  MutexLock lock(&write_mu_);
  return compactions_;
}

absl::StatusOr<uint64_t> DurableStore::PutFrom(const PutSegmentRequest& request,
                                               const std::string& client) {
  MutexLock lock(&write_mu_);
  if (!failed_.ok()) return Refuse();
  pending_.Clear();
  *pending_.mutable_put() = request;
  pending_.set_client(client);
  // Logged (LogPending) once checked, before anyone can see it.
  auto v = mem_.PutFrom(request, client);
  if (v.ok()) MaybeCompactLocked();
  return v;
}

absl::StatusOr<absl::Duration> DurableStore::KeepAlive(
    const KeepAliveRequest& request) {
  return mem_.KeepAlive(request);
}

absl::StatusOr<uint64_t> DurableStore::UpdateBuffers(
    const UpdateBuffersRequest& request) {
  MutexLock lock(&write_mu_);
  if (!failed_.ok()) return Refuse();
  pending_.Clear();
  *pending_.mutable_update() = request;
  auto v = mem_.UpdateBuffers(request);
  if (v.ok()) MaybeCompactLocked();
  return v;
}

absl::StatusOr<descriptor::SegmentDescriptor> DurableStore::Get(
    const std::string& name) {
  return mem_.Get(name);
}

absl::Status DurableStore::Remove(const RemoveSegmentRequest& request) {
  MutexLock lock(&write_mu_);
  if (!failed_.ok()) return Refuse();
  pending_.Clear();
  *pending_.mutable_remove() = request;
  FERRY_RETURN_IF_ERROR(mem_.Remove(request));
  MaybeCompactLocked();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> DurableStore::List() {
  return mem_.List();
}

}  // namespace ferry::metadata
