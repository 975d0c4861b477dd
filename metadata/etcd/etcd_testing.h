// EtcdCluster: real etcd servers (Debian's etcd-server) on loopback for
// tests: one member or several forming a cluster, each with its own data
// directory and free ports, killed and removed with the object (and with
// the test process: PR_SET_PDEATHSIG). Members run with short Raft timers
// (heartbeat 50 ms, election 500 ms) so that elections and lease expiry
// take about a second.
#ifndef FERRY_METADATA_ETCD_ETCD_TESTING_H_
#define FERRY_METADATA_ETCD_ETCD_TESTING_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "testing/subprocess.h"

namespace ferry::metadata {

class EtcdCluster {
 public:
  // Starts `members` etcd processes and waits (up to 20 s) until the
  // cluster answers. FailedPrecondition if etcd is not installed.
  // `extra_flags` go to every member after the defaults (a benchmark's
  // --quota-backend-bytes).
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(
      int members, const std::vector<std::string>& extra_flags = {});
  ~EtcdCluster();

  // host:port of each member's client URL.
  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // "etcd://a,b,c".
  std::string address() const;
  // SIGKILLs member `i`.
  void Kill(int i);
  // The process id of member `i` (its memory, read from /proc).
  pid_t pid(int i) const { return members_[i]->pid(); }
  // The index of the member that leads the cluster now, as the members'
  // Maintenance.Status say; Unavailable if none answers with one.
  absl::StatusOr<int> LeaderIndex() const;
  // Compacts the history up to the current revision (what etcd's
  // auto-compaction does), which it returns.
  absl::StatusOr<int64_t> Compact();

 private:
  EtcdCluster() = default;
  std::string dir_;
  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<testing::Subprocess>> members_;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_ETCD_ETCD_TESTING_H_
