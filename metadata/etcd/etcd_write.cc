// EtcdStore's changes: publication (Put), buffer updates, removal, and how
// each is written (guarded transactions, several when it is too large for
// one), charged against the limits and followed by compaction.
#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/secure_random.h"
#include "common/status_macros.h"
#include "metadata/etcd/etcd_rpc.h"
#include "metadata/etcd/etcd_store.h"
#include "metadata/segment_store.h"
#include "metadata/validation.h"

namespace ferry::metadata {

using etcdserverpb::Compare;
using etcdserverpb::RequestOp;
using etcdserverpb::TxnRequest;
using etcdserverpb::TxnResponse;

namespace {

// Addresses one change records in the meta for watchers (8 KiB x 10 B).
constexpr size_t kMaxChangeAddrs = 8192;
// Meta records read per page when the store counts usage.
constexpr int kUsagePage = 512;
// Bytes of operations one transaction carries at most. etcd refuses a
// request larger than its --max-request-bytes (1.5 MiB by default); the
// rest is room for the compares, the meta and gRPC's framing. Counting
// operations (max_txn_ops) alone stays under it only while max_txn_ops
// times the largest buffer (about 5 KiB: 64 keys with 64-byte NIC names)
// does, which an etcd run with a larger --max-txn-ops breaks.
constexpr size_t kMaxTxnOpBytes = size_t{1} << 20;

// What a range reply adds to each key and value it returns, at most: the
// KeyValue's revisions, version and lease, and the fields' tags and
// lengths.
constexpr uint64_t kRangeBytesPerKey = 64;
// What one whole read of a segment may return: one gRPC message, less
// room for the reply's header and the segment record, whose change lists
// (kMaxChangeAddrs addresses) the record's charged bytes do not count.
constexpr uint64_t kMaxReadBytes = kMaxRpcMessageBytes - (uint64_t{256} << 10);

// ResourceExhausted unless a whole read of segment `name`, holding `bytes`
// of keys and values in etcd in `buffers` buffer keys, fits one reply: it
// is one range of its keys, one gRPC message (kMaxRpcMessageBytes), and
// etcd would otherwise keep a segment no one can read back (as
// SegmentStore bounds a descriptor to one GetSegment answer).
absl::Status CheckReadable(const std::string& name, uint64_t bytes,
                           uint64_t buffers) {
  const uint64_t read = bytes + buffers * kRangeBytesPerKey;
  if (read <= kMaxReadBytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("segment '", name, "' would take ", read,
                   " bytes to read whole from etcd (", buffers,
                   " buffers, keys and values); at most ", kMaxReadBytes,
                   ", what one reply may carry"));
}

size_t OpBytes(const std::vector<RequestOp>& ops) {
  size_t n = 0;
  for (const RequestOp& op : ops) n += op.ByteSizeLong();
  return n;
}

}  // namespace

absl::StatusOr<uint64_t> EtcdStore::WriteChanges(
    const std::string& name, std::vector<Compare> first_compares,
    std::vector<RequestOp> ops, EtcdSegmentMeta meta, absl::Time deadline) {
  const size_t per_txn = static_cast<size_t>(options_.max_txn_ops);
  const int64_t lease = meta.lease_id();
  const std::string meta_value = meta.SerializeAsString();
  if (ops.size() + 1 <= per_txn &&
      OpBytes(ops) + meta_value.size() <= kMaxTxnOpBytes) {
    TxnRequest txn;
    for (Compare& c : first_compares) *txn.add_compare() = std::move(c);
    for (RequestOp& op : ops) *txn.add_success() = std::move(op);
    *txn.add_success() = PutOp(keys_.MetaKey(name), meta_value, lease);
    FERRY_ASSIGN_OR_RETURN(const TxnResponse resp, Txn(txn, deadline));
    CountWritten(txn, resp);
    if (!resp.succeeded()) {
      return absl::AbortedError("the segment changed meanwhile");
    }
    return static_cast<uint64_t>(resp.header().revision());
  }
  // Too many for one transaction: the meta says pending until the last.
  EtcdSegmentMeta pending = meta;
  pending.set_pending(true);
  int64_t meta_rev = 0;
  size_t next = 0;
  bool first = true;
  // A change that failed half-way would leave the segment pending for
  // good (readers wait on it, and without a lease nothing ends it): it is
  // removed instead, unless someone changed it since, and its owner
  // publishes it again (the engine does when its renewal finds it gone).
  // Its tombstones are not counted toward compaction: keys only, fewer
  // bytes than the puts of those keys, which were.
  auto abandon = [&](absl::Status why) {
    TxnRequest drop;
    *drop.add_compare() = ModRevisionIs(keys_.MetaKey(name), meta_rev);
    *drop.add_success() = DeleteOp(keys_.OwnerKey(name));
    *drop.add_success() = DeleteOp(keys_.MetaKey(name));
    *drop.add_success() =
        DeleteOp(keys_.BufPrefix(name), PrefixEnd(keys_.BufPrefix(name)));
    Txn(drop, clock_->Now() + options_.rpc_timeout).IgnoreError();
    return why;
  };
  while (first || next < ops.size()) {
    TxnRequest txn;
    if (first) {
      for (Compare& c : first_compares) *txn.add_compare() = std::move(c);
      *txn.add_success() =
          PutOp(keys_.MetaKey(name), pending.SerializeAsString(), lease);
    } else {
      *txn.add_compare() = ModRevisionIs(keys_.MetaKey(name), meta_rev);
    }
    // Up to max_txn_ops operations and kMaxTxnOpBytes bytes, but at
    // least one, so that the write goes on (etcd says what it refuses).
    size_t bytes = txn.ByteSizeLong();
    size_t added = 0;
    while (next < ops.size() &&
           static_cast<size_t>(txn.success_size()) < per_txn) {
      const size_t op_bytes = ops[next].ByteSizeLong();
      if (added > 0 && bytes + op_bytes > kMaxTxnOpBytes) break;
      bytes += op_bytes;
      ++added;
      *txn.add_success() = std::move(ops[next++]);
    }
    auto resp = Txn(txn, deadline);
    if (!resp.ok()) return first ? resp.status() : abandon(resp.status());
    CountWritten(txn, *resp);
    if (!resp->succeeded()) {
      absl::Status changed =
          absl::AbortedError("the segment changed meanwhile");
      return first ? changed : abandon(changed);
    }
    if (first) meta_rev = resp->header().revision();
    first = false;
  }
  TxnRequest done;
  *done.add_compare() = ModRevisionIs(keys_.MetaKey(name), meta_rev);
  *done.add_success() = PutOp(keys_.MetaKey(name), meta_value, lease);
  auto resp = Txn(done, deadline);
  if (!resp.ok()) return abandon(resp.status());
  CountWritten(done, *resp);
  if (!resp->succeeded()) {
    return abandon(absl::AbortedError("the segment changed meanwhile"));
  }
  return static_cast<uint64_t>(resp->header().revision());
}

absl::StatusOr<uint64_t> EtcdStore::PutFrom(const PutSegmentRequest& request,
                                            const std::string& client) {
  const descriptor::SegmentDescriptor& in = request.segment();
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentDescriptor(in));
  FERRY_RETURN_IF_ERROR(ValidateOwnerKey(request.owner_key()));
  const absl::Duration ttl = absl::Milliseconds(request.lease_ttl_ms());
  if (ttl > SegmentStore::kMaxLeaseTtl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease TTL ", absl::FormatDuration(ttl), " is outside 0 (none) .. ",
        absl::FormatDuration(SegmentStore::kMaxLeaseTtl)));
  }
  const std::string& name = in.name();
  const absl::Time deadline = clock_->Now() + options_.rpc_timeout;
  MutexLock lock(&write_mu_);
  // Re-read and try again when our own segment changed between the read
  // and the write (its owner updating it through another client).
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto v = PutOnce(request, client, ttl, deadline);
    if (v.ok() || v.status().code() != absl::StatusCode::kAborted) return v;
  }
  return absl::AbortedError(absl::StrCat(
      "segment '", name, "' kept changing while it was published again"));
}

absl::StatusOr<uint64_t> EtcdStore::PutOnce(const PutSegmentRequest& request,
                                            const std::string& client,
                                            absl::Duration ttl,
                                            absl::Time deadline) {
  const descriptor::SegmentDescriptor& in = request.segment();
  const std::string& name = in.name();
  // Who holds the name now, and under which lease (to revoke it after a
  // re-publication). A segment left half written is read as it is: its
  // owner publishing it again is what repairs it.
  FERRY_ASSIGN_OR_RETURN(const Snapshot before,
                         ReadSegment(name, /*all_buffers=*/true, nullptr,
                                     /*wait_pending=*/false));
  if (!before.exists && !before.owner_key.empty() &&
      !SecretsEqual(request.owner_key(), before.owner_key)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "segment name '", name,
        "' is held by another engine run whose publication did not finish; "
        "it is free once that run's lease runs out"));
  }
  if (before.exists && !SecretsEqual(request.owner_key(), before.owner_key)) {
    return absl::AlreadyExistsError(
        absl::StrCat("segment name '", name, "' is held by a live engine (rpc ",
                     before.meta.segment().rpc_address(), ", incarnation ",
                     before.meta.segment().incarnation(), ") ",
                     before.meta.lease_id() != 0
                         ? "until its etcd lease runs out unless renewed"
                         : "without a lease, until it removes it",
                     ": choose another name, or stop that engine first"));
  }
  // Charged to `client`, as etcd holds it (keys and values); a
  // re-publication gives back what it replaces.
  const uint64_t bytes = in.ByteSizeLong() + keys_.OwnerKey(name).size() +
                         request.owner_key().size() +
                         keys_.MetaKey(name).size() +
                         in.buffers_size() * keys_.BufKey(name, 0).size();
  FERRY_RETURN_IF_ERROR(
      CheckReadable(name, bytes, static_cast<uint64_t>(in.buffers_size())));
  const bool same_client = before.exists && before.meta.client() == client;
  const uint64_t old_bytes = before.exists ? before.meta.bytes() : 0;
  FERRY_RETURN_IF_ERROR(CheckQuota(client, same_client ? old_bytes : 0,
                                   old_bytes, bytes, !same_client, deadline));
  int64_t lease = 0;
  if (ttl > absl::ZeroDuration()) {
    FERRY_ASSIGN_OR_RETURN(lease, GrantLease(ttl, deadline));
  }
  EtcdSegmentMeta meta;
  meta.set_client(client);
  meta.set_bytes(bytes);
  *meta.mutable_segment() = in;
  meta.mutable_segment()->clear_buffers();
  meta.mutable_segment()->set_version(0);
  meta.set_lease_id(lease);
  meta.set_lease_ttl_ms(request.lease_ttl_ms());
  meta.set_buffers(in.buffers_size());
  uint64_t keys = 0;
  uint64_t longest = 0;
  // The owner key first, so that it is in the first transaction (with the
  // guard) however many follow.
  std::vector<RequestOp> ops = {
      PutOp(keys_.OwnerKey(name), request.owner_key(), lease)};
  // The old run's buffers that this one does not have (etcd refuses a
  // transaction that deletes and puts the same key).
  std::set<uint64_t> kept;
  for (const descriptor::Buffer& b : in.buffers()) kept.insert(b.addr());
  for (const auto& [addr, b] : before.buffers) {
    if (kept.count(addr) == 0) {
      ops.push_back(DeleteOp(keys_.BufKey(name, addr)));
    }
  }
  for (const descriptor::Buffer& b : in.buffers()) {
    keys += b.keys_size();
    longest = std::max<uint64_t>(longest, b.length());
    ops.push_back(
        PutOp(keys_.BufKey(name, b.addr()), b.SerializeAsString(), lease));
  }
  meta.set_keys(keys);
  meta.set_max_buffer_length(longest);
  // Taken only if still free, or still ours and as read (the deletions
  // above are of what was read).
  std::vector<Compare> guard;
  if (!before.owner_key.empty()) {
    // A missing record compares as revision 0.
    guard = {ValueIs(keys_.OwnerKey(name), request.owner_key()),
             ModRevisionIs(keys_.MetaKey(name), before.meta_revision)};
  } else {
    guard = {Absent(keys_.OwnerKey(name))};
  }
  auto v = WriteChanges(name, std::move(guard), std::move(ops), meta, deadline);
  if (!v.ok()) {
    RevokeLease(lease, deadline);
    if (v.status().code() == absl::StatusCode::kAborted &&
        before.owner_key.empty()) {
      return absl::AlreadyExistsError(absl::StrCat(
          "segment name '", name,
          "' was taken by another engine run while this one published it"));
    }
    return v.status();  // Aborted with `before` ours: the caller reads again.
  }
  if (before.exists && before.meta.lease_id() != lease) {
    RevokeLease(before.meta.lease_id(), deadline);
  }
  if (same_client) {
    AfterWrite(client, static_cast<int64_t>(bytes - old_bytes), 0,
               static_cast<int64_t>(*v));
  } else {
    if (before.exists) {
      AfterWrite(before.meta.client(), -static_cast<int64_t>(old_bytes), -1,
                 static_cast<int64_t>(*v));
    }
    AfterWrite(client, static_cast<int64_t>(bytes), 1,
               static_cast<int64_t>(*v));
  }
  return v;
}

absl::StatusOr<uint64_t> EtcdStore::UpdateBuffers(
    const UpdateBuffersRequest& request) {
  const std::string& name = request.name();
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  for (const descriptor::Buffer& b : request.add()) {
    FERRY_RETURN_IF_ERROR(descriptor::ValidateBuffer(b));
  }
  const absl::Time deadline = clock_->Now() + options_.rpc_timeout;
  MutexLock lock(&write_mu_);
  // A small update reads only the buffers it touches and the neighbours of
  // those it adds. One that also removes reads the whole segment: a
  // neighbour it removes would hide the next one out.
  const size_t ranges = 2 * request.add_size() + request.remove_addrs_size();
  const bool all = ranges + 2 > static_cast<size_t>(options_.max_txn_ops) ||
                   (request.add_size() > 0 && request.remove_addrs_size() > 0);
  bool read_all = all;
  for (int attempt = 0; attempt < 20; ++attempt) {
    FERRY_ASSIGN_OR_RETURN(
        Snapshot snap,
        ReadSegment(name, read_all, read_all ? nullptr : &request));
    if (!snap.exists) return NotRegistered(name);
    if (!SecretsEqual(request.owner_key(), snap.owner_key))
      return HeldByAnother(name);
    if (snap.window_truncated) {
      read_all = true;
      continue;
    }
    std::map<uint64_t, descriptor::Buffer>& bufs = snap.buffers;
    EtcdSegmentMeta meta = snap.meta;
    std::set<std::string> devices;
    for (const descriptor::TransportEndpoint& t : meta.segment().transports()) {
      for (const descriptor::Device& d : t.devices()) devices.insert(d.name());
    }
    uint64_t count = meta.buffers();
    uint64_t keys = meta.keys();
    int64_t delta = 0;  // Encoded bytes the descriptor gains.
    std::vector<RequestOp> ops;
    std::set<uint64_t> added_addrs;
    for (const descriptor::Buffer& b : request.add())
      added_addrs.insert(b.addr());
    for (uint64_t addr : request.remove_addrs()) {
      auto it = bufs.find(addr);
      if (it == bufs.end()) {
        return absl::NotFoundError(
            absl::StrCat("buffer 0x", absl::Hex(addr),
                         " to remove is not registered in the segment"));
      }
      keys -= it->second.keys_size();
      --count;
      delta -= descriptor::EncodedBufferBytes(it->second) +
               static_cast<int64_t>(keys_.BufKey(name, addr).size());
      bufs.erase(it);
      // Re-added in the same update: its put overwrites the key (etcd
      // refuses a transaction that deletes and puts the same key).
      if (added_addrs.count(addr) == 0) {
        ops.push_back(DeleteOp(keys_.BufKey(name, addr)));
      }
    }
    for (int i = 0; i < request.add_size(); ++i) {
      const descriptor::Buffer& b = request.add(i);
      const std::string field = absl::StrCat("add[", i, "]");
      for (const descriptor::NicKey& k : b.keys()) {
        if (devices.count(k.nic()) == 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ": NIC '", k.nic(),
              "' is not a device of any of the segment's transports"));
        }
      }
      auto next = bufs.lower_bound(b.addr());
      if (next != bufs.end() && next->first < b.addr() + b.length()) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": 0x", absl::Hex(b.addr()),
                         " overlaps the buffer at 0x", absl::Hex(next->first)));
      }
      if (next != bufs.begin()) {
        const descriptor::Buffer& prev = std::prev(next)->second;
        if (prev.addr() + prev.length() > b.addr()) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ": 0x", absl::Hex(b.addr()), " overlaps the buffer at 0x",
              absl::Hex(prev.addr())));
        }
      }
      keys += b.keys_size();
      ++count;
      delta += descriptor::EncodedBufferBytes(b) +
               static_cast<int64_t>(keys_.BufKey(name, b.addr()).size());
      meta.set_max_buffer_length(
          std::max<uint64_t>(meta.max_buffer_length(), b.length()));
      bufs.emplace(b.addr(), b);
      ops.push_back(PutOp(keys_.BufKey(name, b.addr()), b.SerializeAsString(),
                          meta.lease_id()));
    }
    size_t device_count = 0;
    for (const descriptor::TransportEndpoint& t : meta.segment().transports()) {
      device_count += t.devices_size();
    }
    if (count > descriptor::kMaxBuffersPerSegment ||
        keys > descriptor::kMaxKeysPerSegment ||
        device_count * count > descriptor::kMaxKeyIndexEntries) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "segment '", name, "' would hold ", count, " buffers with ", keys,
          " NIC keys; at most ", descriptor::kMaxBuffersPerSegment,
          " buffers, ", descriptor::kMaxKeysPerSegment, " keys and ",
          descriptor::kMaxKeyIndexEntries, " buffer x device entries"));
    }
    if (delta > 0) {
      FERRY_RETURN_IF_ERROR(CheckReadable(
          name, meta.bytes() + static_cast<uint64_t>(delta), count));
      FERRY_RETURN_IF_ERROR(CheckQuota(
          meta.client(), 0, 0, static_cast<uint64_t>(delta), false, deadline));
    }
    meta.set_bytes(static_cast<uint64_t>(
        std::max<int64_t>(0, static_cast<int64_t>(meta.bytes()) + delta)));
    meta.set_buffers(count);
    meta.set_keys(keys);
    meta.clear_change_added();
    meta.clear_change_removed();
    // Watchers read only what a change added; a change so large that its
    // addresses would swell the meta toward etcd's request limit (1.5 MiB)
    // has them read the whole segment instead (change_base 0).
    if (static_cast<size_t>(request.add_size() + request.remove_addrs_size()) <=
        kMaxChangeAddrs) {
      meta.set_change_base(static_cast<uint64_t>(snap.meta_revision));
      for (const descriptor::Buffer& b : request.add())
        meta.add_change_added(b.addr());
      for (uint64_t a : request.remove_addrs()) meta.add_change_removed(a);
    } else {
      meta.set_change_base(0);
    }
    std::vector<Compare> guard = {
        ValueIs(keys_.OwnerKey(name), request.owner_key()),
        ModRevisionIs(keys_.MetaKey(name), snap.meta_revision)};
    auto v =
        WriteChanges(name, std::move(guard), std::move(ops), meta, deadline);
    if (v.ok()) AfterWrite(meta.client(), delta, 0, static_cast<int64_t>(*v));
    if (v.ok() || v.status().code() != absl::StatusCode::kAborted) return v;
    // Changed between the read and the write (by the owner from elsewhere,
    // or its lease ran out): read again.
  }
  return absl::AbortedError(absl::StrCat(
      "segment '", name, "' kept changing during 20 attempts to update it"));
}

absl::Status EtcdStore::Remove(const RemoveSegmentRequest& request) {
  const std::string& name = request.name();
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  const absl::Time deadline = clock_->Now() + options_.rpc_timeout;
  MutexLock lock(&write_mu_);
  TxnRequest txn;
  *txn.add_compare() = ValueIs(keys_.OwnerKey(name), request.owner_key());
  *txn.add_success() = RangeOp(keys_.MetaKey(name));
  *txn.add_success() = DeleteOp(keys_.OwnerKey(name));
  *txn.add_success() = DeleteOp(keys_.MetaKey(name));
  *txn.add_success() =
      DeleteOp(keys_.BufPrefix(name), PrefixEnd(keys_.BufPrefix(name)));
  *txn.add_failure() = RangeOp(keys_.OwnerKey(name));
  FERRY_ASSIGN_OR_RETURN(const TxnResponse resp, Txn(txn, deadline));
  CountWritten(txn, resp);
  if (!resp.succeeded()) {
    if (resp.responses(0).response_range().kvs_size() == 0) {
      return NotRegistered(name);
    }
    return HeldByAnother(name);
  }
  EtcdSegmentMeta meta;
  const auto& kvs = resp.responses(0).response_range().kvs();
  if (!kvs.empty() && meta.ParseFromString(kvs[0].value())) {
    RevokeLease(meta.lease_id(), deadline);
    AfterWrite(meta.client(), -static_cast<int64_t>(meta.bytes()), -1,
               resp.header().revision());
  }
  return absl::OkStatus();
}

absl::Status EtcdStore::CheckQuota(const std::string& client,
                                   uint64_t old_client_bytes,
                                   uint64_t old_bytes, uint64_t bytes,
                                   bool new_segment, absl::Time deadline) {
  if (usage_.Stale(clock_->Now())) {
    // The records themselves, a page at a time: every store that shares
    // the prefix counts the same, and leases that ended are gone.
    EtcdUsage counted(options_, options_.prefix);
    const std::string prefix = keys_.MetaPrefix();
    const std::string end = PrefixEnd(prefix);
    std::string from = prefix;
    while (true) {
      TxnRequest txn;
      *txn.add_success() = RangeOp(from, end, kUsagePage);
      FERRY_ASSIGN_OR_RETURN(const TxnResponse resp, Txn(txn, deadline));
      const auto& range = resp.responses(0).response_range();
      for (const auto& kv : range.kvs()) {
        EtcdSegmentMeta meta;
        if (!meta.ParseFromString(kv.value())) continue;
        counted.Add(meta.client(), static_cast<int64_t>(meta.bytes()), 1);
      }
      if (!range.more() || range.kvs_size() == 0) break;
      from = range.kvs(range.kvs_size() - 1).key() + std::string(1, '\0');
    }
    usage_.Reset(std::move(counted), clock_->Now());
  }
  return usage_.Check(client, old_client_bytes, old_bytes, bytes, new_segment);
}

void EtcdStore::CountWritten(const TxnRequest& txn, const TxnResponse& resp) {
  // Only the branch that ran writes, and only success branches here do.
  if (!resp.succeeded()) return;
  uint64_t bytes = 0;
  for (int i = 0; i < txn.success_size(); ++i) {
    const RequestOp& op = txn.success(i);
    if (op.has_request_put()) {
      bytes += op.request_put().key().size() + op.request_put().value().size();
    } else if (op.has_request_delete_range() && i < resp.responses_size()) {
      // A tombstone per key deleted; a range's keys are about as long as
      // its start (the buffer prefix, without the address).
      bytes += op.request_delete_range().key().size() *
               static_cast<uint64_t>(
                   resp.responses(i).response_delete_range().deleted());
    }
  }
  compaction_.Count(bytes);
}

void EtcdStore::AfterWrite(const std::string& client, int64_t bytes,
                           int segments, int64_t revision) {
  usage_.Add(client, bytes, segments);
  const absl::Time now = clock_->Now();
  const int64_t upto = compaction_.Wrote(now, revision);
  if (upto == 0) return;
  etcdserverpb::CompactionRequest req;
  req.set_revision(upto);
  etcdserverpb::CompactionResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, clock_, now + options_.rpc_timeout);
  // Best effort: another store may have compacted past it already.
  kv_->Compact(&ctx, req, &resp);
}

}  // namespace ferry::metadata
