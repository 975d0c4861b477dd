#include "engine/sender_check.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/socket_util.h"

namespace ferry {

std::string BareCallerHost(const std::string& caller) {
  absl::string_view h = caller;
  if (!absl::ConsumePrefix(&h, "ipv4:") && absl::ConsumePrefix(&h, "ipv6:")) {
    absl::ConsumePrefix(&h, "[");
    absl::ConsumeSuffix(&h, "]");
  }
  // A dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d.
  absl::ConsumePrefix(&h, "::ffff:");
  return std::string(h);
}

absl::StatusOr<std::string> SenderCheck::PublishedHost(
    const std::string& claimed) {
  if (store_ == nullptr) {
    // P2P: the name is the engine's host:port.
    auto hp = ParseHostPort(claimed);
    return hp.ok() ? BareCallerHost(hp->host) : "";
  }
  const absl::Time now = clock_->Now();
  {
    MutexLock lock(&mu_);
    // Bounded: the lookup waited for ends within the store's RPC timeout.
    while (looking_up_.contains(claimed)) looked_up_.Wait(&mu_);
    auto it = cache_.find(claimed);
    if (it != cache_.end() && now - it->second.at < kCacheFor) {
      return it->second.host;
    }
    if (in_flight_ >= kMaxLookupsInFlight) {
      return absl::UnavailableError(absl::StrCat(
          "too many sender lookups at once to check segment '", claimed, "'"));
    }
    ++in_flight_;
    looking_up_.insert(claimed);
  }
  auto desc = store_->Get(claimed);
  MutexLock lock(&mu_);
  --in_flight_;
  looking_up_.erase(claimed);
  looked_up_.SignalAll();
  if (!desc.ok() && desc.status().code() != absl::StatusCode::kNotFound) {
    return absl::UnavailableError(
        absl::StrCat("cannot look up segment '", claimed,
                     "' to check the sender: ", desc.status().message()));
  }
  std::string host;
  if (desc.ok()) {
    auto hp = ParseHostPort(desc->rpc_address());
    if (hp.ok()) host = BareCallerHost(hp->host);
  }
  if (cache_.size() >= kMaxCached) {
    absl::erase_if(
        cache_, [&](const auto& e) { return now - e.second.at >= kCacheFor; });
    if (cache_.size() >= kMaxCached) cache_.clear();  // Bounded either way.
  }
  cache_[claimed] = {host, now};
  return host;
}

absl::Status SenderCheck::Verify(const std::string& claimed,
                                 const std::string& caller) {
  auto host = PublishedHost(claimed);
  if (!host.ok()) return host.status();
  const std::string from = BareCallerHost(caller);
  if (host->empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat("notification from ", from, " claims segment '", claimed,
                     "', which is not registered"));
  }
  if (*host != from) {
    return absl::PermissionDeniedError(absl::StrCat(
        "notification from ", from, " claims segment '", claimed,
        "', which is published at ", *host,
        " (if that engine reaches this one from another address -- several "
        "interfaces, NAT -- set its advertise_host to the address it sends "
        "from, or turn refuse_unverified_notifications off: "
        "FERRY_REFUSE_UNVERIFIED_NOTIFICATIONS=0 for ferry.mooncake)"));
  }
  return absl::OkStatus();
}

}  // namespace ferry
