// EtcdStore::ReadSegment: one consistent read of a segment (its owner key,
// its record and the buffers asked for, all at one revision), waiting out
// a large change that is still being written.
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "metadata/etcd/etcd_rpc.h"
#include "metadata/etcd/etcd_store.h"

namespace ferry::metadata {

using etcdserverpb::RequestOp;
using etcdserverpb::TxnRequest;
using etcdserverpb::TxnResponse;

namespace {

// Buffers read below an added address before reading the whole segment.
constexpr int64_t kWindowKeys = 64;

// Adds the buffers of a range response to `out`.
absl::Status CollectBuffers(const etcdserverpb::RangeResponse& range,
                            std::map<uint64_t, descriptor::Buffer>* out) {
  for (const auto& kv : range.kvs()) {
    descriptor::Buffer b;
    if (!b.ParseFromString(kv.value())) {
      return absl::DataLossError(
          absl::StrCat("etcd key ", kv.key(), " holds no buffer"));
    }
    const uint64_t addr = b.addr();
    out->emplace(addr, std::move(b));
  }
  return absl::OkStatus();
}

// etcd's answer to a read at a revision it has compacted away.
bool IsCompacted(const absl::Status& s) {
  return s.code() == absl::StatusCode::kOutOfRange ||
         absl::StrContains(s.message(), "required revision has been compacted");
}

}  // namespace

absl::StatusOr<EtcdStore::Snapshot> EtcdStore::ReadSegment(
    const std::string& name, bool all_buffers,
    const UpdateBuffersRequest* around, bool wait_pending) {
  const absl::Time deadline = clock_->Now() + options_.rpc_timeout;
  const std::string prefix = keys_.BufPrefix(name);
  const std::string end = PrefixEnd(prefix);
  while (true) {
    TxnRequest txn;  // No compares: the ops run on one revision.
    *txn.add_success() = RangeOp(keys_.OwnerKey(name));
    *txn.add_success() = RangeOp(keys_.MetaKey(name));
    if (all_buffers) {
      *txn.add_success() = RangeOp(prefix, end);
    } else if (around != nullptr) {
      for (const descriptor::Buffer& b : around->add()) {
        // The first buffer at or above it (the one below: next read).
        *txn.add_success() = RangeOp(keys_.BufKey(name, b.addr()), end, 1);
      }
      for (uint64_t a : around->remove_addrs()) {
        *txn.add_success() = RangeOp(keys_.BufKey(name, a));
      }
    }
    FERRY_ASSIGN_OR_RETURN(const TxnResponse resp, Txn(txn, deadline));
    Snapshot snap;
    const auto& owner = resp.responses(0).response_range();
    const auto& meta = resp.responses(1).response_range();
    if (owner.kvs_size() > 0) snap.owner_key = owner.kvs(0).value();
    // An owner key without its record is what a publication that died
    // half-way leaves: no segment, but a name its owner may take again.
    if (owner.kvs_size() == 0 || meta.kvs_size() == 0) return snap;
    snap.exists = true;
    if (!snap.meta.ParseFromString(meta.kvs(0).value())) {
      return absl::DataLossError(absl::StrCat("etcd key ", keys_.MetaKey(name),
                                              " holds no segment record"));
    }
    snap.meta_revision = meta.kvs(0).mod_revision();
    for (int i = 2; i < resp.responses_size(); ++i) {
      FERRY_RETURN_IF_ERROR(
          CollectBuffers(resp.responses(i).response_range(), &snap.buffers));
    }
    const bool complete =
        !all_buffers || snap.buffers.size() == snap.meta.buffers();
    if (!snap.meta.pending() && complete && around != nullptr && !all_buffers &&
        around->add_size() > 0 && snap.meta.max_buffer_length() > 0) {
      // The buffers just below each added address that could reach it,
      // read at the same revision. etcd sorts a whole range to read it in
      // descending order, so "the last key below" would cost O(n); this
      // window holds one key in practice (blocks of one size).
      TxnRequest below;
      const uint64_t reach = snap.meta.max_buffer_length() - 1;
      for (const descriptor::Buffer& b : around->add()) {
        const uint64_t lo = b.addr() > reach ? b.addr() - reach : 0;
        RequestOp op = RangeOp(keys_.BufKey(name, lo),
                               keys_.BufKey(name, b.addr()), kWindowKeys);
        op.mutable_request_range()->set_revision(resp.header().revision());
        *below.add_success() = std::move(op);
      }
      auto w = Txn(below, deadline);
      // Another store sharing etcd may have compacted past the first
      // read's revision in between (compaction by volume does not wait
      // for history to age): read both again, at a newer one.
      if (!w.ok() && IsCompacted(w.status()) &&
          clock_->Now() + absl::Milliseconds(20) < deadline) {
        continue;
      }
      if (!w.ok()) return w.status();
      for (const auto& r : w->responses()) {
        if (r.response_range().more()) snap.window_truncated = true;
        FERRY_RETURN_IF_ERROR(
            CollectBuffers(r.response_range(), &snap.buffers));
      }
    }
    if (!wait_pending || (!snap.meta.pending() && complete)) return snap;
    // A large change is being written: wait for it.
    if (clock_->Now() + absl::Milliseconds(20) >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("segment '", name,
                       "' is being published (its change is still "
                       "being written to etcd)"));
    }
    clock_->SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace ferry::metadata
