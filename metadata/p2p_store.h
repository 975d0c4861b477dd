// P2pStore: the Store of an engine in P2PHANDSHAKE mode (Mooncake's
// metadata_server "P2PHANDSHAKE"): there is no metadata service. The
// engine's own segment lives in a local in-memory store, which its peer
// service serves (PeerService.GetDescriptor), and a segment's name is its
// engine's RPC address, host:port: opening it asks that engine directly.
//
// So nothing outlives an engine and nothing is shared: a crashed engine's
// name just stops answering (Unavailable), a restarted one on the same
// port answers with its new incarnation. There is no list of segments
// beyond this engine's own.
//
// Thread-safe.
#ifndef FERRY_METADATA_P2P_STORE_H_
#define FERRY_METADATA_P2P_STORE_H_

#include <string>
#include <vector>

#include "metadata/peer_service.h"
#include "metadata/segment_store.h"
#include "metadata/store.h"

namespace ferry::metadata {

class P2pStore final : public Store {
 public:
  // `peers` must outlive the store.
  explicit P2pStore(PeerClient* peers) : peers_(peers) {}

  // Changes apply to the local store (this engine's own segment).
  absl::StatusOr<uint64_t> Put(const PutSegmentRequest& request) override {
    return local_.Put(request);
  }
  absl::StatusOr<absl::Duration> KeepAlive(
      const KeepAliveRequest& request) override {
    return local_.KeepAlive(request);
  }
  absl::StatusOr<uint64_t> UpdateBuffers(
      const UpdateBuffersRequest& request) override {
    return local_.UpdateBuffers(request);
  }
  absl::Status Remove(const RemoveSegmentRequest& request) override {
    return local_.Remove(request);
  }
  // This engine's own segment from the local store; any other name must
  // be host:port, and is asked of the engine there.
  absl::StatusOr<descriptor::SegmentDescriptor> Get(
      const std::string& name) override;
  // This engine's own segment only.
  absl::StatusOr<std::vector<std::string>> List() override {
    return local_.List();
  }
  std::string Describe() const override { return "P2PHANDSHAKE"; }

  // What the peer service serves to others: the local store alone.
  Store* local() { return &local_; }

 private:
  SegmentStore local_;
  PeerClient* const peers_;
};

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_P2P_STORE_H_
