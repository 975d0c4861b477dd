#include "metadata/connection_activity.h"

#include <sys/socket.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "grpcpp/server_context.h"

namespace ferry::metadata {
namespace {

constexpr absl::string_view kMappedPrefix = "ipv6:[::ffff:";

// Reports a call's response messages and a refusal for want of the
// token. Every hook proceeds at once: this only watches.
class ActivityInterceptor : public grpc::experimental::Interceptor {
 public:
  ActivityInterceptor(ConnectionActivity* activity,
                      grpc::experimental::ServerRpcInfo* info)
      : activity_(activity), info_(info) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    using grpc::experimental::InterceptionHookPoints;
    // A response message: the call got past authentication and reached a
    // method that exists (an error answer carries none).
    if (!served_ && m->QueryInterceptionHookPoint(
                        InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      served_ = true;  // The first tells; a stream's later ones add nothing.
      activity_->CallServed(info_->server_context()->peer());
    }
    if (m->QueryInterceptionHookPoint(
            InterceptionHookPoints::PRE_SEND_STATUS) &&
        m->GetSendStatus().error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      activity_->CallRefused(info_->server_context()->peer());
    }
    m->Proceed();
  }

 private:
  ConnectionActivity* const activity_;
  grpc::experimental::ServerRpcInfo* const info_;
  // One interceptor per call, its hooks run one at a time.
  bool served_ = false;
};

class ActivityFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ActivityFactory(ConnectionActivity* activity)
      : activity_(activity) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new ActivityInterceptor(activity_, info);
  }

 private:
  ConnectionActivity* const activity_;
};

}  // namespace

std::string ConnectionName(const SockAddr& sa) {
  return NormalizeGrpcPeer(
      sa.family() == AF_INET6
          ? absl::StrCat("ipv6:[", sa.Host(), "]:", sa.port())
          : absl::StrCat("ipv4:", sa.Host(), ":", sa.port()));
}

std::string NormalizeGrpcPeer(std::string peer) {
  peer = absl::StrReplaceAll(peer, {{"%5B", "["}, {"%5D", "]"}, {"%25", "%"}});
  // "ipv6:[fe80::1%2]:41234" -> "ipv6:[fe80::1]:41234".
  const size_t scope = peer.find('%');
  const size_t close = peer.find(']');
  if (scope != std::string::npos && close != std::string::npos &&
      scope < close) {
    peer.erase(scope, close - scope);
  }
  // "ipv6:[::ffff:10.0.0.7]:41234" -> "ipv4:10.0.0.7:41234".
  if (absl::StartsWithIgnoreCase(peer, kMappedPrefix)) {
    const size_t end = peer.find(']');
    const std::string host =
        end == std::string::npos
            ? ""
            : peer.substr(kMappedPrefix.size(), end - kMappedPrefix.size());
    if (!host.empty() && host.find('.') != std::string::npos) {
      return absl::StrCat("ipv4:", host, peer.substr(end + 1));
    }
  }
  return peer;
}

uint64_t ConnectionActivity::Track(const std::string& name) {
  MutexLock lock(&mu_);
  const uint64_t ticket = ++next_ticket_;
  state_[name] = {State::kSilent, ticket};
  return ticket;
}

void ConnectionActivity::Forget(const std::string& name, uint64_t ticket) {
  MutexLock lock(&mu_);
  auto it = state_.find(name);
  if (it != state_.end() && it->second.ticket == ticket) state_.erase(it);
}

std::vector<bool> ConnectionActivity::UsefulAll(
    const std::vector<const std::string*>& names) const {
  std::vector<bool> out;
  out.reserve(names.size());
  MutexLock lock(&mu_);
  for (const std::string* name : names) {
    auto it = state_.find(*name);
    out.push_back(it != state_.end() && it->second.state == State::kUseful);
  }
  return out;
}

void ConnectionActivity::CallServed(const std::string& peer) {
  const std::string name = NormalizeGrpcPeer(peer);
  MutexLock lock(&mu_);
  auto it = state_.find(name);
  if (it != state_.end() && it->second.state == State::kSilent) {
    it->second.state = State::kUseful;
  }
}

void ConnectionActivity::CallRefused(const std::string& peer) {
  const std::string name = NormalizeGrpcPeer(peer);
  MutexLock lock(&mu_);
  auto it = state_.find(name);
  // For good: a connection that once came without the token is an
  // outsider's, whatever it does next.
  if (it != state_.end()) it->second.state = State::kRefused;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
ConnectionActivity::InterceptorFactory(ConnectionActivity* activity) {
  return std::make_unique<ActivityFactory>(activity);
}

}  // namespace ferry::metadata
