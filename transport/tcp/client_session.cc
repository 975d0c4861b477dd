#include "transport/tcp/client_session.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dma_annotations.h"
#include "common/status_macros.h"

namespace ferry::tcp {
namespace {

const char* OpName(const Slice& slice) {
  return slice.op == OpCode::kWrite ? "WRITE" : "READ";
}

}  // namespace

absl::Status ClientSession::Refusal(WireStatus status,
                                    const Slice& slice) const {
  const std::string what =
      absl::StrCat("target '", slice.target->name(), "' at ", peer_,
                   " refused ", OpName(slice), " of 0x",
                   absl::Hex(slice.remote), "+", slice.length, ": ");
  switch (status) {
    case WireStatus::kBadKey:
      return absl::PermissionDeniedError(absl::StrCat(
          what,
          "the buffer's key is not the one in this engine's descriptor of the "
          "segment (the buffer was unregistered, or registered again, since)"));
    case WireStatus::kWrongIncarnation:
      return absl::FailedPreconditionError(absl::StrCat(
          what, "the process there is not run ", slice.target->incarnation(),
          " of the segment's engine, which the descriptor names (the engine "
          "restarted, or another process took its port); nothing was read "
          "or written"));
    case WireStatus::kTooLarge:
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          "the range is GPU memory there, staged through host buffers "
          "smaller than this slice: give this engine a tcp.max_slice_bytes "
          "no larger than the target's"));
    case WireStatus::kStagingFailed:
      return absl::InternalError(absl::StrCat(
          what,
          "the range is GPU memory there and the target could not copy it "
          "through host memory (its log says why); a WRITE may be partly "
          "applied"));
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          what, "not inside a buffer registered as remote-accessible"));
  }
}

void ClientSession::Add(Slice* slice) {
  Entry e;
  e.slice = slice;
  e.id = next_id_++;
  e.sent = 0;
  const bool write = slice->op == OpCode::kWrite;
  e.total = kRequestHeaderBytes + (write ? slice->length : 0);
  const SegmentView& target = *slice->target;
  // The engine places every slice in one buffer of its descriptor; one it
  // did not place carries no key and is refused by the target.
  const uint64_t key = slice->remote_buffer >= 0
                           ? target.buffer(slice->remote_buffer).tcp_key()
                           : 0;
  EncodeRequest({write ? WireOp::kWrite : WireOp::kRead, e.id, slice->remote,
                 slice->length, key, target.incarnation()},
                e.header);
  load_bytes_ += slice->length;
  unsent_.push_back(e);
}

int ClientSession::PrepareOutput(iovec* iov, int max_iov) const {
  if (awaiting_challenge_ || max_iov < 1) return 0;
  int n = 0;
  if (proof_sent_ < proof_len_) {
    iov[n++] = {const_cast<uint8_t*>(proof_) + proof_sent_,
                proof_len_ - proof_sent_};
  }
  for (const Entry& e : unsent_) {
    if (n + 2 > max_iov) break;
    n += UnsentFrame(e.header, kRequestHeaderBytes,
                     static_cast<const uint8_t*>(e.slice->local),
                     e.total - kRequestHeaderBytes, e.sent, iov + n);
  }
  return n;
}

void ClientSession::OnSent(size_t n) {
  const size_t proof = std::min(n, proof_len_ - proof_sent_);
  proof_sent_ += proof;
  n -= proof;
  while (n > 0 && !unsent_.empty()) {
    Entry& e = unsent_.front();
    const size_t take = std::min(n, e.total - e.sent);
    e.sent += take;
    n -= take;
    if (e.sent == e.total) {
      awaiting_.push_back(e);
      unsent_.pop_front();
    }
  }
}

std::pair<uint8_t*, size_t> ClientSession::InputBuffer() {
  if (body_left_ > 0) return {body_, body_left_};  // Nothing is staged.
  return staging_.Space();
}

absl::Status ClientSession::OnReceived(size_t n, std::vector<Done>* done) {
  if (body_left_ > 0) {
    n = std::min(n, body_left_);
    body_ += n;
    body_left_ -= n;
    if (body_left_ == 0) FinishFront(absl::OkStatus(), done);
  } else {
    staging_.Commit(n);
  }
  return Process(done);
}

void ClientSession::FinishFront(absl::Status status, std::vector<Done>* done) {
  Entry& e = awaiting_.front();
  load_bytes_ -= e.slice->length;
  done->push_back({e.slice, std::move(status)});
  awaiting_.pop_front();
}

absl::Status ClientSession::Process(std::vector<Done>* done) {
  while (true) {
    const size_t staged = staging_.size();
    if (body_left_ > 0) {
      if (staged == 0) return absl::OkStatus();
      const size_t take = std::min(staged, body_left_);
      {
        ScopedDmaAccess dma;  // Into application memory, as recv() is.
        std::memcpy(body_, staging_.data(), take);
      }
      body_ += take;
      body_left_ -= take;
      staging_.Consume(take);
      if (body_left_ == 0) FinishFront(absl::OkStatus(), done);
      continue;
    }
    if (staged < kResponseHeaderBytes) return absl::OkStatus();
    if (awaiting_challenge_) {
      FERRY_RETURN_IF_ERROR(TakeChallenge());
      continue;
    }
    ResponseHeader h;
    if (absl::Status s = DecodeResponse(staging_.data(), &h); !s.ok()) {
      return absl::DataLossError(absl::StrCat(
          "peer ", peer_, " sent a bad response header: ", s.message()));
    }
    if (h.op == WireOp::kChallenge) {
      return auth_token_.empty()
                 ? absl::PermissionDeniedError(absl::StrCat(
                       "target at ", peer_,
                       " requires the cluster's auth token on its TCP port "
                       "(it sent a challenge), and this engine has none "
                       "(EngineOptions::auth_token or FERRY_AUTH_TOKEN_FILE)"))
                 : absl::DataLossError(absl::StrCat(
                       "target at ", peer_, " sent a second challenge"));
    }
    staging_.Consume(kResponseHeaderBytes);
    answered_any_ = true;
    if (awaiting_.empty()) {
      return absl::DataLossError(
          absl::StrCat("peer ", peer_, " answered request ", h.request_id,
                       ", which is not waiting for an answer"));
    }
    const Entry& e = awaiting_.front();
    const Slice& slice = *e.slice;
    if (h.request_id != e.id) {
      return absl::DataLossError(
          absl::StrCat("peer ", peer_, " answered request ", h.request_id,
                       " out of order (request ", e.id, " is next)"));
    }
    const bool write = slice.op == OpCode::kWrite;
    if (h.op != (write ? WireOp::kWriteAck : WireOp::kReadData)) {
      return absl::DataLossError(absl::StrCat("peer ", peer_, " answered ",
                                              OpName(slice), " request ", e.id,
                                              " with the wrong opcode"));
    }
    if (h.status != WireStatus::kOk) {
      FinishFront(Refusal(h.status, slice), done);
      continue;
    }
    if (write) {
      FinishFront(absl::OkStatus(), done);
      continue;
    }
    if (h.length != slice.length) {
      return absl::DataLossError(
          absl::StrCat("peer ", peer_, " answered READ request ", e.id, " of ",
                       slice.length, " bytes with ", h.length, " bytes"));
    }
    body_ = static_cast<uint8_t*>(slice.local);
    body_left_ = h.length;  // Never 0: slices are at least 1 byte.
  }
}

absl::Status ClientSession::TakeChallenge() {
  const uint8_t* challenge = staging_.data();
  ResponseHeader h;
  if (absl::Status s = DecodeResponse(challenge, &h);
      !s.ok() || h.op != WireOp::kChallenge) {
    return absl::FailedPreconditionError(absl::StrCat(
        "target at ", peer_,
        " did not open the connection with a challenge: this engine has a "
        "cluster token and the target runs without one (or is not a Ferry "
        "engine)"));
  }
  EncodeProof(auth_token_, challenge, proof_);
  proof_len_ = sizeof(proof_);
  proof_sent_ = 0;
  staging_.Consume(kResponseHeaderBytes);
  awaiting_challenge_ = false;
  return absl::OkStatus();
}

absl::Status SliceDeadlineError(absl::string_view peer, const Slice& slice) {
  return absl::DeadlineExceededError(
      absl::StrCat("TCP ", OpName(slice), " of ", slice.length, " bytes to ",
                   peer, " did not complete before its deadline"));
}

bool ClientSession::Expire(absl::Time now, std::vector<Done>* done) {
  bool must_abort = false;
  for (auto it = unsent_.begin(); it != unsent_.end();) {
    if (it->slice->deadline < now) {
      if (it->sent == 0) {
        load_bytes_ -= it->slice->length;
        done->push_back({it->slice, SliceDeadlineError(peer_, *it->slice)});
        it = unsent_.erase(it);
        continue;
      }
      must_abort = true;
    }
    ++it;
  }
  for (const Entry& e : awaiting_) {
    if (e.slice->deadline < now) {
      must_abort = true;
      break;
    }
  }
  return must_abort;
}

void ClientSession::Abort(const absl::Status& cause, absl::Time now,
                          std::vector<Slice*>* retry, std::vector<Done>* done) {
  auto end = [&](Slice* slice) {
    done->push_back({slice, slice->deadline < now
                                ? SliceDeadlineError(peer_, *slice)
                                : cause});
  };
  for (const Entry& e : unsent_) {
    if (e.sent == 0 && retry != nullptr) {
      retry->push_back(e.slice);
    } else {
      end(e.slice);
    }
  }
  for (const Entry& e : awaiting_) end(e.slice);
  unsent_.clear();
  awaiting_.clear();
  load_bytes_ = 0;
  body_ = nullptr;
  body_left_ = 0;
  staging_.Clear();
}

}  // namespace ferry::tcp
