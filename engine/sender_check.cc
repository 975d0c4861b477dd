#include "engine/sender_check.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
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

absl::Status SenderCheck::Verify(const std::string& claimed,
                                 const std::string& caller) {
  const absl::Time now = absl::Now();
  std::string host;
  bool cached = false;
  {
    MutexLock lock(&mu_);
    auto it = cache_.find(claimed);
    if (it != cache_.end() && now - it->second.at < kCacheFor) {
      host = it->second.host;
      cached = true;
    }
  }
  if (!cached) {
    auto desc = store_->Get(claimed);
    if (!desc.ok() && desc.status().code() != absl::StatusCode::kNotFound) {
      return absl::UnavailableError(
          absl::StrCat("cannot look up segment '", claimed,
                       "' to check the sender: ", desc.status().message()));
    }
    if (desc.ok()) {
      auto hp = ParseHostPort(desc->rpc_address());
      host = hp.ok() ? BareCallerHost(hp->host) : "";
    }
    MutexLock lock(&mu_);
    if (cache_.size() >= kMaxCached) cache_.clear();  // Rare; bounded.
    cache_[claimed] = {host, now};
  }
  const std::string from = BareCallerHost(caller);
  if (host.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat("notification from ", from, " claims segment '", claimed,
                     "', which is not registered"));
  }
  if (host != from) {
    return absl::PermissionDeniedError(
        absl::StrCat("notification from ", from, " claims segment '", claimed,
                     "', which is published at ", host));
  }
  return absl::OkStatus();
}

}  // namespace ferry
