// How the etcd store's calls are made: the parts its transactions are built
// of (ranges, puts, deletes and the compares that guard them), deadlines on
// the store's clock, and retries while a member is down. Stateless.
#ifndef FERRY_METADATA_ETCD_ETCD_RPC_H_
#define FERRY_METADATA_ETCD_ETCD_RPC_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "rpc.pb.h"

namespace ferry::metadata {

// Reads `key`, or [key, end) when `end` is set, at most `limit` keys (0:
// all).
etcdserverpb::RequestOp RangeOp(const std::string& key,
                                const std::string& end = "", int64_t limit = 0);
etcdserverpb::RequestOp PutOp(const std::string& key, const std::string& value,
                              int64_t lease);
// Deletes `key`, or [key, end) when `end` is set.
etcdserverpb::RequestOp DeleteOp(const std::string& key,
                                 const std::string& end = "");

etcdserverpb::Compare ValueIs(const std::string& key, const std::string& value);
// The key does not exist.
etcdserverpb::Compare Absent(const std::string& key);
etcdserverpb::Compare ModRevisionIs(const std::string& key, int64_t rev);

// `deadline` is on `clock`: gRPC gets the time left until it.
void SetDeadline(grpc::ClientContext* ctx, Clock* clock, absl::Time deadline);

// Makes `call` (one attempt, given a fresh context with `deadline`) again
// while it fails UNAVAILABLE (a member down: the channel tries the others)
// and the deadline allows.
template <typename Call>
grpc::Status RetryUnavailable(Clock* clock, absl::Time deadline, Call call) {
  constexpr absl::Duration kPause = absl::Milliseconds(50);
  while (true) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, clock, deadline);
    grpc::Status s = call(&ctx);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
        clock->Now() + kPause >= deadline) {
      return s;
    }
    clock->SleepFor(kPause);
  }
}

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_ETCD_ETCD_RPC_H_
