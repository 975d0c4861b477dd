/* ferry_c.h: Ferry's C API, for C programs and for bindings from other
 * languages (Go, Rust, ...), as Mooncake TE has one for its Go and Rust
 * bindings. It covers what include/ferry/transfer_engine.h covers, with opaque
 * handles and explicit status objects; no C++ type crosses it.
 *
 * Errors. Every call that can fail returns a `ferry_status*`: NULL on
 * success, else an object with a code (FERRY_* below, the same numbers as
 * absl::StatusCode and gRPC) and a message saying what and why. The caller
 * frees it with ferry_status_free (which accepts NULL).
 *
 * Thread-safety. An engine may be used from several threads at once, as
 * the C++ TransferEngine may, but ferry_engine_free must not run while any
 * other call on the engine is in progress. ferry_options is not
 * thread-safe. A status object belongs to the thread that got it.
 *
 * No C++ exception crosses this API: running out of memory is
 * FERRY_RESOURCE_EXHAUSTED.
 *
 * Memory. Strings the API returns are copied into caller buffers or into
 * objects the caller frees with the matching *_free function.
 */
#ifndef FERRY_INCLUDE_FERRY_FERRY_C_H_
#define FERRY_INCLUDE_FERRY_FERRY_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes (absl::StatusCode's numbers). */
enum {
  FERRY_OK = 0,
  FERRY_CANCELLED = 1,
  FERRY_UNKNOWN = 2,
  FERRY_INVALID_ARGUMENT = 3,
  FERRY_DEADLINE_EXCEEDED = 4,
  FERRY_NOT_FOUND = 5,
  FERRY_ALREADY_EXISTS = 6,
  FERRY_PERMISSION_DENIED = 7,
  FERRY_RESOURCE_EXHAUSTED = 8,
  FERRY_FAILED_PRECONDITION = 9,
  FERRY_ABORTED = 10,
  FERRY_OUT_OF_RANGE = 11,
  FERRY_UNIMPLEMENTED = 12,
  FERRY_INTERNAL = 13,
  FERRY_UNAVAILABLE = 14,
  FERRY_DATA_LOSS = 15,
  FERRY_UNAUTHENTICATED = 16
};

typedef struct ferry_status ferry_status;
int ferry_status_code(const ferry_status* status); /* FERRY_OK for NULL. */
/* The message; "" for NULL. Valid until the status is freed. */
const char* ferry_status_message(const ferry_status* status);
void ferry_status_free(ferry_status* status);

/* Engine options: every EngineOptions field by name, as a string
 * (engine/capi/option_names.h has the rules; docs/c_api.md the list).
 * Nested fields take their struct's prefix: "tcp.max_slice_bytes",
 * "rdma.slice_bytes", "rdma.devices" ("mlx5_0,mlx5_1"; also
 * "rdma_devices"). Durations carry the unit in the name: "_ms"
 * (rpc_timeout_ms, tcp.frame_timeout_ms) or "_us" (wait_spin_us). Lists
 * are comma-separated (transports: "tcp", "rdma", "rdma,tcp"); booleans
 * "0"/"1" or "false"/"true". metadata_endpoint: "embedded", "host:port",
 * "etcd://h:p[,h:p]" or "P2PHANDSHAKE". An unknown key or a malformed
 * value is INVALID_ARGUMENT naming it. */
typedef struct ferry_options ferry_options;
ferry_options* ferry_options_new(void);
void ferry_options_free(ferry_options* options);
ferry_status* ferry_options_set(ferry_options* options, const char* key,
                                const char* value);

typedef struct ferry_engine ferry_engine;
/* Starts an engine (TransferEngine::Init). On failure *out is NULL. */
ferry_status* ferry_engine_new(const ferry_options* options,
                               ferry_engine** out);
/* Shuts the engine down and frees it (requests in flight end FAILED). */
void ferry_engine_free(ferry_engine* engine);

/* Copies a NUL-terminated string into buf (at most cap bytes with the NUL)
 * and returns its full length without the NUL, as snprintf does. */
size_t ferry_engine_segment_name(const ferry_engine* engine, char* buf,
                                 size_t cap);
size_t ferry_engine_metadata_address(const ferry_engine* engine, char* buf,
                                     size_t cap);
size_t ferry_engine_rpc_address(const ferry_engine* engine, char* buf,
                                size_t cap);

/* Memory. location: "cpu:N", "cuda:N" or "*" (NULL: "*"). */
ferry_status* ferry_register_memory(ferry_engine* engine, void* addr,
                                    size_t length, const char* location,
                                    int remote_accessible);
ferry_status* ferry_unregister_memory(ferry_engine* engine, void* addr);
/* Several buffers, all or none, with one metadata round trip. */
ferry_status* ferry_register_memory_batch(ferry_engine* engine,
                                          void* const* addrs,
                                          const size_t* lengths, size_t count,
                                          const char* location,
                                          int remote_accessible);
/* Each is attempted; the first error (naming its address) is returned. */
ferry_status* ferry_unregister_memory_batch(ferry_engine* engine,
                                            void* const* addrs, size_t count);

typedef uint64_t ferry_segment;
ferry_status* ferry_open_segment(ferry_engine* engine, const char* name,
                                 ferry_segment* out);
ferry_status* ferry_close_segment(ferry_engine* engine, ferry_segment segment);
/* Fetches the segment's descriptor again; an error says the peer cannot be
 * reached or is no longer registered. */
ferry_status* ferry_refresh_segment(ferry_engine* engine,
                                    ferry_segment segment);

/* The segment's remote-accessible buffers, from the cached descriptor,
 * sorted by address: *out is an array of *count, freed with free(). */
typedef struct {
  uint64_t addr;
  uint64_t length;
} ferry_remote_buffer;
ferry_status* ferry_segment_buffers(ferry_engine* engine, ferry_segment segment,
                                    ferry_remote_buffer** out, size_t* count);

enum { FERRY_READ = 0, FERRY_WRITE = 1 };
typedef struct {
  int opcode;             /* FERRY_READ or FERRY_WRITE. */
  void* source;           /* Local memory, inside a registered buffer. */
  ferry_segment target;   /* From ferry_open_segment. */
  uint64_t target_offset; /* The remote virtual address. */
  size_t length;
} ferry_request;

enum {
  FERRY_WAITING = 0,
  FERRY_PENDING = 1,
  FERRY_COMPLETED = 2,
  FERRY_FAILED = 3,
  FERRY_TIMEOUT = 4
};
typedef struct {
  int state; /* FERRY_WAITING .. FERRY_TIMEOUT. */
  size_t total;
  size_t completed;
  size_t failed;
  uint64_t transferred_bytes;
} ferry_batch_status;

typedef uint64_t ferry_batch;
ferry_status* ferry_batch_new(ferry_engine* engine, size_t capacity,
                              ferry_batch* out);
/* All or none: on error (naming the request's index) none is submitted. */
ferry_status* ferry_submit(ferry_engine* engine, ferry_batch batch,
                           const ferry_request* requests, size_t count);
/* Waits up to timeout_ms (negative: no limit) for every submitted request.
 * *out is filled when
 * the call returns OK or DEADLINE_EXCEEDED (the requests go on); a batch
 * that ended with a failed request returns OK with out->state FERRY_FAILED,
 * and its first error is given by ferry_request_status. */
ferry_status* ferry_batch_wait(ferry_engine* engine, ferry_batch batch,
                               int64_t timeout_ms, ferry_batch_status* out);
/* Request `index` of the batch: its state and bytes, and (if error is not
 * NULL) its error, NULL unless it failed or timed out. */
ferry_status* ferry_request_status(ferry_engine* engine, ferry_batch batch,
                                   size_t index, int* state,
                                   uint64_t* transferred_bytes,
                                   ferry_status** error);
/* FAILED_PRECONDITION while requests are in flight. */
ferry_status* ferry_batch_free(ferry_engine* engine, ferry_batch batch);

/* Transfers ordered on a CUDA stream, as Mooncake's *_on_cuda calls:
 * `stream` is a CUstream (cudaStream_t) of the process's CUDA driver, 0 for
 * the legacy default stream. The requests start once the stream's earlier
 * work is done, and the stream's later work waits until they ended. The
 * call returns once they are queued; its error means nothing was queued
 * (no CUDA driver, a bad request, the driver refused). A failure of the
 * transfers themselves cannot fail the stream: it is logged and kept for
 * ferry_take_stream_error. ferry_engine_free waits for those running. */
ferry_status* ferry_submit_on_stream(ferry_engine* engine,
                                     const ferry_request* requests,
                                     size_t count, uintptr_t stream);
/* The first failure of a stream transfer since the last call, naming how
 * many failed (NULL: none). */
ferry_status* ferry_take_stream_error(ferry_engine* engine);

/* This host's RDMA NICs as Mooncake TE's priority matrix (JSON: each
 * memory location's tiers of NIC names, best first), from sysfs; `devices`
 * is a comma-separated filter (NULL or "": every NIC). Where sysfs places
 * none of them (soft NICs), {"*": [[every NIC]]}. *json is a NUL-terminated
 * string freed with free(). NOT_FOUND if there is no NIC. */
ferry_status* ferry_local_topology(const char* devices, char** json);

/* The engine's counters as JSON (engine/capi/stats_json.h): EngineStats's
 * fields, and "transports", each with TransportStats's fields and its
 * "nics" (NicStats). *json is a NUL-terminated string freed with free(). */
ferry_status* ferry_engine_stats(const ferry_engine* engine, char** json);

/* Notifications. */
ferry_status* ferry_send_notification(ferry_engine* engine,
                                      ferry_segment target, const char* name,
                                      const void* message,
                                      size_t message_length);
typedef struct {
  char* from_segment; /* As the sender claims it. */
  char* name;
  char* message; /* message_length bytes, then a NUL. */
  size_t message_length;
  char* sender_address; /* As the connection shows it. */
  int sender_verified;  /* from_segment signed it (its identity key). */
} ferry_notification;
/* Takes the notifications received so far (oldest first): *out is an
 * array of *count, freed with ferry_notifications_free. */
ferry_status* ferry_get_notifications(ferry_engine* engine,
                                      ferry_notification** out, size_t* count);
void ferry_notifications_free(ferry_notification* notifications, size_t count);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FERRY_INCLUDE_FERRY_FERRY_C_H_ */
