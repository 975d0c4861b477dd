#include "transport/tcp/server_session.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dma_annotations.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "gpu/gpu_memory.h"

namespace ferry::tcp {

ServerSession::ServerSession(MemoryRegistry* registry, const Limits& limits,
                             uint64_t incarnation, absl::Time now,
                             TargetStaging* gpu_staging,
                             absl::string_view auth_token)
    : registry_(registry),
      gpu_staging_(gpu_staging),
      limits_(limits),
      incarnation_(incarnation),
      auth_token_(auth_token),
      proven_(auth_token.empty()),
      created_(now),
      last_done_(now) {
  if (!proven_) {
    EncodeChallenge(challenge_);
    Response r;
    std::memcpy(r.header, challenge_, kResponseHeaderBytes);
    Queue(std::move(r), now);
  }
}

absl::Status ServerSession::TakeProof(size_t staged) {
  const uint8_t* frame = staging_.data();
  RequestHeader h;
  if (absl::Status s = DecodeRequest(frame, &h); !s.ok()) {
    return absl::DataLossError(absl::StrCat("bad proof: ", s.message()));
  }
  if (h.op != WireOp::kProof) {
    return absl::PermissionDeniedError(
        "a request before the proof of the cluster token: this target "
        "requires the token (EngineOptions::auth_token or "
        "FERRY_AUTH_TOKEN_FILE) and the peer has none");
  }
  if (staged < kRequestHeaderBytes + kProofBytes) {
    return absl::OkStatus();  // The rest of it comes later.
  }
  if (!ProofMatches(auth_token_, challenge_, frame)) {
    return absl::PermissionDeniedError(
        "the peer's proof of the cluster token is wrong: its token differs "
        "from this engine's");
  }
  staging_.Consume(kRequestHeaderBytes + kProofBytes);
  proven_ = true;
  return absl::OkStatus();
}

std::pair<uint8_t*, size_t> ServerSession::InputBuffer() {
  if (!wants_input()) return {nullptr, 0};
  // A payload with nothing staged goes straight to the target memory.
  if (staging_.empty() && payload_left_ > 0 && payload_ != nullptr) {
    return {payload_, payload_left_};
  }
  return staging_.Space();
}

absl::Status ServerSession::OnReceived(size_t n, absl::Time now) {
  if (staging_.empty() && payload_left_ > 0 && payload_ != nullptr) {
    n = std::min(n, payload_left_);
    payload_ += n;
    payload_left_ -= n;
    if (payload_left_ == 0) EndPayload(now);
  } else {
    staging_.Commit(n);
  }
  absl::Status s = Process(now);
  UpdateFrameClock(now);
  return s;
}

absl::Status ServerSession::Process(absl::Time now) {
  while (true) {
    const size_t staged = staging_.size();
    if (payload_left_ > 0) {
      if (staged == 0) return absl::OkStatus();
      const size_t take = std::min(staged, payload_left_);
      if (payload_ != nullptr) {
        ScopedDmaAccess dma;  // Into application memory, as recv() is.
        std::memcpy(payload_, staging_.data(), take);
        payload_ += take;
      }
      payload_left_ -= take;
      staging_.Consume(take);
      if (payload_left_ == 0) EndPayload(now);
      continue;
    }
    if (!proven_) {
      // Nothing is looked at, not even a key, before the proof.
      if (staged < kRequestHeaderBytes) return absl::OkStatus();
      if (absl::Status s = TakeProof(staged); !s.ok() || !proven_) return s;
      continue;
    }
    // Leave further requests staged while the peer is not taking answers.
    if (!wants_input() || staged < kRequestHeaderBytes) {
      return absl::OkStatus();
    }
    FERRY_RETURN_IF_ERROR(StartRequest(staging_.data(), now));
    // No staging buffer: the request waits, whole, for Resume.
    if (stalled_) return absl::OkStatus();
    staging_.Consume(kRequestHeaderBytes);
  }
}

absl::Status ServerSession::Resume(absl::Time now) {
  if (!stalled_) return absl::OkStatus();
  stalled_ = false;
  absl::Status s = Process(now);
  UpdateFrameClock(now);
  return s;
}

absl::Status ServerSession::StartRequest(const uint8_t* header,
                                         absl::Time now) {
  RequestHeader req;
  if (absl::Status s = DecodeRequest(header, &req); !s.ok()) {
    return absl::DataLossError(
        absl::StrCat("bad request header: ", s.message()));
  }
  if (req.op == WireOp::kProof) {
    return absl::DataLossError("a proof where a request belongs");
  }
  MemoryRegistry::Lease lease;
  WireStatus status = Admit(req, &lease);
  uint8_t* const target = reinterpret_cast<uint8_t*>(req.remote_addr);
  const int device =
      status == WireStatus::kOk ? lease.region().cuda_device : -1;
  TargetStaging::Buffer staged;
  if (device >= 0) {
    status = Stage(req, lease.region(), &staged);
    if (status == WireStatus::kOk && !staged) {
      stalled_ = true;  // Counted when it is served.
      if (stalled_since_ == absl::InfiniteFuture()) stalled_since_ = now;
      return absl::OkStatus();
    }
    stalled_since_ = absl::InfiniteFuture();
  }
  ++requests_;
  if (status == WireStatus::kOk) ++admitted_;
  if (req.op == WireOp::kWrite) {
    payload_left_ = req.length;
    payload_id_ = req.request_id;
    payload_status_ = status;
    // Refused: drained, to keep the stream in sync.
    payload_ = status != WireStatus::kOk ? nullptr
               : staged                  ? staged.data()
                                         : target;
    payload_lease_ = std::move(lease);
    payload_staged_ = std::move(staged);
    payload_device_ = device;
    payload_device_addr_ = req.remote_addr;
    payload_length_ = req.length;
    return absl::OkStatus();
  }
  if (staged) {
    absl::Status s = gpu_staging_->FromDevice(device, staged.data(),
                                              req.remote_addr, req.length);
    if (!s.ok()) {
      status = WireStatus::kStagingFailed;
      staged.Reset();
    }
  }
  Response r;
  const bool ok = status == WireStatus::kOk;
  EncodeResponse(
      {WireOp::kReadData, status, req.request_id, ok ? req.length : 0},
      r.header);
  if (ok) {
    r.data = staged ? staged.data() : target;
    r.length = req.length;
    r.lease = std::move(lease);
    if (staged) {
      // The bytes were copied out: the buffer, not the lease, holds them.
      r.lease.Release();
      r.staged = std::move(staged);
      ++staged_out_;
    }
  }
  frame_since_ = absl::InfiniteFuture();  // This request is complete.
  last_done_ = now;
  Queue(std::move(r), now);
  return absl::OkStatus();
}

WireStatus ServerSession::Admit(const RequestHeader& req,
                                MemoryRegistry::Lease* lease) {
  // Checked first: a frame meant for another run of this engine learns
  // nothing about this one's memory, not even what is registered.
  if (req.incarnation != incarnation_) {
    ++denied_;
    return WireStatus::kWrongIncarnation;
  }
  // Only remote-accessible registered memory, wholly inside one buffer.
  auto leased = registry_->Acquire(req.remote_addr, req.length,
                                   /*need_remote=*/true);
  if (!leased.ok()) return WireStatus::kOutOfBounds;
  const auto* key = static_cast<const BufferKey*>(leased->handle(0));
  if (key == nullptr || key->value == 0 || key->value != req.key) {
    ++denied_;
    return WireStatus::kBadKey;
  }
  *lease = std::move(*leased);
  return WireStatus::kOk;
}

WireStatus ServerSession::Stage(const RequestHeader& req,
                                const MemoryRegion& region,
                                TargetStaging::Buffer* buffer) {
  if (gpu_staging_ == nullptr) return WireStatus::kStagingFailed;
  if (req.length > gpu_staging_->buffer_bytes()) return WireStatus::kTooLarge;
  // The copy engine would write where the freed allocation was: into
  // nothing, or into whatever the application allocated there since.
  if (absl::Status live = gpu::CheckGpuAllocation(
          req.remote_addr, region.cuda_device, region.cuda_buffer_id);
      !live.ok()) {
    FERRY_LOG_EVERY(kWarn, "tcp", absl::Seconds(1), "refused a peer's ",
                    req.op == WireOp::kWrite ? "WRITE" : "READ", " of 0x",
                    absl::Hex(req.remote_addr), "+", req.length, ": ",
                    live.message());
    return WireStatus::kStagingFailed;
  }
  const int device = region.cuda_device;
  absl::StatusOr<TargetStaging::Buffer> b = gpu_staging_->TryAcquire(device);
  if (!b.ok()) return WireStatus::kStagingFailed;
  *buffer = std::move(*b);
  return WireStatus::kOk;
}

void ServerSession::EndPayload(absl::Time now) {
  if (payload_staged_) {
    if (payload_status_ == WireStatus::kOk &&
        !gpu_staging_
             ->ToDevice(payload_device_, payload_device_addr_,
                        payload_staged_.data(), payload_length_)
             .ok()) {
      payload_status_ = WireStatus::kStagingFailed;
    }
    payload_staged_.Reset();
  }
  // Applied: only now is the WRITE acknowledged.
  payload_lease_.Release();
  payload_ = nullptr;
  Response r;
  EncodeResponse({WireOp::kWriteAck, payload_status_, payload_id_, 0},
                 r.header);
  frame_since_ = absl::InfiniteFuture();
  last_done_ = now;
  Queue(std::move(r), now);
}

void ServerSession::Queue(Response r, absl::Time now) {
  if (out_.empty()) out_since_ = now;
  r.queued = now;
  out_.push_back(std::move(r));
}

int ServerSession::PrepareOutput(iovec* iov, int max_iov) const {
  int n = 0;
  for (const Response& r : out_) {
    if (n + 2 > max_iov) break;
    n += UnsentFrame(r.header, kResponseHeaderBytes, r.data, r.length, r.sent,
                     iov + n);
  }
  return n;
}

absl::Status ServerSession::OnSent(size_t n, absl::Time now) {
  const bool was_paused = !wants_input();
  while (n > 0 && !out_.empty()) {
    Response& r = out_.front();
    const size_t total = kResponseHeaderBytes + r.length;
    const size_t take = std::min(n, total - r.sent);
    r.sent += take;
    n -= take;
    if (r.sent == total) {
      if (r.staged) --staged_out_;
      out_.pop_front();  // Releases the lease (or the staging buffer).
      last_done_ = now;
      // The next answer's clock started when it was queued, not now: a
      // peer taking one answer per frame_timeout must not hold the leases
      // of the 15 behind it for 16 times that.
      out_since_ = out_.empty() ? absl::InfiniteFuture() : out_.front().queued;
    }
  }
  absl::Status s;
  if (was_paused && wants_input()) s = Process(now);  // Staged requests.
  UpdateFrameClock(now);
  return s;
}

void ServerSession::UpdateFrameClock(absl::Time now) {
  // The clock runs only while the session reads: a paused one waits for
  // the peer to take responses, which out_since_ bounds.
  if (!mid_frame() || !wants_input()) {
    frame_since_ = absl::InfiniteFuture();
  } else if (frame_since_ == absl::InfiniteFuture()) {
    frame_since_ = now;
  }
}

absl::Status ServerSession::CheckTimeouts(absl::Time now) const {
  if (stalled_ && now - stalled_since_ > limits_.frame_timeout) {
    return absl::DeadlineExceededError(absl::StrCat(
        "a request waited ", absl::FormatDuration(limits_.frame_timeout),
        " for a staging buffer for GPU memory (tcp.staging_buffers are all "
        "in use)"));
  }
  // A first request that waits for a staging buffer has arrived whole.
  if (requests_ == 0 && !stalled_ &&
      now - created_ > limits_.handshake_timeout) {
    return absl::DeadlineExceededError(absl::StrCat(
        "no request within ", absl::FormatDuration(limits_.handshake_timeout),
        " of connecting"));
  }
  if (now - frame_since_ > limits_.frame_timeout) {
    return absl::DeadlineExceededError(absl::StrCat(
        "request frame incomplete after ",
        absl::FormatDuration(limits_.frame_timeout), " (",
        payload_left_ > 0 ? absl::StrCat(payload_left_, " payload bytes due")
                          : std::string("partial header"),
        ")"));
  }
  if (now - out_since_ > limits_.frame_timeout) {
    return absl::DeadlineExceededError(
        absl::StrCat("peer took no response for ",
                     absl::FormatDuration(limits_.frame_timeout)));
  }
  if (requests_ > 0 && !mid_frame() && out_.empty() &&
      now - last_done_ > limits_.idle_timeout) {
    return absl::DeadlineExceededError(
        absl::StrCat("idle for ", absl::FormatDuration(limits_.idle_timeout)));
  }
  return absl::OkStatus();
}

}  // namespace ferry::tcp
