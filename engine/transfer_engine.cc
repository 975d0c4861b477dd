#include "ferry/transfer_engine.h"

#include "engine/engine_impl.h"

namespace ferry {

const char* TransferStateName(TransferState state) {
  switch (state) {
    case TransferState::kWaiting:
      return "WAITING";
    case TransferState::kPending:
      return "PENDING";
    case TransferState::kCompleted:
      return "COMPLETED";
    case TransferState::kFailed:
      return "FAILED";
    case TransferState::kTimeout:
      return "TIMEOUT";
  }
  return "UNKNOWN";
}

TransferEngine::TransferEngine() : impl_(std::make_unique<EngineImpl>()) {}
TransferEngine::~TransferEngine() { Shutdown(); }

absl::Status TransferEngine::Init(const EngineOptions& options) {
  return impl_->Init(options);
}
void TransferEngine::Shutdown() { impl_->Shutdown(); }
std::string TransferEngine::advertised_host() const {
  return impl_->advertised_host();
}

std::string TransferEngine::advertised_host_reason() const {
  return impl_->advertised_host_reason();
}

std::string TransferEngine::metadata_address() const {
  return impl_->metadata_address();
}
std::string TransferEngine::rpc_address() const { return impl_->rpc_address(); }
const std::string& TransferEngine::local_segment_name() const {
  return impl_->options().local_segment_name;
}
absl::Status TransferEngine::RegisterLocalMemory(void* addr, size_t length,
                                                 const std::string& location,
                                                 bool remote_accessible) {
  return impl_->RegisterLocalMemory(addr, length, location, remote_accessible);
}
absl::Status TransferEngine::RegisterLocalMemoryBatch(
    const std::vector<BufferEntry>& buffers, const std::string& location,
    bool remote_accessible) {
  return impl_->RegisterLocalMemoryBatch(buffers, location, remote_accessible);
}

absl::Status TransferEngine::UnregisterLocalMemoryBatch(
    const std::vector<void*>& addrs) {
  return impl_->UnregisterLocalMemoryBatch(addrs);
}

absl::Status TransferEngine::UnregisterLocalMemory(void* addr) {
  return impl_->UnregisterLocalMemory(addr);
}
absl::StatusOr<SegmentHandle> TransferEngine::OpenSegment(
    const std::string& name) {
  return impl_->OpenSegment(name);
}
absl::Status TransferEngine::RefreshSegment(SegmentHandle handle) {
  return impl_->RefreshSegment(handle);
}
absl::StatusOr<std::vector<RemoteBuffer>> TransferEngine::GetSegmentBuffers(
    SegmentHandle handle) {
  return impl_->GetSegmentBuffers(handle);
}
absl::StatusOr<BatchId> TransferEngine::AllocateBatch(size_t capacity) {
  return impl_->AllocateBatch(capacity);
}
absl::Status TransferEngine::SubmitTransfer(
    BatchId batch, absl::Span<const TransferRequest> requests) {
  return impl_->SubmitTransfer(batch, requests);
}
absl::StatusOr<TransferStatus> TransferEngine::GetTransferStatus(BatchId batch,
                                                                 size_t index) {
  return impl_->GetTransferStatus(batch, index);
}
absl::StatusOr<BatchStatus> TransferEngine::GetBatchStatus(BatchId batch) {
  return impl_->GetBatchStatus(batch);
}
absl::StatusOr<BatchStatus> TransferEngine::WaitBatch(BatchId batch,
                                                      absl::Duration timeout) {
  return impl_->WaitBatch(batch, timeout);
}
absl::Status TransferEngine::FreeBatch(BatchId batch) {
  return impl_->FreeBatch(batch);
}
absl::Status TransferEngine::SendNotification(SegmentHandle target,
                                              const std::string& name,
                                              const std::string& message) {
  return impl_->SendNotification(target, name, message);
}
std::vector<Notification> TransferEngine::GetNotifications() {
  return impl_->GetNotifications();
}
std::vector<TransportStats> TransferEngine::GetTransportStats() const {
  return impl_->GetTransportStats();
}

absl::Status TransferEngine::CloseSegment(SegmentHandle handle) {
  return impl_->CloseSegment(handle);
}

EngineStats TransferEngine::GetEngineStats() const {
  return impl_->GetEngineStats();
}

}  // namespace ferry
