#include "metadata/p2p_store.h"

#include "absl/strings/str_cat.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "metadata/validation.h"

namespace ferry::metadata {

absl::StatusOr<descriptor::SegmentDescriptor> P2pStore::Get(
    const std::string& name) {
  FERRY_RETURN_IF_ERROR(descriptor::ValidateSegmentName(name));
  if (auto mine = local_.Get(name); mine.ok()) return mine;
  auto hp = ParseHostPort(name);
  if (!hp.ok() || hp->port == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment '", name,
        "': in P2PHANDSHAKE mode a segment is named by its engine's RPC "
        "address, host:port (the target prints it)"));
  }
  // Resolved on each open (not on the data path).
  auto host = ResolveHost(hp->host);
  if (!host.ok()) return host.status();
  return peers_->GetDescriptor(JoinHostPort(*host, hp->port), name);
}

}  // namespace ferry::metadata
