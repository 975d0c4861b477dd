// The C API over TransferEngine: handles are the C++ objects behind
// opaque struct names; statuses are absl::Status copied onto the heap.
#include "ferry/ferry_c.h"

#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "engine/capi/option_names.h"
#include "engine/capi/stats_json.h"
#include "engine/stream_transfers.h"
#include "ferry/transfer_engine.h"

struct ferry_status {
  absl::Status status;
  std::string message;  // NUL-terminated, whatever absl keeps.
};

struct ferry_options {
  ferry::EngineOptions options;
};

struct ferry_engine {
  ferry::TransferEngine engine;
  // Destroyed first: waits for stream transfers running on the engine.
  ferry::StreamTransfers streams{&engine};
};

namespace {

// Returned when a status itself cannot be allocated; never freed.
ferry_status* OutOfMemory() {
  static ferry_status* const oom = new ferry_status{
      absl::ResourceExhaustedError("out of memory"), "out of memory"};
  return oom;
}

ferry_status* Wrap(absl::Status s) {
  if (s.ok()) return nullptr;
  try {
    auto* st = new ferry_status{std::move(s), ""};
    st->message = std::string(st->status.message());
    return st;
  } catch (const std::bad_alloc&) {
    return OutOfMemory();
  }
}

ferry_status* Null(const char* what) {
  return Wrap(absl::InvalidArgumentError(absl::StrCat(what, " is NULL")));
}

size_t CopyOut(const std::string& s, char* buf, size_t cap) {
  if (buf != nullptr && cap > 0) {
    const size_t n = std::min(s.size(), cap - 1);
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  }
  return s.size();
}

// Inside Guarded: running out of memory becomes RESOURCE_EXHAUSTED.
char* Dup(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p == nullptr) throw std::bad_alloc();
  std::memcpy(p, s.data(), s.size());
  p[s.size()] = '\0';
  return p;
}

int StateOf(ferry::TransferState s) {
  switch (s) {
    case ferry::TransferState::kWaiting:
      return FERRY_WAITING;
    case ferry::TransferState::kPending:
      return FERRY_PENDING;
    case ferry::TransferState::kCompleted:
      return FERRY_COMPLETED;
    case ferry::TransferState::kFailed:
      return FERRY_FAILED;
    case ferry::TransferState::kTimeout:
      return FERRY_TIMEOUT;
  }
  return FERRY_FAILED;
}

// Runs an entry point's body: a C++ exception (allocation) never crosses
// into C.
template <typename Body>
ferry_status* Guarded(Body body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return OutOfMemory();
  } catch (const std::exception& e) {
    return Wrap(absl::InternalError(e.what()));
  }
}

}  // namespace

extern "C" {

int ferry_status_code(const ferry_status* status) {
  return status == nullptr ? FERRY_OK : static_cast<int>(status->status.code());
}

const char* ferry_status_message(const ferry_status* status) {
  return status == nullptr ? "" : status->message.c_str();
}

void ferry_status_free(ferry_status* status) {
  if (status != OutOfMemory()) delete status;
}

ferry_options* ferry_options_new(void) {
  return new (std::nothrow) ferry_options();
}

void ferry_options_free(ferry_options* options) { delete options; }

ferry_status* ferry_options_set(ferry_options* options, const char* key,
                                const char* value) {
  if (options == nullptr) return Null("options");
  if (key == nullptr) return Null("key");
  if (value == nullptr) return Null("value");
  return Guarded([&]() -> ferry_status* {
    absl::Status s = ferry::capi::SetOption(options->options, key, value);
    return s.ok() ? nullptr : Wrap(std::move(s));
  });
}

ferry_status* ferry_engine_new(const ferry_options* options,
                               ferry_engine** out) {
  if (out == nullptr) return Null("out");
  *out = nullptr;
  if (options == nullptr) return Null("options");
  return Guarded([&]() -> ferry_status* {
    auto engine = std::make_unique<ferry_engine>();
    if (absl::Status s = engine->engine.Init(options->options); !s.ok()) {
      return Wrap(std::move(s));
    }
    *out = engine.release();
    return nullptr;
  });
}

void ferry_engine_free(ferry_engine* engine) { delete engine; }

size_t ferry_engine_segment_name(const ferry_engine* engine, char* buf,
                                 size_t cap) {
  if (engine == nullptr) return CopyOut("", buf, cap);
  return CopyOut(engine->engine.local_segment_name(), buf, cap);
}

size_t ferry_engine_metadata_address(const ferry_engine* engine, char* buf,
                                     size_t cap) {
  if (engine == nullptr) return CopyOut("", buf, cap);
  return CopyOut(engine->engine.metadata_address(), buf, cap);
}

size_t ferry_engine_rpc_address(const ferry_engine* engine, char* buf,
                                size_t cap) {
  if (engine == nullptr) return CopyOut("", buf, cap);
  return CopyOut(engine->engine.rpc_address(), buf, cap);
}

ferry_status* ferry_register_memory(ferry_engine* engine, void* addr,
                                    size_t length, const char* location,
                                    int remote_accessible) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    return Wrap(engine->engine.RegisterLocalMemory(
        addr, length, location == nullptr ? "*" : location,
        remote_accessible != 0));
  });
}

ferry_status* ferry_unregister_memory(ferry_engine* engine, void* addr) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    return Wrap(engine->engine.UnregisterLocalMemory(addr));
  });
}

ferry_status* ferry_register_memory_batch(ferry_engine* engine,
                                          void* const* addrs,
                                          const size_t* lengths, size_t count,
                                          const char* location,
                                          int remote_accessible) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (count > 0 && (addrs == nullptr || lengths == nullptr)) {
      return Null("addrs or lengths");
    }
    std::vector<ferry::BufferEntry> entries(count);
    for (size_t i = 0; i < count; ++i) entries[i] = {addrs[i], lengths[i]};
    return Wrap(engine->engine.RegisterLocalMemoryBatch(
        entries, location == nullptr ? "*" : location, remote_accessible != 0));
  });
}

ferry_status* ferry_unregister_memory_batch(ferry_engine* engine,
                                            void* const* addrs, size_t count) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (count > 0 && addrs == nullptr) return Null("addrs");
    return Wrap(engine->engine.UnregisterLocalMemoryBatch(
        std::vector<void*>(addrs, addrs + count)));
  });
}

ferry_status* ferry_segment_buffers(ferry_engine* engine, ferry_segment segment,
                                    ferry_remote_buffer** out, size_t* count) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (out == nullptr || count == nullptr) return Null("out or count");
    *out = nullptr;
    *count = 0;
    auto bufs = engine->engine.GetSegmentBuffers(segment);
    if (!bufs.ok()) return Wrap(bufs.status());
    if (bufs->empty()) return nullptr;
    auto* arr = static_cast<ferry_remote_buffer*>(
        std::malloc(bufs->size() * sizeof(ferry_remote_buffer)));
    if (arr == nullptr) return Wrap(absl::ResourceExhaustedError("no memory"));
    for (size_t i = 0; i < bufs->size(); ++i) {
      arr[i] = {(*bufs)[i].addr, (*bufs)[i].length};
    }
    *out = arr;
    *count = bufs->size();
    return nullptr;
  });
}

ferry_status* ferry_open_segment(ferry_engine* engine, const char* name,
                                 ferry_segment* out) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (name == nullptr) return Null("name");
    if (out == nullptr) return Null("out");
    auto h = engine->engine.OpenSegment(name);
    if (!h.ok()) return Wrap(h.status());
    *out = *h;
    return nullptr;
  });
}

ferry_status* ferry_refresh_segment(ferry_engine* engine,
                                    ferry_segment segment) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    return Wrap(engine->engine.RefreshSegment(segment));
  });
}

ferry_status* ferry_close_segment(ferry_engine* engine, ferry_segment segment) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    return Wrap(engine->engine.CloseSegment(segment));
  });
}

ferry_status* ferry_batch_new(ferry_engine* engine, size_t capacity,
                              ferry_batch* out) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (out == nullptr) return Null("out");
    auto b = engine->engine.AllocateBatch(capacity);
    if (!b.ok()) return Wrap(b.status());
    *out = *b;
    return nullptr;
  });
}

namespace {

// The C requests as the engine's; an error names the bad one.
absl::Status ToRequests(const ferry_request* requests, size_t count,
                        std::vector<ferry::TransferRequest>* out) {
  out->resize(count);
  for (size_t i = 0; i < count; ++i) {
    const ferry_request& r = requests[i];
    if (r.opcode != FERRY_READ && r.opcode != FERRY_WRITE) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, ": opcode ",
                                                     r.opcode,
                                                     " is not FERRY_READ or "
                                                     "FERRY_WRITE"));
    }
    ferry::TransferRequest& t = (*out)[i];
    t.opcode =
        r.opcode == FERRY_WRITE ? ferry::OpCode::kWrite : ferry::OpCode::kRead;
    t.source = r.source;
    t.target_id = r.target;
    t.target_offset = r.target_offset;
    t.length = r.length;
  }
  return absl::OkStatus();
}

}  // namespace

ferry_status* ferry_submit(ferry_engine* engine, ferry_batch batch,
                           const ferry_request* requests, size_t count) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (requests == nullptr && count > 0) return Null("requests");
    std::vector<ferry::TransferRequest> reqs;
    if (absl::Status s = ToRequests(requests, count, &reqs); !s.ok()) {
      return Wrap(std::move(s));
    }
    return Wrap(engine->engine.SubmitTransfer(batch, reqs));
  });
}

ferry_status* ferry_submit_on_stream(ferry_engine* engine,
                                     const ferry_request* requests,
                                     size_t count, uintptr_t stream) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (requests == nullptr && count > 0) return Null("requests");
    std::vector<ferry::TransferRequest> reqs;
    if (absl::Status s = ToRequests(requests, count, &reqs); !s.ok()) {
      return Wrap(std::move(s));
    }
    return Wrap(engine->streams.Enqueue(stream, std::move(reqs)));
  });
}

ferry_status* ferry_take_stream_error(ferry_engine* engine) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    return Wrap(engine->streams.TakeError());
  });
}

ferry_status* ferry_batch_wait(ferry_engine* engine, ferry_batch batch,
                               int64_t timeout_ms, ferry_batch_status* out) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (out == nullptr) return Null("out");
    auto st = engine->engine.WaitBatch(
        batch, timeout_ms < 0 ? absl::InfiniteDuration()
                              : absl::Milliseconds(timeout_ms));
    absl::StatusOr<ferry::BatchStatus> now =
        st.ok() ? st : engine->engine.GetBatchStatus(batch);
    if (now.ok()) {
      out->state = StateOf(now->state);
      out->total = now->total;
      out->completed = now->completed;
      out->failed = now->failed;
      out->transferred_bytes = now->transferred_bytes;
    }
    return Wrap(st.status());
  });
}

ferry_status* ferry_request_status(ferry_engine* engine, ferry_batch batch,
                                   size_t index, int* state,
                                   uint64_t* transferred_bytes,
                                   ferry_status** error) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (error != nullptr) *error = nullptr;
    auto st = engine->engine.GetTransferStatus(batch, index);
    if (!st.ok()) return Wrap(st.status());
    if (state != nullptr) *state = StateOf(st->state);
    if (transferred_bytes != nullptr) {
      *transferred_bytes = st->transferred_bytes;
    }
    if (error != nullptr) *error = Wrap(st->error);
    return nullptr;
  });
}

ferry_status* ferry_batch_free(ferry_engine* engine, ferry_batch batch) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    return Wrap(engine->engine.FreeBatch(batch));
  });
}

ferry_status* ferry_local_topology(const char* devices, char** json) {
  return Guarded([&]() -> ferry_status* {
    if (json == nullptr) return Null("json");
    *json = nullptr;
    auto matrix =
        ferry::TransferEngine::LocalTopology(devices == nullptr ? "" : devices);
    if (!matrix.ok()) return Wrap(matrix.status());
    *json = Dup(*matrix);
    return nullptr;
  });
}

ferry_status* ferry_engine_stats(const ferry_engine* engine, char** json) {
  return Guarded([&]() -> ferry_status* {
    if (json == nullptr) return Null("json");
    *json = nullptr;
    if (engine == nullptr) return Null("engine");
    *json = Dup(ferry::capi::StatsJson(engine->engine.GetEngineStats(),
                                       engine->engine.GetTransportStats()));
    return *json == nullptr ? OutOfMemory() : nullptr;
  });
}

ferry_status* ferry_send_notification(ferry_engine* engine,
                                      ferry_segment target, const char* name,
                                      const void* message,
                                      size_t message_length) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (name == nullptr) return Null("name");
    if (message == nullptr && message_length > 0) return Null("message");
    return Wrap(engine->engine.SendNotification(
        target, name,
        std::string(static_cast<const char*>(message), message_length)));
  });
}

ferry_status* ferry_get_notifications(ferry_engine* engine,
                                      ferry_notification** out, size_t* count) {
  return Guarded([&]() -> ferry_status* {
    if (engine == nullptr) return Null("engine");
    if (out == nullptr) return Null("out");
    if (count == nullptr) return Null("count");
    *out = nullptr;
    *count = 0;
    std::vector<ferry::Notification> got = engine->engine.GetNotifications();
    if (got.empty()) return nullptr;
    auto* arr = static_cast<ferry_notification*>(
        std::calloc(got.size(), sizeof(ferry_notification)));
    if (arr == nullptr) {
      return Wrap(absl::ResourceExhaustedError(absl::StrCat(
          "no memory for ", got.size(), " notifications (they are lost)")));
    }
    try {
      for (size_t i = 0; i < got.size(); ++i) {
        arr[i].from_segment = Dup(got[i].from_segment);
        arr[i].name = Dup(got[i].name);
        arr[i].message = Dup(got[i].message);
        arr[i].message_length = got[i].message.size();
        arr[i].sender_address = Dup(got[i].sender_address);
        arr[i].sender_verified = got[i].sender_verified ? 1 : 0;
      }
    } catch (...) {
      // What was copied goes (calloc left the rest NULL); Guarded reports.
      ferry_notifications_free(arr, got.size());
      throw;
    }
    *out = arr;
    *count = got.size();
    return nullptr;
  });
}

void ferry_notifications_free(ferry_notification* notifications, size_t count) {
  if (notifications == nullptr) return;
  for (size_t i = 0; i < count; ++i) {
    std::free(notifications[i].from_segment);
    std::free(notifications[i].name);
    std::free(notifications[i].message);
    std::free(notifications[i].sender_address);
  }
  std::free(notifications);
}

}  // extern "C"
