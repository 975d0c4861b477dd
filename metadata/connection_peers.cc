#include "metadata/connection_peers.h"

#include "absl/container/flat_hash_map.h"
#include "common/mutex.h"

namespace ferry::metadata {
namespace {

struct Registry {
  Mutex mu;
  absl::flat_hash_map<int, std::string> peers ABSL_GUARDED_BY(mu);
};

Registry& Get() {
  static Registry* r = new Registry;  // Never destroyed: used at exit.
  return *r;
}

}  // namespace

void SetConnectionPeer(int fd, const std::string& address) {
  Registry& r = Get();
  MutexLock lock(&r.mu);
  r.peers[fd] = address;
}

std::string ConnectionPeer(int fd) {
  Registry& r = Get();
  MutexLock lock(&r.mu);
  auto it = r.peers.find(fd);
  return it == r.peers.end() ? "" : it->second;
}

}  // namespace ferry::metadata
