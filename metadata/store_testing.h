// Requests for tests of Store implementations: an owner key per
// incarnation, so that a test's "engine run 7" owns what it puts.
#ifndef FERRY_METADATA_STORE_TESTING_H_
#define FERRY_METADATA_STORE_TESTING_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "metadata/proto/metadata.pb.h"

namespace ferry::metadata {

// 32 bytes that name test owner `n`.
inline std::string TestOwnerKey(uint64_t n) {
  std::string key = absl::StrCat("test-owner-", n);
  key.resize(32, '.');
  return key;
}

// A Put of `segment` by the owner named after its incarnation.
inline PutSegmentRequest PutOf(const descriptor::SegmentDescriptor& segment,
                               absl::Duration lease_ttl = absl::ZeroDuration(),
                               uint64_t owner = 0) {
  PutSegmentRequest req;
  *req.mutable_segment() = segment;
  req.set_lease_ttl_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(lease_ttl)));
  req.set_owner_key(TestOwnerKey(owner != 0 ? owner : segment.incarnation()));
  return req;
}

// PutOf with a lease by default: what a metadata service with no auth
// token accepts (it refuses segments with no lease).
constexpr absl::Duration kTestLease = absl::Minutes(10);
inline PutSegmentRequest LeasedPutOf(
    const descriptor::SegmentDescriptor& segment,
    absl::Duration lease_ttl = kTestLease, uint64_t owner = 0) {
  return PutOf(segment, lease_ttl, owner);
}

// A segment of `buffers` 4 KiB buffers, 1 MiB apart.
inline descriptor::SegmentDescriptor TestSegment(const std::string& name,
                                                 uint64_t incarnation,
                                                 int buffers) {
  descriptor::SegmentDescriptor s;
  s.set_name(name);
  s.set_incarnation(incarnation);
  s.set_rpc_address("127.0.0.1:1");
  for (int i = 0; i < buffers; ++i) {
    descriptor::Buffer* b = s.add_buffers();
    b->set_addr(0x100000ull * (i + 1));
    b->set_length(0x1000);
    b->set_location("cpu:0");
  }
  return s;
}

inline KeepAliveRequest KeepAliveOf(const std::string& name, uint64_t owner) {
  KeepAliveRequest req;
  req.set_name(name);
  req.set_incarnation(owner);
  req.set_owner_key(TestOwnerKey(owner));
  return req;
}

inline RemoveSegmentRequest RemoveOf(const std::string& name, uint64_t owner) {
  RemoveSegmentRequest req;
  req.set_name(name);
  req.set_incarnation(owner);
  req.set_owner_key(TestOwnerKey(owner));
  return req;
}

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_STORE_TESTING_H_
