// Internal to the transfer_bench binary: what its two halves share. The
// flags, their checks and the engine set-up live in transfer_bench.cc,
// the initiator's run in transfer_bench_initiator.cc; this declares the
// flags the initiator reads and the helpers both call.
//
// Thread-safety: g_stop is an atomic, set by the signal handler (and by a
// run that gives up) and polled by every initiator thread.
#ifndef FERRY_TOOLS_TRANSFER_BENCH_H_
#define FERRY_TOOLS_TRANSFER_BENCH_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "bench/bench_memory.h"
#include "ferry/transfer_engine.h"

ABSL_DECLARE_FLAG(std::string, segment_id);
ABSL_DECLARE_FLAG(std::string, protocol);
ABSL_DECLARE_FLAG(std::string, operation);
ABSL_DECLARE_FLAG(uint64_t, block_size);
ABSL_DECLARE_FLAG(int, batch_size);
ABSL_DECLARE_FLAG(uint64_t, block_stride);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(double, duration);
ABSL_DECLARE_FLAG(double, warmup);
ABSL_DECLARE_FLAG(uint64_t, buffer_size);
ABSL_DECLARE_FLAG(bool, verify);
ABSL_DECLARE_FLAG(bool, verify_prepare);
ABSL_DECLARE_FLAG(uint64_t, pattern_seed);
ABSL_DECLARE_FLAG(int, max_consecutive_errors);
ABSL_DECLARE_FLAG(std::string, report);
ABSL_DECLARE_FLAG(std::string, report_unit);
ABSL_DECLARE_FLAG(int, report_precision);
ABSL_DECLARE_FLAG(int, rdma_signal_every);
ABSL_DECLARE_FLAG(int, rdma_inline_bytes);

namespace ferry::transfer_bench {

// Set on SIGINT/SIGTERM, or when the run gives up: every loop ends.
extern std::atomic<bool> g_stop;

// Prints "transfer_bench: `what`: `s`" and exits with status 1.
[[noreturn]] void Die(const absl::Status& s, const std::string& what);
void MustOk(const absl::Status& s, const char* what);

// The buffer of one side: host memory, or with --use_vram device memory.
std::unique_ptr<BenchMemory> AllocBuffer(size_t size);

// Where consecutive requests of a batch start (flags validated).
size_t BlockStride();

// The initiator's flags, checked before any engine starts: a bad flag is
// an error at once, not after the target's buffer has been filled.
void CheckInitiatorFlags();

// Runs the initiator's threads against --segment_id and prints the
// report; the exit status (0: bytes moved, nothing failed or differed).
// The flags were checked by CheckInitiatorFlags.
int RunInitiator(TransferEngine& engine);

}  // namespace ferry::transfer_bench

#endif  // FERRY_TOOLS_TRANSFER_BENCH_H_
