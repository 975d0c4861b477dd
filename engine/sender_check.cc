#include "engine/sender_check.h"

#include <algorithm>
#include <chrono>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/identity.h"
#include "common/socket_util.h"
#include "metadata/auth.h"

namespace ferry {

std::string BareCallerHost(const std::string& caller) {
  absl::string_view h = caller;
  if (!absl::ConsumePrefix(&h, "ipv4:") && absl::ConsumePrefix(&h, "ipv6:")) {
    absl::ConsumePrefix(&h, "[");
    // A group of callers (metadata::AddressGroup): "[2001:db8::]/64".
    if (absl::ConsumeSuffix(&h, "]/64")) return absl::StrCat(h, "/64");
    absl::ConsumeSuffix(&h, "]");
  }
  // A dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d.
  absl::ConsumePrefix(&h, "::ffff:");
  return std::string(h);
}

absl::Time SenderCheck::SteadyNow() {
  return absl::UnixEpoch() +
         absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

std::optional<SenderCheck::Cached> SenderCheck::FindLocked(
    const std::string& claimed) {
  if (auto it = cache_.find(claimed); it != cache_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return it->second.value;
  }
  if (auto it = absent_.find(claimed); it != absent_.end()) {
    Cached c;
    c.at = it->second;
    return c;
  }
  return std::nullopt;
}

void SenderCheck::CacheLocked(const std::string& claimed, const Cached& value) {
  if (!value.found) {
    // Apart from the segments found: made-up names never push those out.
    if (auto it = cache_.find(claimed); it != cache_.end()) {
      lru_.erase(it->second.lru);
      cache_.erase(it);
    }
    if (absent_.size() >= kMaxAbsent && !absent_.contains(claimed)) {
      absl::erase_if(absent_, [&](const auto& e) {
        return value.at - e.second >= kAbsentFor;
      });
      if (absent_.size() >= kMaxAbsent) absent_.clear();
    }
    absent_[claimed] = value.at;
    return;
  }
  absent_.erase(claimed);
  if (auto it = cache_.find(claimed); it != cache_.end()) {
    it->second.value = value;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return;
  }
  if (cache_.size() >= kMaxCached) {
    cache_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(claimed);
  cache_[claimed] = Entry{value, lru_.begin()};
}

void SenderCheck::RefundLocked(const std::string& claimed,
                               const std::string& group) {
  auto it = cache_.find(claimed);
  if (it == cache_.end() || it->second.value.charged != group) return;
  it->second.value.charged.clear();
  ReturnLookupLocked(group);
}

absl::StatusOr<SenderCheck::Cached> SenderCheck::GraceLocked(
    const std::string& claimed, absl::Time now) {
  if (auto it = cache_.find(claimed);
      it != cache_.end() &&
      now - it->second.value.at < kCacheFor + outage_grace_) {
    return it->second.value;
  }
  return absl::UnavailableError(
      absl::StrCat("cannot look up segment '", claimed,
                   "' to check the sender: ", store_error_));
}

absl::Status SenderCheck::TakeLookupLocked(const std::string& caller,
                                           absl::Time now) {
  auto it = budgets_.find(caller);
  if (it == budgets_.end()) {
    if (budgets_.size() >= kMaxCached) {
      // Full buckets carry nothing a new one would not.
      absl::erase_if(budgets_, [&](const auto& e) {
        return absl::ToDoubleSeconds(now - e.second.at) * kLookupsPerSecond +
                   e.second.tokens >=
               kLookupBurst;
      });
      // So many callers read just now: an attack, or a cluster starting.
      if (budgets_.size() >= kMaxCached) {
        return absl::UnavailableError(
            absl::StrCat(kMaxCached,
                         " callers have made this engine look up senders "
                         "just now"));
      }
    }
    it = budgets_.emplace(caller, Bucket{kLookupBurst, now}).first;
  }
  Bucket& b = it->second;
  b.tokens =
      std::min(kLookupBurst, b.tokens + absl::ToDoubleSeconds(now - b.at) *
                                            kLookupsPerSecond);
  b.at = now;
  if (b.tokens < 1) {
    return absl::UnavailableError(
        absl::StrCat("calls from ", BareCallerHost(caller),
                     " have made this engine look up senders ", kLookupBurst,
                     " times just now"));
  }
  b.tokens -= 1;
  return absl::OkStatus();
}

void SenderCheck::ReturnLookupLocked(const std::string& caller) {
  auto it = budgets_.find(caller);
  if (it == budgets_.end()) return;  // Pruned meanwhile: it was full.
  it->second.tokens = std::min(kLookupBurst, it->second.tokens + 1);
}

SenderCheck::~SenderCheck() {
  std::vector<std::thread> readers;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    readers.swap(readers_);
    work_.SignalAll();
  }
  for (std::thread& t : readers) t.join();
}

absl::Status SenderCheck::QueueReadLocked(const std::string& claimed,
                                          const std::string& caller,
                                          absl::Time now) {
  if (queue_.size() >= kMaxQueued) {
    return absl::UnavailableError(absl::StrCat(
        "too many sender lookups queued to check segment '", claimed, "'"));
  }
  // Budgets are per host: an IPv6 caller's /64 is one caller.
  const std::string group = metadata::AddressGroup(caller);
  if (absl::Status b = TakeLookupLocked(group, now); !b.ok()) {
    return absl::UnavailableError(absl::StrCat(b.message(), "; segment '",
                                               claimed, "' is not looked up"));
  }
  queue_.push_back(Read{claimed, group});
  pending_.insert(claimed);
  // Readers signalled but not yet awake still count as idle.
  if (static_cast<int>(queue_.size()) > idle_readers_ &&
      static_cast<int>(readers_.size()) < kMaxLookupsInFlight) {
    try {
      readers_.emplace_back([this] { Reader(); });
    } catch (const std::system_error& e) {
      if (readers_.empty()) {  // Out of threads: nobody would read it.
        queue_.pop_back();
        pending_.erase(claimed);
        ReturnLookupLocked(group);
        return absl::UnavailableError(
            absl::StrCat("cannot start a thread to look up segment '", claimed,
                         "': ", e.what()));
      }
    }
  }
  work_.Signal();
  return absl::OkStatus();
}

void SenderCheck::Reader() {
  MutexLock lock(&mu_);
  while (true) {
    ++idle_readers_;
    while (queue_.empty() && !stopping_) work_.Wait(&mu_);
    --idle_readers_;
    if (stopping_) return;
    Read read = std::move(queue_.front());
    queue_.pop_front();
    if (now_() < store_down_until_) {
      // Out of reach: its checks use the grace (GraceLocked) meanwhile,
      // and the caller keeps the token of a read not made.
      ReturnLookupLocked(read.charged);
      pending_.erase(read.name);
      looked_up_.SignalAll();
      continue;
    }
    // The answer is as of when the read began: a check that began after
    // must not take it for a reading made since (a refusal on it would be
    // final, and the sender may have restarted in between).
    const absl::Time started = now_();
    mu_.Unlock();
    auto desc = store_->Get(read.name);
    mu_.Lock();
    const absl::Time now = now_();
    pending_.erase(read.name);
    looked_up_.SignalAll();
    if (!desc.ok() && desc.status().code() != absl::StatusCode::kNotFound) {
      // Out of reach: no new reads for a while (each would wait its RPC
      // timeout).
      store_down_until_ = now + kStoreDownFor;
      store_error_ = std::string(desc.status().message());
      continue;
    }
    Cached entry;
    entry.found = desc.ok();
    if (desc.ok()) {
      entry.identity_key = desc->identity_key();
      auto hp = ParseHostPort(desc->rpc_address());
      if (hp.ok()) entry.host = BareCallerHost(hp->host);
    }
    entry.at = started;
    entry.charged = std::move(read.charged);
    CacheLocked(read.name, entry);
  }
}

absl::StatusOr<SenderCheck::Cached> SenderCheck::Published(
    const std::string& claimed, const std::string& caller, bool fresh,
    absl::Time since) {
  MutexLock lock(&mu_);
  const absl::Time wait_deadline = now_() + kReadWait;
  while (true) {
    const absl::Time now = now_();
    if (auto c = FindLocked(claimed);
        c.has_value() &&
        (c->at >= since ||
         (!fresh && now - c->at < (c->found ? kCacheFor : kAbsentFor)))) {
      return *c;
    }
    if (now < store_down_until_) return GraceLocked(claimed, now);
    if (!pending_.contains(claimed)) {
      if (absl::Status q = QueueReadLocked(claimed, caller, now); !q.ok()) {
        return q;
      }
    }
    // Its read is queued or running: wait for it, bounded in number and
    // time, so that a metadata store that hangs cannot park every thread
    // that serves calls (handshakes of peers whose keys are cached
    // included). A check that cannot wait is told to try again; its read
    // goes on, and the next try finds the answer cached.
    if (waiting_ >= kMaxWaiting) {
      return absl::UnavailableError(
          absl::StrCat("too many checks wait on sender lookups; segment '",
                       claimed, "' is being looked up"));
    }
    ++waiting_;
    const bool timed_out = looked_up_.WaitWithTimeout(
        &mu_, std::max(wait_deadline - now, absl::ZeroDuration()));
    --waiting_;
    if (timed_out && pending_.contains(claimed)) {
      return absl::UnavailableError(
          absl::StrCat("the lookup of segment '", claimed, "' is taking over ",
                       absl::FormatDuration(kReadWait)));
    }
  }
}

absl::Status SenderCheck::VerifyP2p(const std::string& claimed,
                                    const std::string& caller) {
  auto hp = ParseHostPort(claimed);
  const std::string host = hp.ok() ? BareCallerHost(hp->host) : "";
  const std::string from = BareCallerHost(caller);
  if (host.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a call from ", from, " claims segment '", claimed,
        "', which is no host:port (P2PHANDSHAKE names segments by address)"));
  }
  if (host != from) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a call from ", from, " claims segment '", claimed,
        "', whose address is on ", host,
        " (if that engine reaches this one from another address -- several "
        "interfaces, NAT -- set its advertise_host to the address it sends "
        "from)"));
  }
  return absl::OkStatus();
}

absl::Status SenderCheck::P2pReadable(const std::string& claimed,
                                      const std::string& caller) {
  const std::string from = BareCallerHost(caller);
  // A literal only: a name (localhost, a DNS name pointing home) or a
  // short form (127.1) would be resolved by the read, past the checks
  // below.
  auto sa = ParseNumericEndpoint(claimed);
  if (!sa.ok() || sa->IsWildcard()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a call from ", from, " claims segment '", claimed,
        "', which is no numeric address an engine serves at (P2PHANDSHAKE "
        "names segments by address)"));
  }
  // Reading it would have this engine call its own host's loopback
  // services on a remote caller's say-so; and no remote engine is there.
  // (IsLoopback sees IPv4-mapped loopback too.)
  if (sa->IsLoopback() && !IsLoopbackHost(from)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a call from ", from, " claims segment '", claimed,
        "', a loopback address, which only a caller on this host can be"));
  }
  return absl::OkStatus();
}

absl::Status SenderCheck::Verify(const std::string& claimed,
                                 const std::string& caller,
                                 const std::string& content,
                                 const std::string& signature,
                                 std::optional<uint64_t> seq, bool check_host) {
  const std::string from = BareCallerHost(caller);
  // Malformed before anything is read for it.
  if (!signature.empty() && signature.size() != kSignatureBytes) {
    return absl::PermissionDeniedError(absl::StrCat(
        "a call from ", from, " claims segment '", claimed, "' with a ",
        signature.size(), "-byte signature; an identity signature has ",
        kSignatureBytes));
  }
  if (p2p_) {
    absl::Status where =
        check_host ? VerifyP2p(claimed, caller) : P2pReadable(claimed, caller);
    if (!where.ok()) return where;
    if (store_ == nullptr) return absl::OkStatus();
    // The claimed address is read for its key: on the caller's own host,
    // or (no host check) wherever it is, on the caller's lookup budget.
  }
  const absl::Time began = now_();
  for (bool fresh : {false, true}) {
    auto published = Published(claimed, caller, fresh, began);
    if (!published.ok()) return published.status();
    // A refusal stands on an answer read since this check began. One from
    // before is read again (once, if it is not too young), or the caller
    // is told to try again: the segment may have just restarted.
    auto refuse = [&](const std::string& why) -> std::optional<absl::Status> {
      const std::string what = absl::StrCat(
          "a call from ", from, " claims segment '", claimed, "', ", why);
      if (published->at >= began) return absl::PermissionDeniedError(what);
      const absl::Duration age = now_() - published->at;
      if (!fresh && age >= kRecheckAfter) return std::nullopt;
      return absl::UnavailableError(absl::StrCat(
          what, " (as read ",
          absl::FormatDuration(absl::Trunc(age, absl::Milliseconds(1))),
          " ago): try again"));
    };
    std::optional<absl::Status> refused;
    if (!published->found) {
      refused = refuse("which is not registered");
    } else if (published->identity_key.empty()) {
      // An engine of a release before identity keys: held to what those
      // releases checked, the host it publishes from, while a cluster is
      // upgraded.
      if (!check_host || published->host == from) return absl::OkStatus();
      refused = refuse(absl::StrCat(
          "which publishes no identity key (a Ferry release before them) "
          "and is published at ",
          published->host));
    } else if (signature.empty()) {
      // Refused as the other mismatches are: on a read older than the call
      // the segment may since have restarted as a release without keys.
      refused = refuse(
          "but the message is not signed (the segment publishes an identity "
          "key)");
    } else if (absl::Status v =
                   VerifySignature(published->identity_key, content, signature);
               !v.ok()) {
      refused = refuse(absl::StrCat("but ", v.message()));
    } else {
      MutexLock lock(&mu_);
      const absl::Status r =
          seq.has_value()
              ? replay_.Accept(claimed, published->identity_key, *seq)
              : absl::OkStatus();
      if (r.ok()) {
        // The sender holds the key and the call is new: what reading it
        // cost this caller's budget was not a flood's (a P2P read dials
        // an address a caller names, though). Once per read, only to the
        // caller charged, and not for a replayed call: a forger's reads
        // are not refunded by others' calls, nor by replaying one.
        if (!p2p_) RefundLocked(claimed, metadata::AddressGroup(caller));
        return r;
      }
      const std::string what =
          absl::StrCat("a call from ", from, " claims segment '", claimed,
                       "': ", r.message());
      // Too old to tell from a replay: sent again, it gets a new number.
      return r.code() == absl::StatusCode::kPermissionDenied
                 ? absl::PermissionDeniedError(what)
                 : absl::UnavailableError(absl::StrCat(what, ": try again"));
    }
    if (refused.has_value()) return *refused;
  }
  return absl::InternalError("unreachable");
}

}  // namespace ferry
