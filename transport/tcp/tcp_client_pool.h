// TcpClient::Pool: the connections, queued slices and back-off state of
// one peer address. Submit hands slices over through its inbox; the loop
// thread that drives it owns the rest (the comments below say which field
// is whose).
//
// Internal to TcpClient (tcp_client.h).
#ifndef FERRY_TRANSPORT_TCP_TCP_CLIENT_POOL_H_
#define FERRY_TRANSPORT_TCP_TCP_CLIENT_POOL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "transport/tcp/tcp_client.h"
#include "transport/tcp/tcp_client_conn.h"
#include "transport/transport.h"

namespace ferry::tcp {

struct TcpClient::Pool : std::enable_shared_from_this<TcpClient::Pool> {
  Pool(std::string address_in, const SockAddr& addr_in, Loop* loop_in,
       absl::Time now)
      : address(std::move(address_in)),
        addr(addr_in),
        loop(loop_in),
        last_active(now) {}

  const std::string address;
  const SockAddr addr;
  Loop* const loop;

  // Submit hands slices over here; the loop drains them.
  Mutex mu;
  std::vector<Slice*> inbox ABSL_GUARDED_BY(mu);
  bool wake_posted ABSL_GUARDED_BY(mu) = false;
  // While now < fail_until, Submit fails slices at once (fast failures).
  absl::Time fail_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  absl::Status fail_cause ABSL_GUARDED_BY(mu);
  int fail_count ABSL_GUARDED_BY(mu) = 0;

  // Slices Submit accepted for this pool and not completed yet; changed
  // under TcpClient::mu_ upwards (so eviction can trust a zero), anywhere
  // downwards.
  std::atomic<int64_t> outstanding{0};
  std::atomic<uint64_t> last_use{0};

  // Loop thread only.
  std::vector<std::unique_ptr<Conn>> conns;
  bool registered = false;  // In loop->pools.
  bool closing = false;     // Retire once no slice is left.
  bool retired = false;
  int failures = 0;  // Consecutive; reset by the first answer.
  absl::Time retry_after = absl::InfinitePast();
  absl::Status last_failure;
  bool published = false;  // fail_until is set.
  absl::Time last_active;
};

// What a slice to a backed-off peer fails with: who, why, and when the
// next attempt is.
absl::Status BackoffError(absl::string_view address, int failures,
                          const absl::Status& last, absl::Duration next_in);

}  // namespace ferry::tcp

#endif  // FERRY_TRANSPORT_TCP_TCP_CLIENT_POOL_H_
