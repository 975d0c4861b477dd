// Where a segment lives in etcd: the key layout under the store's prefix
// (etcd_store.h draws it), with the segment name escaped ('/' and '%' as
// %2F, %25) so that a name never reaches into another's keys. Immutable
// after construction, so safe to share between threads.
#ifndef FERRY_METADATA_ETCD_ETCD_KEYS_H_
#define FERRY_METADATA_ETCD_ETCD_KEYS_H_

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"

namespace ferry::metadata {

class EtcdKeys {
 public:
  // `prefix` ends with '/' (EtcdStore::Create checks it).
  explicit EtcdKeys(std::string prefix) : prefix_(std::move(prefix)) {}

  // <prefix>owner/<name>: the owner key (the only compare target).
  std::string OwnerKey(const std::string& name) const;
  // <prefix>meta/<name>: the segment's record (EtcdSegmentMeta).
  std::string MetaKey(const std::string& name) const;
  // <prefix>buf/<name>/: what every buffer key of the segment starts with.
  std::string BufPrefix(const std::string& name) const;
  // <prefix>buf/<name>/<addr>, addr as 16 hex digits, so that key order is
  // address order.
  std::string BufKey(const std::string& name, uint64_t addr) const;

  // What every meta key starts with, and the segment name of one.
  std::string MetaPrefix() const;
  std::string NameOfMetaKey(absl::string_view meta_key) const;

 private:
  const std::string prefix_;
};

// The smallest key above every key that starts with `prefix`.
std::string PrefixEnd(std::string prefix);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_ETCD_ETCD_KEYS_H_
