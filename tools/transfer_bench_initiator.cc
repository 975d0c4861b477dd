// transfer_bench's initiator (the tool and its flags: transfer_bench.cc):
// threads that loop over batches of --batch_size requests against the
// target's buffer, each in a region of its own; --verify's fill, clear and
// check of every request's bytes; the back-off of failing batches; the
// READ reference pattern written before a verified READ; and the progress
// lines and final report of the run.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_memory.h"
#include "common/mutex.h"
#include "common/pattern.h"
#include "common/percentile.h"
#include "ferry/transfer_engine.h"
#include "tools/transfer_bench.h"
#include "tools/transfer_bench_report.h"

namespace ferry::transfer_bench {
namespace {

constexpr absl::Duration kMinBackoff = absl::Milliseconds(1);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(100);
// Verify mismatches printed in detail; the rest are only counted.
constexpr uint64_t kVerifyDetails = 3;
// The READ reference pattern is written in requests of at most this size.
constexpr size_t kPrepareChunk = 4 << 20;
constexpr size_t kPrepareBatch = 16;

// User and system CPU time of this process so far, in seconds.
double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

// Counts the batch's failed requests by status, and stops the run once
// --max_consecutive_errors requests failed with no completion between.
// `batch` is null when the batch was refused as a whole.
void RecordFailures(TransferEngine& engine, const BatchId* batch, size_t n,
                    const BatchStatus& st, Totals* totals) {
  if (st.completed > 0) totals->consecutive_errors.store(0);
  if (st.failed == 0) return;
  totals->errors.fetch_add(st.failed);
  size_t attributed = 0;
  for (size_t i = 0; batch != nullptr && i < n; ++i) {
    auto ts = engine.GetTransferStatus(*batch, i);
    if (ts.ok() && (ts->state == TransferState::kFailed ||
                    ts->state == TransferState::kTimeout)) {
      totals->error_log.Add(ts->error, 1);
      ++attributed;
    }
  }
  if (attributed < st.failed) {
    totals->error_log.Add(st.first_error, st.failed - attributed);
  }
  if (st.completed > 0) return;
  const uint64_t consecutive =
      totals->consecutive_errors.fetch_add(st.failed) + st.failed;
  const int limit = absl::GetFlag(FLAGS_max_consecutive_errors);
  if (limit > 0 && consecutive >= static_cast<uint64_t>(limit) &&
      !totals->gave_up.exchange(true)) {
    std::fprintf(stderr,
                 "transfer_bench: stopping: %llu requests failed in a row "
                 "(--max_consecutive_errors=%d)\n",
                 static_cast<unsigned long long>(consecutive), limit);
    g_stop.store(true);
  }
}

// Submits `reqs` as one batch and waits for it. A submit error counts as
// every request failing with that status.
BatchStatus RunBatch(TransferEngine& engine,
                     const std::vector<TransferRequest>& reqs, Totals* totals) {
  auto batch = engine.AllocateBatch(reqs.size());
  if (!batch.ok()) Die(batch.status(), "AllocateBatch");
  BatchStatus st;
  if (absl::Status s = engine.SubmitTransfer(*batch, reqs); !s.ok()) {
    st.total = reqs.size();
    st.failed = reqs.size();
    st.first_error = s;
    st.state = TransferState::kFailed;
    RecordFailures(engine, nullptr, reqs.size(), st, totals);
    engine.FreeBatch(*batch).IgnoreError();
    return st;
  }
  auto waited = engine.WaitBatch(*batch, absl::Seconds(60));
  if (!waited.ok()) Die(waited.status(), "WaitBatch");
  st = *waited;
  RecordFailures(engine, &*batch, reqs.size(), st, totals);
  if (absl::Status s = engine.FreeBatch(*batch); !s.ok()) Die(s, "FreeBatch");
  return st;
}

// Checks each request's bytes (now in local memory at its source) against
// the pattern; counts and describes mismatching requests.
void CheckRequests(const std::vector<TransferRequest>& reqs,
                   const BenchMemory& local, uint64_t seed, Totals* totals) {
  for (const TransferRequest& r : reqs) {
    const auto* p = static_cast<const uint8_t*>(r.source);
    const size_t off = static_cast<size_t>(p - local.data());
    auto m = local.Check(p, r.length, off, seed);
    MustOk(m.status(), "reading back the local buffer");
    const size_t bad = m->index;
    if (bad == r.length) continue;
    if (totals->verify_failures.fetch_add(1) < kVerifyDetails) {
      std::fprintf(stderr,
                   "verify failed: %s of %zu bytes at buffer offset %zu: byte "
                   "%zu is 0x%02x, expected 0x%02x\n",
                   r.opcode == OpCode::kWrite ? "WRITE" : "READ", r.length, off,
                   bad, m->found, PatternByte(off + bad, seed));
    }
  }
}

void Backoff(absl::Duration* backoff, absl::Time end) {
  absl::SleepFor(std::min(*backoff, end - absl::Now()));
  *backoff = std::min(*backoff * 2, kMaxBackoff);
}

// Fills each request's source with the pattern CheckRequests expects, or
// zeroes it: only the requests' bytes, never the gaps --block_stride
// leaves between them (most of the span when it is large).
void FillRequests(const std::vector<TransferRequest>& reqs,
                  const BenchMemory& local, uint64_t seed) {
  for (const TransferRequest& r : reqs) {
    auto* p = static_cast<uint8_t*>(r.source);
    MustOk(local.Fill(p, r.length, static_cast<size_t>(p - local.data()), seed),
           "filling the local buffer");
  }
}
void ClearRequests(const std::vector<TransferRequest>& reqs,
                   const BenchMemory& local) {
  for (const TransferRequest& r : reqs) {
    MustOk(local.Clear(static_cast<uint8_t*>(r.source), r.length),
           "clearing the local buffer");
  }
}

void InitiatorThread(TransferEngine& engine, SegmentHandle seg,
                     const BenchMemory* local_mem, uint64_t remote_base,
                     size_t region, int tid, absl::Time measure_from,
                     absl::Time end, Totals* totals, ThreadStats* stats) {
  uint8_t* const local = local_mem->data();
  const bool write = absl::GetFlag(FLAGS_operation) == "write";
  const bool verify = absl::GetFlag(FLAGS_verify);
  const uint64_t read_seed = absl::GetFlag(FLAGS_pattern_seed);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  const size_t batch_size = absl::GetFlag(FLAGS_batch_size);
  const size_t stride = BlockStride();
  const size_t per_batch = stride * batch_size;
  const size_t batches_in_region = std::max<size_t>(1, region / per_batch);
  const size_t base = static_cast<size_t>(tid) * region;
  std::vector<TransferRequest> reqs(batch_size);
  absl::Duration backoff = kMinBackoff;
  uint64_t iter = 0;
  // At least one batch, however late this thread starts: on a loaded
  // machine a short --duration could otherwise end before the first
  // batch, and a run that moved nothing fails for the machine's speed.
  while ((iter == 0 || absl::Now() < end) && !g_stop.load()) {
    const size_t off = base + (iter % batches_in_region) * per_batch;
    const uint64_t seed = Mix64((static_cast<uint64_t>(tid) << 40) ^ iter);
    for (size_t i = 0; i < batch_size; ++i) {
      reqs[i].opcode = write ? OpCode::kWrite : OpCode::kRead;
      reqs[i].source = local + off + i * stride;
      reqs[i].target_id = seg;
      reqs[i].target_offset = remote_base + off + i * stride;
      reqs[i].length = block;
    }
    if (verify && write) FillRequests(reqs, *local_mem, seed);
    // A READ that silently moved nothing must not pass on stale bytes.
    if (verify && !write) ClearRequests(reqs, *local_mem);
    absl::Time start = absl::Now();
    const BatchStatus st = RunBatch(engine, reqs, totals);
    double us = absl::ToDoubleMicroseconds(absl::Now() - start);
    const bool measured = start >= measure_from;
    if (measured) totals->bytes.fetch_add(st.transferred_bytes);
    if (measured) totals->transfers.fetch_add(st.completed);
    if (measured) {
      MutexLock lock(&stats->mu);
      stats->batch_us.push_back(us);
    }
    ++iter;
    if (st.completed == 0) {
      Backoff(&backoff, end);
      continue;
    }
    backoff = kMinBackoff;
    // A batch with failures is not checked: its requests are counted as
    // errors already, and which bytes arrived is undefined.
    if (!verify || st.failed > 0) continue;
    if (!write) {
      CheckRequests(reqs, *local_mem, read_seed, totals);
      continue;
    }
    // Read the range back into zeroed memory and compare.
    for (TransferRequest& r : reqs) r.opcode = OpCode::kRead;
    ClearRequests(reqs, *local_mem);
    const BatchStatus back = RunBatch(engine, reqs, totals);
    if (back.failed > 0) continue;
    for (TransferRequest& r : reqs) r.opcode = OpCode::kWrite;
    CheckRequests(reqs, *local_mem, seed, totals);
  }
}

// Writes the READ reference pattern over [0, len) of the target buffer
// (offsets relative to its start), so a verified READ is checked against
// what the target really holds. False if any write failed.
bool PrepareTarget(TransferEngine& engine, SegmentHandle seg,
                   const BenchMemory& local_mem, uint64_t remote_base,
                   size_t len, Totals* totals) {
  const uint64_t seed = absl::GetFlag(FLAGS_pattern_seed);
  std::fprintf(stderr,
               "preparing: writing the reference pattern over %zu bytes of "
               "the target (not measured)\n",
               len);
  uint8_t* const local = local_mem.data();
  MustOk(local_mem.Fill(local, len, 0, seed), "filling the local buffer");
  std::vector<TransferRequest> reqs;
  for (size_t off = 0; off < len && !g_stop.load();) {
    reqs.clear();
    while (off < len && reqs.size() < kPrepareBatch) {
      TransferRequest r;
      r.opcode = OpCode::kWrite;
      r.source = local + off;
      r.target_id = seg;
      r.target_offset = remote_base + off;
      r.length = std::min(kPrepareChunk, len - off);
      off += r.length;
      reqs.push_back(r);
    }
    if (RunBatch(engine, reqs, totals).failed > 0) return false;
  }
  return !g_stop.load();
}

}  // namespace

int RunInitiator(TransferEngine& engine) {
  const size_t buffer = absl::GetFlag(FLAGS_buffer_size);
  const int threads = absl::GetFlag(FLAGS_threads);
  const size_t block = absl::GetFlag(FLAGS_block_size);
  const int batch_size = absl::GetFlag(FLAGS_batch_size);
  const double duration = absl::GetFlag(FLAGS_duration);
  const double warmup = absl::GetFlag(FLAGS_warmup);
  const size_t stride = BlockStride();
  const size_t region = buffer / static_cast<size_t>(threads);
  auto seg = engine.OpenSegment(absl::GetFlag(FLAGS_segment_id));
  if (!seg.ok()) Die(seg.status(), "OpenSegment");
  auto bufs = engine.GetSegmentBuffers(*seg);
  if (!bufs.ok()) Die(bufs.status(), "GetSegmentBuffers");
  if (bufs->empty() || bufs->front().length < buffer) {
    Die(absl::FailedPreconditionError(
            "target has no remote-accessible buffer of buffer_size bytes "
            "(start the target with the same --buffer_size)"),
        "target");
  }
  std::unique_ptr<BenchMemory> local_mem = AllocBuffer(buffer);
  MustOk(local_mem->Clear(local_mem->data(), buffer),
         "clearing the local buffer");
  if (absl::Status s = engine.RegisterLocalMemory(local_mem->data(), buffer,
                                                  local_mem->location(), false);
      !s.ok()) {
    Die(s, "registering local buffer");
  }
  const bool verify = absl::GetFlag(FLAGS_verify);
  const bool write = absl::GetFlag(FLAGS_operation) == "write";
  Totals totals;
  if (verify && !write && absl::GetFlag(FLAGS_verify_prepare)) {
    // What the threads read: batches_in_region whole batches per region.
    const size_t per_batch = stride * static_cast<size_t>(batch_size);
    const size_t used = (static_cast<size_t>(threads) - 1) * region +
                        std::max<size_t>(1, region / per_batch) * per_batch;
    if (!PrepareTarget(engine, *seg, *local_mem, bufs->front().addr, used,
                       &totals)) {
      totals.error_log.PrintSummary();
      std::fprintf(stderr,
                   "transfer_bench: could not write the reference pattern "
                   "to the target; no READ was verified\n");
      return 1;
    }
  }
  std::vector<ThreadStats> stats(static_cast<size_t>(threads));
  const absl::Time start = absl::Now() + absl::Seconds(warmup);
  const absl::Time end = start + absl::Seconds(duration);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    try {
      workers.emplace_back(InitiatorThread, std::ref(engine), *seg,
                           local_mem.get(), bufs->front().addr, region, t,
                           start, end, &totals, &stats[static_cast<size_t>(t)]);
    } catch (const std::system_error& e) {
      // A thread or pids limit: stop the workers already running and say
      // so, rather than abort with the exception.
      g_stop = true;
      for (std::thread& w : workers) w.join();
      std::fprintf(stderr,
                   "transfer_bench: cannot start initiator thread %d of %d: "
                   "%s (a thread or pids limit?); try fewer --threads\n",
                   t + 1, threads, e.what());
      return 1;
    }
  }
  const bool json = absl::GetFlag(FLAGS_report) == "json";
  FILE* progress = json ? stderr : stdout;
  const std::string unit = absl::GetFlag(FLAGS_report_unit);
  const int precision = absl::GetFlag(FLAGS_report_precision);
  while (absl::Now() < start && !g_stop.load()) {
    absl::SleepFor(std::min(absl::Milliseconds(100), start - absl::Now()));
  }
  // This process's CPU over the measured window (CPU per GB moved: the
  // bench scripts add the target's).
  const double cpu_from = ProcessCpuSeconds();
  uint64_t last_bytes = totals.bytes.load();
  absl::Time last = absl::Now();
  while (absl::Now() < end && !g_stop.load()) {
    absl::SleepFor(std::min(absl::Milliseconds(100), end - absl::Now()));
    absl::Time now = absl::Now();
    if (now - last < absl::Seconds(1) && now < end && !g_stop.load()) continue;
    uint64_t bytes = totals.bytes.load();
    std::fprintf(progress,
                 "[%5.1fs, %5.1fs left] %s  %llu transfers  %llu errors",
                 absl::ToDoubleSeconds(now - start),
                 std::max(0.0, absl::ToDoubleSeconds(end - now)),
                 Rate(static_cast<double>(bytes - last_bytes) /
                          absl::ToDoubleSeconds(now - last),
                      unit, precision)
                     .c_str(),
                 static_cast<unsigned long long>(totals.transfers.load()),
                 static_cast<unsigned long long>(totals.errors.load()));
    if (verify) {
      std::fprintf(
          progress, "  %llu verify failures",
          static_cast<unsigned long long>(totals.verify_failures.load()));
    }
    std::fprintf(progress, "\n");
    std::fflush(progress);
    last_bytes = bytes;
    last = now;
  }
  for (auto& w : workers) w.join();
  const double cpu_s = ProcessCpuSeconds() - cpu_from;
  const double secs =
      std::max(1e-9, absl::ToDoubleSeconds(absl::Now() - start));
  std::vector<double> lat;
  for (auto& s : stats) {
    MutexLock lock(&s.mu);
    lat.insert(lat.end(), s.batch_us.begin(), s.batch_us.end());
  }
  const double p50 = Percentile(lat, 0.50), p99 = Percentile(lat, 0.99);
  const double gbps = static_cast<double>(totals.bytes.load()) / secs / 1e9;
  const double tps = static_cast<double>(totals.transfers.load()) / secs;
  engine.UnregisterLocalMemory(local_mem->data()).IgnoreError();
  local_mem.reset();
  const uint64_t transfer_errors = totals.errors.load();
  const uint64_t verify_failures = totals.verify_failures.load();
  const uint64_t errors = transfer_errors + verify_failures;
  const bool ok = errors == 0 && totals.bytes.load() > 0;
  totals.error_log.PrintSummary();
  // The transport's counters: which NIC carried what, retries.
  std::string nics;
  uint64_t retries = 0;
  for (const TransportStats& t : engine.GetTransportStats()) {
    retries += t.retries;
    for (const NicStats& n : t.nics) {
      absl::StrAppend(&nics, nics.empty() ? "" : ",", "{\"name\":\"", n.name,
                      "\",\"port_active\":", n.port_active ? "true" : "false",
                      ",\"slices\":", n.slices, ",\"bytes\":", n.bytes,
                      ",\"errors\":", n.errors,
                      ",\"work_requests\":", n.work_requests,
                      ",\"completions\":", n.completions, "}");
    }
  }
  if (json) {
    // "errors" counts every failure (transfer errors + verify failures), so
    // `"errors":0` alone still means a clean run.
    std::printf(
        "{\"protocol\":\"%s\",\"operation\":\"%s\",\"block_size\":%zu,"
        "\"block_stride\":%zu,\"batch_size\":%d,\"threads\":%d,"
        "\"rdma_signal_every\":%d,\"rdma_inline_bytes\":%d,\"seconds\":%.3f,"
        "\"throughput_gbps\":%.4f,\"transfers_per_sec\":%.1f,"
        "\"p50_us\":%.1f,\"p99_us\":%.1f,\"bytes\":%llu,\"errors\":%llu,"
        "\"transfer_errors\":%llu,\"verify\":%s,\"verified\":%s,"
        "\"verify_failures\":%llu,\"stopped_on_errors\":%s,"
        "\"retries\":%llu,\"cpu_s\":%.3f,\"nics\":[%s]}\n",
        absl::GetFlag(FLAGS_protocol).c_str(),
        absl::GetFlag(FLAGS_operation).c_str(), block, BlockStride(),
        batch_size, threads, absl::GetFlag(FLAGS_rdma_signal_every),
        absl::GetFlag(FLAGS_rdma_inline_bytes), secs, gbps, tps, p50, p99,
        static_cast<unsigned long long>(totals.bytes.load()),
        static_cast<unsigned long long>(errors),
        static_cast<unsigned long long>(transfer_errors),
        verify ? "true" : "false", verify && ok ? "true" : "false",
        static_cast<unsigned long long>(verify_failures),
        totals.gave_up.load() ? "true" : "false",
        static_cast<unsigned long long>(retries), cpu_s, nics.c_str());
  } else {
    std::string verdict;
    if (verify) {
      verdict = ok ? ", every byte verified"
                   : absl::StrCat(", ", verify_failures,
                                  " verify failures (verify FAILED)");
    }
    std::printf(
        "%s %s: %s, %.0f transfers/s, batch latency p50 %.1f us p99 "
        "%.1f us, %llu bytes, %llu errors%s\n",
        absl::GetFlag(FLAGS_protocol).c_str(),
        absl::GetFlag(FLAGS_operation).c_str(),
        Rate(gbps * 1e9, unit, precision).c_str(), tps, p50, p99,
        static_cast<unsigned long long>(totals.bytes.load()),
        static_cast<unsigned long long>(transfer_errors), verdict.c_str());
  }
  std::fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace ferry::transfer_bench
