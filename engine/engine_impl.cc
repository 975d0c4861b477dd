// EngineImpl: the calls it forwards to its parts (registrations,
// notifications), segments, sending notifications, and statistics.
#include "engine/engine_impl.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "metadata/grpc_status.h"

namespace ferry {

std::string EngineImpl::metadata_address() const {
  return metadata_ != nullptr ? metadata_address_ : "";
}

std::string EngineImpl::rpc_address() const {
  return metadata_ != nullptr ? rpc_address_ : "";
}

absl::Status EngineImpl::RegisterLocalMemory(void* addr, size_t length,
                                             const std::string& location,
                                             bool remote_accessible) {
  return RegisterLocalMemoryBatch({{addr, length}}, location,
                                  remote_accessible);
}

absl::Status EngineImpl::RegisterLocalMemoryBatch(
    const std::vector<BufferEntry>& buffers, const std::string& location,
    bool remote_accessible) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  return registrations_.Register(buffers, location, remote_accessible,
                                 publisher_.get());
}

absl::Status EngineImpl::UnregisterLocalMemory(void* addr) {
  return UnregisterLocalMemoryBatch({addr});
}

absl::Status EngineImpl::UnregisterLocalMemoryBatch(
    const std::vector<void*>& addrs) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  return registrations_.Unregister(addrs, options_.transfer_timeout,
                                   publisher_.get());
}

absl::StatusOr<SegmentHandle> EngineImpl::OpenSegment(const std::string& name) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  return segments_->Open(name);
}

absl::Status EngineImpl::RefreshSegment(SegmentHandle handle) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  return segments_->Refresh(handle).status();
}

absl::Status EngineImpl::CloseSegment(SegmentHandle handle) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  FERRY_ASSIGN_OR_RETURN(auto view, segments_->Close(handle));
  for (auto& t : transports_) t->ClosePeer(*view);
  peer_client_->Forget(view->descriptor().rpc_address());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RemoteBuffer>> EngineImpl::GetSegmentBuffers(
    SegmentHandle handle) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  FERRY_ASSIGN_OR_RETURN(auto snap, segments_->Get(handle));
  std::vector<RemoteBuffer> out;
  for (const auto& b : snap.view->descriptor().buffers()) {
    out.push_back({b.addr(), b.length(), b.location()});
  }
  std::sort(out.begin(), out.end(),
            [](const RemoteBuffer& x, const RemoteBuffer& y) {
              return x.addr < y.addr;
            });
  return out;
}

absl::Status EngineImpl::SendNotification(SegmentHandle target,
                                          const std::string& name,
                                          const std::string& message) {
  if (!initialized_)
    return absl::FailedPreconditionError("engine not initialized");
  FERRY_ASSIGN_OR_RETURN(auto snap, segments_->Get(target));
  if (name.size() > metadata::kMaxNotifyNameBytes ||
      message.size() > metadata::kMaxNotifyMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("notification name or message too large (limits ",
                     metadata::kMaxNotifyNameBytes, " and ",
                     metadata::kMaxNotifyMessageBytes, " bytes)"));
  }
  // PeerClient::Notify sends again while the receiver says "retry later"
  // (for up to 15 s, each try within the RPC timeout); what is left here
  // is a receiver that restarted since its descriptor was read: read it
  // again, once, and send to the new run.
  for (bool refreshed = false;; refreshed = true) {
    const descriptor::SegmentDescriptor& to = snap.view->descriptor();
    absl::Status s =
        peer_client_->Notify(to.rpc_address(), options_.local_segment_name,
                             name, message, to.name(), to.incarnation());
    if (metadata::HintOf(s) != metadata::Hint::kRefreshReceiver || refreshed) {
      return s;
    }
    auto fresh = segments_->Refresh(target);
    if (!fresh.ok()) return s;
    snap.view = *fresh;
  }
}

std::vector<TransportStats> EngineImpl::GetTransportStats() const {
  std::vector<TransportStats> out;
  if (!initialized_) return out;
  for (const auto& t : transports_) out.push_back(t->Stats());
  return out;
}

EngineStats EngineImpl::GetEngineStats() const {
  EngineStats st;
  if (!initialized_) return st;
  const SegmentCache::Stats seg = segments_->stats();
  st.segments_open = seg.open;
  st.descriptor_refreshes = seg.refreshes;
  st.descriptor_pushes = seg.pushes;
  st.descriptor_refresh_failures = seg.refresh_failures;
  st.requests_waiting_for_descriptor = seg.parked_now;
  st.requests_waited_for_descriptor = seg.parked_total;
  const Notifications::Stats notes = notifications_.stats();
  st.notifications_queued = notes.queued;
  st.notification_bytes_queued = notes.bytes;
  st.notifications_refused = notes.refused;
  st.peer_channels = peer_client_->size();
  const Registrations::CacheStats cache = registrations_.cache_stats();
  st.mr_cache_bytes = cache.bytes;
  st.mr_cache_registrations = cache.registrations;
  st.mr_cache_invalidations = cache.invalidations;
  st.mr_cache_evictions = cache.evictions;
  return st;
}

std::vector<Notification> EngineImpl::GetNotifications() {
  return notifications_.Take();
}

}  // namespace ferry
