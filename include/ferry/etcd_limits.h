// What an etcd store may hold and how long it keeps history: a part of
// EtcdOptions (etcd_store.h) of its own, so that code that only passes the
// limits on (metadata_address.h, metadata_server's flags) builds without
// the etcd back end too.
#ifndef FERRY_INCLUDE_FERRY_ETCD_LIMITS_H_
#define FERRY_INCLUDE_FERRY_ETCD_LIMITS_H_

#include <cstddef>
#include <cstdint>

#include "absl/time/time.h"

namespace ferry::metadata {

struct EtcdLimits {
  // What one client (a metadata service's caller, by address) and all of
  // them together may store under the prefix, in bytes of keys and values
  // as etcd holds them (each buffer is a key of its own), so that no client
  // can drive etcd into its NOSPACE alarm (etcd's default quota is 2 GiB
  // of database, history included, and once it is raised every write
  // fails until an operator disarms it). Counted from the segment records
  // in etcd, which every store sharing the prefix sees, read again at most
  // every `usage_refresh` (0: on every check), plus this store's own
  // writes since. Segments that engines put on etcd directly have no
  // client: the total binds them.
  uint64_t max_bytes = uint64_t{256} << 20;
  uint64_t max_client_bytes = uint64_t{32} << 20;
  size_t max_client_segments = 4096;
  absl::Duration usage_refresh = absl::Seconds(2);
  // History older than this is compacted, by every store that writes:
  // etcd keeps every revision until it is compacted, so updates would
  // fill its quota however small the live data. A store also compacts all
  // of it once it has written a quarter of max_bytes since the last
  // compaction (EtcdCompaction), so that fast rewrites inside the quotas
  // cannot fill it before this has passed; 0 turns off both. Compaction
  // is etcd-wide, as its own --auto-compaction-retention is: other
  // applications that share the cluster and read older revisions should
  // set 0 (never) and leave it to etcd's option.
  absl::Duration compact_after = absl::Minutes(5);
};

}  // namespace ferry::metadata

#endif  // FERRY_INCLUDE_FERRY_ETCD_LIMITS_H_
