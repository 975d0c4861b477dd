#include "metadata/segment_store.h"

#include <malloc.h>

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/secure_random.h"
#include "common/status_macros.h"
#include "metadata/validation.h"

namespace ferry::metadata {

void SegmentStore::ExpireLocked() {
  const absl::Time now = clock_->Now();
  while (!expiry_.empty() && expiry_.begin()->first <= now) {
    const std::string name = expiry_.begin()->second;
    EraseLocked(name);
    expiry_.erase(expiry_.begin());
    NotifyLocked(name);
  }
}

void SegmentStore::SetWriteAhead(WriteAhead fn) {
  MutexLock lock(&mu_);
  write_ahead_ = std::move(fn);
}

absl::Status SegmentStore::WriteAheadLocked(uint64_t version) {
  return write_ahead_ ? write_ahead_(version) : absl::OkStatus();
}

void SegmentStore::NotifyLocked(const std::string& name) {
  auto it = listeners_.find(name);
  if (it == listeners_.end()) return;
  for (uint64_t id : it->second) subscriptions_[id].fn();
}

uint64_t SegmentStore::Subscribe(const std::string& name, Listener fn) {
  MutexLock lock(&mu_);
  const uint64_t id = next_subscription_++;
  subscriptions_[id] = {name, std::move(fn)};
  listeners_[name].push_back(id);
  return id;
}

void SegmentStore::Unsubscribe(uint64_t id) {
  MutexLock lock(&mu_);
  auto it = subscriptions_.find(id);
  if (it == subscriptions_.end()) return;
  auto& ids = listeners_[it->second.name];
  ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
  if (ids.empty()) listeners_.erase(it->second.name);
  subscriptions_.erase(it);
}

std::optional<SegmentEvent> SegmentStore::EventSince(const std::string& name,
                                                     uint64_t after_version) {
  std::shared_ptr<const descriptor::SegmentDescriptor> full;
  SegmentEvent ev;
  {
    MutexLock lock(&mu_);
    ExpireLocked();
    auto it = segments_.find(name);
    if (it == segments_.end()) {
      ev.set_gone(true);
      return ev;
    }
    const Entry& e = it->second;
    if (after_version == e.segment.version()) return std::nullopt;
    if (after_version >= e.put_version) {
      for (const Entry::Change& c : e.changes) {
        if (c.prev_version != after_version) continue;
        ev.set_version(c.version);
        for (const descriptor::Buffer& b : c.add) *ev.add_add() = b;
        for (uint64_t a : c.remove) ev.add_remove_addrs(a);
        return ev;
      }
    }
    if (e.assembled == nullptr) {
      e.assembled =
          std::make_shared<const descriptor::SegmentDescriptor>(Assemble(e));
    }
    full = e.assembled;
  }
  ev.set_version(full->version());
  *ev.mutable_full() = *full;  // The copy, outside the lock.
  return ev;
}

uint64_t SegmentStore::ChangeLogBytesForTesting(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = segments_.find(name);
  return it == segments_.end() ? 0 : it->second.change_bytes;
}

void SegmentStore::RenewLocked(const std::string& name, Entry* e) {
  if (e->expires != absl::InfiniteFuture()) expiry_.erase({e->expires, name});
  e->expires = e->ttl > absl::ZeroDuration() ? clock_->Now() + e->ttl
                                             : absl::InfiniteFuture();
  if (e->expires != absl::InfiniteFuture()) expiry_.insert({e->expires, name});
}

namespace {

// What the store's memory holds for a stored buffer, as its quotas count
// it: the message with its keys and strings (SpaceUsedLong, about 12 times
// the encoding for a buffer with a few NIC keys), the allocator's header
// on each of its blocks (the message, its keys' array, each key, its map
// node), its std::map node, and all of that again for the assembled copy
// readers share (Entry::assembled).
constexpr uint64_t kMapNodeBytes = 48;
constexpr uint64_t kBlockHeaderBytes = 16;
constexpr uint64_t kCopies = 2;

uint64_t HeldBufferBytes(const descriptor::Buffer& b) {
  const uint64_t blocks = 3 + static_cast<uint64_t>(b.keys_size());
  return kCopies *
         (b.SpaceUsedLong() + kMapNodeBytes + kBlockHeaderBytes * blocks);
}

// The same for a whole descriptor: its buffers as above, and the rest
// (transports, devices, names, the buffers' pointer array) twice.
uint64_t HeldSegmentBytes(const descriptor::SegmentDescriptor& d) {
  uint64_t buffers = 0, space = 0;
  for (const descriptor::Buffer& b : d.buffers()) {
    buffers += HeldBufferBytes(b);
    space += b.SpaceUsedLong();
  }
  return kCopies * (d.SpaceUsedLong() - space) + buffers;
}

absl::Status NotRegistered(const std::string& name) {
  return absl::NotFoundError(absl::StrCat(
      "segment '", name,
      "' is not registered (never published, its lease expired, or the "
      "metadata service restarted without it)"));
}

absl::Status HeldByAnother(const std::string& name) {
  return absl::FailedPreconditionError(
      absl::StrCat("segment '", name,
                   "' is held by another engine run (another owner key)"));
}

}  // namespace

absl::StatusOr<uint64_t> SegmentStore::PutFrom(const PutSegmentRequest& request,
                                               const std::string& client) {
  MutexLock lock(&mu_);
  return PutLocked(request, /*check_owner=*/true, client);
}

absl::StatusOr<uint64_t> SegmentStore::Restore(const PutSegmentRequest& request,
                                               uint64_t version,
                                               const std::string& client) {
  MutexLock lock(&mu_);
  // The recorded version itself, whatever order segments come back in;
  // later ones continue above every restored one.
  const uint64_t next = std::max(next_version_, version + 1);
  next_version_ = version;
  auto v = PutLocked(request, /*check_owner=*/false, client);
  next_version_ = next;
  return v;
}

uint64_t SegmentStore::bytes() const {
  MutexLock lock(&mu_);
  return total_bytes_;
}

void SegmentStore::EnforceLimits(bool on) {
  MutexLock lock(&mu_);
  enforce_limits_ = on;
}

uint64_t SegmentStore::NextVersion() const {
  MutexLock lock(&mu_);
  return next_version_;
}

void SegmentStore::AdvanceVersion(uint64_t version) {
  MutexLock lock(&mu_);
  next_version_ = std::max(next_version_, version);
}

void SegmentStore::ChargeLocked(const std::string& client, int64_t bytes,
                                int segments) {
  total_bytes_ += bytes;
  if (bytes < 0) freed_bytes_ += static_cast<uint64_t>(-bytes);
  if (client.empty()) return;
  Usage& u = usage_[client];
  u.bytes += bytes;
  u.segments += segments;
  if (u.segments == 0) usage_.erase(client);
}

absl::Status SegmentStore::CheckQuotaLocked(const std::string& client,
                                            uint64_t old_bytes, uint64_t bytes,
                                            bool new_segment) const {
  if (!enforce_limits_) return absl::OkStatus();
  if (total_bytes_ - old_bytes + bytes > limits_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the metadata store holds ", total_bytes_,
                     " bytes of memory in descriptors; ", bytes,
                     " more would pass its limit of ", limits_.max_bytes));
  }
  if (client.empty()) return absl::OkStatus();
  auto it = usage_.find(client);
  const Usage u = it != usage_.end() ? it->second : Usage{};
  if (u.bytes - old_bytes + bytes > limits_.max_client_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client ", client, " holds ", u.bytes,
        " bytes of memory in descriptors; ", bytes,
        " more would pass its quota of ", limits_.max_client_bytes));
  }
  if (new_segment && u.segments >= limits_.max_client_segments) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client ", client, " holds ", u.segments, " segments, its quota"));
  }
  return absl::OkStatus();
}

void SegmentStore::EraseLocked(const std::string& name) {
  auto it = segments_.find(name);
  if (it == segments_.end()) return;
  ChargeLocked(it->second.client, -static_cast<int64_t>(it->second.held), -1);
  segments_.erase(it);
  // glibc keeps freed memory in its arenas: after a lot has been freed,
  // give it back, so that a burst of large segments does not leave the
  // server's RSS at its peak.
  if (freed_bytes_ > (uint64_t{64} << 20)) {
    malloc_trim(0);
    freed_bytes_ = 0;
  }
}

absl::StatusOr<uint64_t> SegmentStore::PutLocked(
    const PutSegmentRequest& request, bool check_owner,
    const std::string& client) {
  const descriptor::SegmentDescriptor& in = request.segment();
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentDescriptor(in));
  FERRY_RETURN_IF_ERROR(ValidateOwnerKey(request.owner_key()));
  const absl::Duration lease_ttl = absl::Milliseconds(request.lease_ttl_ms());
  if (lease_ttl > kMaxLeaseTtl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease TTL ", absl::FormatDuration(lease_ttl),
        " is outside 0 (none) .. ", absl::FormatDuration(kMaxLeaseTtl)));
  }
  ExpireLocked();
  auto it = segments_.find(in.name());
  if (enforce_limits_ && it == segments_.end() &&
      segments_.size() >= kMaxSegments) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "metadata store holds ", kMaxSegments, " segments, its limit"));
  }
  if (check_owner && it != segments_.end() &&
      !SecretsEqual(request.owner_key(), it->second.owner_key)) {
    const Entry& held = it->second;
    return absl::AlreadyExistsError(absl::StrCat(
        "segment name '", in.name(), "' is held by a live engine (rpc ",
        held.segment.rpc_address(), ", incarnation ",
        held.segment.incarnation(), ") ",
        held.ttl > absl::ZeroDuration()
            ? absl::StrCat(
                  "whose lease ends in ",
                  absl::FormatDuration(absl::Ceil(held.expires - clock_->Now(),
                                                  absl::Milliseconds(1))),
                  " unless renewed")
            : "without a lease, until it removes it",
        ": choose another name, or stop that engine first"));
  }
  const uint64_t bytes = in.ByteSizeLong();
  const uint64_t held = HeldSegmentBytes(in);
  const bool replacing = it != segments_.end();
  const bool same_client = replacing && it->second.client == client;
  FERRY_RETURN_IF_ERROR(CheckQuotaLocked(
      client, same_client ? it->second.held : 0, held, !same_client));
  FERRY_RETURN_IF_ERROR(WriteAheadLocked(next_version_));
  if (replacing) {
    ChargeLocked(it->second.client, -static_cast<int64_t>(it->second.held), -1);
  }
  ChargeLocked(client, static_cast<int64_t>(held), 1);
  const uint64_t version = next_version_++;
  Entry& e = segments_[in.name()];
  e.client = client;
  e.bytes = bytes;
  e.segment = in;
  e.segment.set_version(version);
  {
    // Not clear_buffers(): a cleared repeated field keeps every element
    // allocated for reuse, which the buffers' map then holds a copy of.
    google::protobuf::RepeatedPtrField<descriptor::Buffer> drop;
    drop.Swap(e.segment.mutable_buffers());
  }
  e.buffers.clear();
  e.keys = 0;
  uint64_t exact = kCopies * e.segment.SpaceUsedLong();
  for (const descriptor::Buffer& b : in.buffers()) {
    e.keys += b.keys_size();
    exact += HeldBufferBytes(e.buffers.emplace(b.addr(), b).first->second);
  }
  // Charged as held, now that it is: the estimate above only admitted it.
  ChargeLocked(client, static_cast<int64_t>(exact) - static_cast<int64_t>(held),
               0);
  e.held = exact;
  e.device_names.clear();
  e.devices = 0;
  for (const descriptor::TransportEndpoint& t : in.transports()) {
    e.devices += t.devices_size();
    for (const descriptor::Device& d : t.devices())
      e.device_names.insert(d.name());
  }
  e.owner_key = request.owner_key();
  e.assembled.reset();
  e.ttl = lease_ttl;
  e.put_version = version;
  e.changes.clear();
  e.change_bytes = 0;
  RenewLocked(in.name(), &e);
  NotifyLocked(in.name());
  return version;
}

absl::StatusOr<absl::Duration> SegmentStore::KeepAlive(
    const KeepAliveRequest& request) {
  const std::string& name = request.name();
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  MutexLock lock(&mu_);
  ExpireLocked();
  auto it = segments_.find(name);
  if (it == segments_.end()) return NotRegistered(name);
  if (!SecretsEqual(request.owner_key(), it->second.owner_key))
    return HeldByAnother(name);
  RenewLocked(name, &it->second);
  return it->second.ttl;
}

absl::StatusOr<uint64_t> SegmentStore::UpdateBuffers(
    const UpdateBuffersRequest& request) {
  // Charged to the client that put the segment.
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(request.name()));
  for (const descriptor::Buffer& b : request.add()) {
    FERRY_RETURN_IF_ERROR(descriptor::ValidateBuffer(b));
  }
  MutexLock lock(&mu_);
  ExpireLocked();
  auto it = segments_.find(request.name());
  if (it == segments_.end()) return NotRegistered(request.name());
  Entry& e = it->second;
  if (!SecretsEqual(request.owner_key(), e.owner_key))
    return HeldByAnother(request.name());
  // Applied in place with an undo log, so that a failure changes nothing.
  std::vector<descriptor::Buffer> removed;
  std::vector<uint64_t> added;
  size_t keys = e.keys;
  auto undo = [&](absl::Status why) {
    for (uint64_t a : added) e.buffers.erase(a);
    for (descriptor::Buffer& b : removed) {
      const uint64_t a = b.addr();
      e.buffers.emplace(a, std::move(b));
    }
    return why;
  };
  for (uint64_t addr : request.remove_addrs()) {
    auto b = e.buffers.find(addr);
    if (b == e.buffers.end()) {
      return undo(
          absl::NotFoundError(absl::StrCat("buffer 0x", absl::Hex(addr),
                                           " to remove is not registered in "
                                           "the segment")));
    }
    keys -= b->second.keys_size();
    removed.push_back(std::move(b->second));
    e.buffers.erase(b);
  }
  for (int i = 0; i < request.add_size(); ++i) {
    const descriptor::Buffer& b = request.add(i);
    const std::string field = absl::StrCat("add[", i, "]");
    for (const descriptor::NicKey& k : b.keys()) {
      if (!e.device_names.contains(k.nic())) {
        return undo(absl::InvalidArgumentError(absl::StrCat(
            field, ": NIC '", k.nic(),
            "' is not a device of any of the segment's transports")));
      }
    }
    auto next = e.buffers.lower_bound(b.addr());
    if (next != e.buffers.end() && next->first < b.addr() + b.length()) {
      return undo(absl::InvalidArgumentError(
          absl::StrCat(field, ": 0x", absl::Hex(b.addr()),
                       " overlaps the buffer at 0x", absl::Hex(next->first))));
    }
    if (next != e.buffers.begin()) {
      const descriptor::Buffer& prev = std::prev(next)->second;
      if (prev.addr() + prev.length() > b.addr()) {
        return undo(absl::InvalidArgumentError(absl::StrCat(
            field, ": 0x", absl::Hex(b.addr()), " overlaps the buffer at 0x",
            absl::Hex(prev.addr()))));
      }
    }
    keys += b.keys_size();
    e.buffers.emplace(b.addr(), b);
    added.push_back(b.addr());
  }
  if (e.buffers.size() > descriptor::kMaxBuffersPerSegment ||
      keys > descriptor::kMaxKeysPerSegment ||
      e.devices * e.buffers.size() > descriptor::kMaxKeyIndexEntries) {
    return undo(absl::ResourceExhaustedError(absl::StrCat(
        "segment '", request.name(), "' would hold ", e.buffers.size(),
        " buffers with ", keys, " NIC keys; at most ",
        descriptor::kMaxBuffersPerSegment, " buffers, ",
        descriptor::kMaxKeysPerSegment, " keys and ",
        descriptor::kMaxKeyIndexEntries, " buffer x device entries")));
  }
  // Bytes the change adds to the stored descriptor: exactly what each
  // buffer adds to its encoding, so that Put and UpdateBuffers charge and
  // refund the same amounts.
  int64_t delta = 0, held_added = 0;
  for (const descriptor::Buffer& b : request.add())
    delta += descriptor::EncodedBufferBytes(b);
  // Memory as held: the stored copies, which removals refund exactly.
  for (uint64_t a : added) held_added += HeldBufferBytes(e.buffers.at(a));
  int64_t held_delta = held_added;
  for (const descriptor::Buffer& b : removed) {
    delta -= descriptor::EncodedBufferBytes(b);
    held_delta -= HeldBufferBytes(b);
  }
  // The whole descriptor must still fit one GetSegment answer.
  if (delta > 0 && e.bytes + delta > kMaxDescriptorBytes) {
    return undo(absl::ResourceExhaustedError(absl::StrCat(
        "segment '", request.name(), "' would take ", e.bytes + delta,
        " bytes encoded; at most ", kMaxDescriptorBytes)));
  }
  if (held_delta > 0) {
    if (absl::Status q = CheckQuotaLocked(e.client, 0, held_delta, false);
        !q.ok()) {
      return undo(q);
    }
  }
  if (absl::Status w = WriteAheadLocked(next_version_); !w.ok()) {
    return undo(w);
  }
  ChargeLocked(e.client, held_delta, 0);
  e.bytes += delta;
  e.held += held_delta;
  e.keys = keys;
  e.assembled.reset();
  const uint64_t version = next_version_++;
  if (listeners_.contains(request.name())) {
    Entry::Change c;
    c.prev_version = e.segment.version();
    c.version = version;
    c.add.assign(request.add().begin(), request.add().end());
    c.remove.assign(request.remove_addrs().begin(),
                    request.remove_addrs().end());
    // What it holds in memory: one copy of each added buffer, as the
    // quotas count memory (HeldBufferBytes counts two), and the addresses.
    c.bytes = 64 + 8 * c.remove.size() + held_added / kCopies;
    e.change_bytes += c.bytes;
    e.changes.push_back(std::move(c));
    const uint64_t budget = std::max(kMinChangeLogBytes, e.held / 2);
    while (!e.changes.empty() && (e.changes.size() > kMaxRememberedChanges ||
                                  e.change_bytes > budget)) {
      e.change_bytes -= e.changes.front().bytes;
      e.changes.pop_front();
    }
  } else {
    // Nobody watches: a later watcher starts from the whole descriptor.
    e.changes.clear();
    e.change_bytes = 0;
    e.put_version = version;
  }
  e.segment.set_version(version);
  // An update from the owner shows it alive, as a KeepAlive does.
  RenewLocked(request.name(), &e);
  NotifyLocked(request.name());
  return version;
}

descriptor::SegmentDescriptor SegmentStore::Assemble(const Entry& e) {
  descriptor::SegmentDescriptor d = e.segment;
  d.mutable_buffers()->Reserve(static_cast<int>(e.buffers.size()));
  for (const auto& [addr, b] : e.buffers) *d.add_buffers() = b;
  return d;
}

absl::StatusOr<descriptor::SegmentDescriptor> SegmentStore::Get(
    const std::string& name) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  std::shared_ptr<const descriptor::SegmentDescriptor> d;
  {
    MutexLock lock(&mu_);
    auto it = segments_.find(name);
    if (it == segments_.end() || Expired(it->second)) {
      return absl::NotFoundError(
          absl::StrCat("segment '", name, "' is not registered"));
    }
    const Entry& e = it->second;
    if (e.assembled == nullptr) {
      e.assembled =
          std::make_shared<const descriptor::SegmentDescriptor>(Assemble(e));
    }
    d = e.assembled;
  }
  return *d;  // The copy, outside the lock.
}

absl::Status SegmentStore::Remove(const RemoveSegmentRequest& request) {
  const std::string& name = request.name();
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  MutexLock lock(&mu_);
  ExpireLocked();
  auto it = segments_.find(name);
  if (it == segments_.end()) return NotRegistered(name);
  if (!SecretsEqual(request.owner_key(), it->second.owner_key))
    return HeldByAnother(name);
  FERRY_RETURN_IF_ERROR(WriteAheadLocked(0));
  if (it->second.expires != absl::InfiniteFuture()) {
    expiry_.erase({it->second.expires, name});
  }
  EraseLocked(name);
  NotifyLocked(name);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> SegmentStore::List() {
  MutexLock lock(&mu_);
  std::vector<std::string> names;
  names.reserve(segments_.size());
  for (const auto& [name, e] : segments_) {
    if (!Expired(e)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

SegmentStore::Snapshot SegmentStore::TakeSnapshot() const {
  MutexLock lock(&mu_);
  Snapshot snap;
  snap.next_version = next_version_;
  snap.segments.reserve(segments_.size());
  for (const auto& [name, e] : segments_) {
    if (Expired(e)) continue;
    PutSegmentRequest put;
    *put.mutable_segment() = Assemble(e);
    put.set_owner_key(e.owner_key);
    put.set_lease_ttl_ms(
        static_cast<uint32_t>(absl::ToInt64Milliseconds(e.ttl)));
    snap.segments.push_back({std::move(put), e.segment.version(), e.client});
  }
  return snap;
}

}  // namespace ferry::metadata
