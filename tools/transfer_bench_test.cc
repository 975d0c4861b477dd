// transfer_bench as a user runs it: real target and initiator processes.
//   - verified READs are right whatever ran before (issue 9, defect 12);
//   - verify failures are counted in the progress lines, the summary and
//     the JSON report, and make the exit status non-zero;
//   - a target nobody answers for gives a few lines and a bounded,
//     failed run, not an error storm (defect 5, the bench's side).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/metadata_client.h"
#include "metadata/store_testing.h"
#include "testing/subprocess.h"
#include "tools/tool_test_util.h"

namespace ferry {
namespace {

using ::ferry::testing::RunfilePath;
using ::ferry::testing::StartTool;
using ::ferry::testing::Subprocess;
using ::ferry::testing::WaitForLine;

constexpr uint64_t kBuffer = 8 << 20;
constexpr absl::Duration kRunBound = absl::Seconds(60);

struct BenchRun {
  int exit_code = -1;
  // stdout and stderr, interleaved as written.
  std::vector<std::string> lines;

  // The JSON report (--report=json): the last line starting with '{'.
  std::string Json() const {
    for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
      if (absl::StartsWith(*it, "{")) return *it;
    }
    return "";
  }
  int Count(absl::string_view needle) const {
    int n = 0;
    for (const std::string& l : lines) n += absl::StrContains(l, needle);
    return n;
  }
  std::string Text() const { return absl::StrJoin(lines, "\n"); }
};

// The number after "key": in a flat JSON object; -1 if absent.
int64_t JsonNumber(const std::string& json, const std::string& key) {
  const std::string k = absl::StrCat("\"", key, "\":");
  size_t at = json.find(k);
  if (at == std::string::npos) return -1;
  at += k.size();
  size_t end = json.find_first_of(",}", at);
  int64_t v = -1;
  if (!absl::SimpleAtoi(json.substr(at, end - at), &v)) return -1;
  return v;
}

std::string JsonField(const std::string& json, const std::string& key) {
  const std::string k = absl::StrCat("\"", key, "\":");
  size_t at = json.find(k);
  if (at == std::string::npos) return "";
  at += k.size();
  return json.substr(at, json.find_first_of(",}", at) - at);
}

// Runs transfer_bench with `args` to completion (bounded), capturing its
// output with stderr merged into stdout.
BenchRun RunBench(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"/bin/sh", "-c", R"(exec "$@" 2>&1)", "sh",
                                   RunfilePath("tools/transfer_bench")};
  argv.insert(argv.end(), args.begin(), args.end());
  BenchRun run;
  auto child = Subprocess::Start(argv);
  EXPECT_OK(child);
  if (!child.ok()) return run;
  const absl::Time deadline = absl::Now() + kRunBound;
  while (true) {
    auto line = (*child)->ReadLine(deadline - absl::Now());
    if (!line.ok()) {
      EXPECT_STATUS(line, absl::StatusCode::kOutOfRange)
          << "transfer_bench did not finish within " << kRunBound;
      break;
    }
    run.lines.push_back(*line);
  }
  auto rc = (*child)->Finish(absl::Seconds(10));
  EXPECT_OK(rc);
  if (rc.ok()) run.exit_code = *rc;
  return run;
}

class TransferBenchTest : public ::testing::Test {
 protected:
  // Starts a target with `extra` flags; sets metadata_.
  void StartTarget(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {RunfilePath("tools/transfer_bench"),
                                     "--mode=target", "--segment_id=bt",
                                     absl::StrCat("--buffer_size=", kBuffer)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ASSERT_OK_AND_ASSIGN(target_, StartTool(argv));
    ASSERT_OK_AND_ASSIGN(
        metadata_, WaitForLine(*target_, "target ready: segment=bt metadata=",
                               absl::Seconds(30)));
  }

  std::vector<std::string> Initiator(const std::string& op,
                                     const std::string& report,
                                     std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {"--mode=initiator",
                                  absl::StrCat("--metadata_server=", metadata_),
                                  "--segment_id=bt",
                                  absl::StrCat("--operation=", op),
                                  absl::StrCat("--buffer_size=", kBuffer),
                                  "--block_size=65536",
                                  "--batch_size=4",
                                  "--threads=1",
                                  "--duration=1",
                                  "--verify",
                                  absl::StrCat("--report=", report)};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }

  // Overwrites `len` bytes of the target's buffer at `offset` from outside
  // the process, as a bad DMA or a bug in the target would.
  void CorruptTarget(uint64_t offset, size_t len) {
    metadata::MetadataClient client(metadata_, absl::Seconds(3));
    ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d, client.Get("bt"));
    ASSERT_GT(d.buffers_size(), 0);
    const int fd = open(absl::StrCat("/proc/", target_->pid(), "/mem").c_str(),
                        O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0) << "cannot open the target's memory: " << strerror(errno);
    std::string junk(len, '\xa5');
    const ssize_t n = pwrite(fd, junk.data(), len,
                             static_cast<off_t>(d.buffers(0).addr() + offset));
    close(fd);
    ASSERT_EQ(n, static_cast<ssize_t>(len)) << strerror(errno);
  }

  std::unique_ptr<Subprocess> target_;
  std::string metadata_;
};

TEST_F(TransferBenchTest, VerifiedReadIsRightAfterAVerifiedWrite) {
  ASSERT_NO_FATAL_FAILURE(StartTarget());
  BenchRun write = RunBench(Initiator("write", "json"));
  EXPECT_EQ(write.exit_code, 0) << write.Text();
  EXPECT_EQ(JsonNumber(write.Json(), "verify_failures"), 0) << write.Text();
  EXPECT_GT(JsonNumber(write.Json(), "bytes"), 0) << write.Text();

  // The WRITEs left their own patterns in the target; a verified READ must
  // still be right.
  BenchRun read = RunBench(Initiator("read", "json"));
  EXPECT_EQ(read.exit_code, 0) << read.Text();
  EXPECT_EQ(JsonNumber(read.Json(), "verify_failures"), 0) << read.Text();
  EXPECT_EQ(JsonNumber(read.Json(), "errors"), 0) << read.Text();
  EXPECT_EQ(JsonField(read.Json(), "verified"), "true") << read.Text();
  EXPECT_GT(JsonNumber(read.Json(), "bytes"), 0) << read.Text();

  // And in text: the claim is made only when it holds.
  BenchRun text = RunBench(Initiator("read", "text"));
  EXPECT_EQ(text.exit_code, 0) << text.Text();
  EXPECT_EQ(text.Count("every byte verified"), 1) << text.Text();
  EXPECT_GT(text.Count(" 0 verify failures"), 0) << text.Text();
}

TEST_F(TransferBenchTest, CorruptedTargetFailsTheReadVerify) {
  ASSERT_NO_FATAL_FAILURE(StartTarget());
  // Two blocks of the 64 KiB ones the READs cover, one byte and a run.
  ASSERT_NO_FATAL_FAILURE(CorruptTarget(65536 * 3 + 17, 1));
  ASSERT_NO_FATAL_FAILURE(CorruptTarget(65536 * 40, 300));
  // Checked against the target's initial fill: no WRITE repairs it first.
  BenchRun json = RunBench(Initiator("read", "json", {"--noverify_prepare"}));
  EXPECT_NE(json.exit_code, 0) << json.Text();
  EXPECT_GT(JsonNumber(json.Json(), "verify_failures"), 0) << json.Text();
  EXPECT_EQ(JsonNumber(json.Json(), "transfer_errors"), 0) << json.Text();
  EXPECT_GT(JsonNumber(json.Json(), "errors"), 0) << json.Text();
  EXPECT_EQ(JsonField(json.Json(), "verified"), "false") << json.Text();
  EXPECT_GT(json.Count("verify failed: READ of 65536 bytes at buffer offset " +
                       std::to_string(65536 * 3) + ": byte 17 is 0xa5"),
            0)
      << json.Text();

  BenchRun text = RunBench(Initiator("read", "text", {"--noverify_prepare"}));
  EXPECT_NE(text.exit_code, 0) << text.Text();
  EXPECT_EQ(text.Count("every byte verified"), 0) << text.Text();
  EXPECT_EQ(text.Count("verify FAILED"), 1) << text.Text();
  // The progress lines count them too.
  int progress_with_failures = 0;
  for (const std::string& l : text.lines) {
    if (absl::StartsWith(l, "[") && absl::StrContains(l, "verify failures") &&
        !absl::StrContains(l, " 0 verify failures")) {
      ++progress_with_failures;
    }
  }
  EXPECT_GT(progress_with_failures, 0) << text.Text();

  // With the prepare step (the default) the same target reads clean: the
  // reference pattern is written over the corruption first.
  BenchRun prepared = RunBench(Initiator("read", "json"));
  EXPECT_EQ(prepared.exit_code, 0) << prepared.Text();
  EXPECT_EQ(JsonNumber(prepared.Json(), "verify_failures"), 0)
      << prepared.Text();
}

// --block_stride leaves gaps between a batch's requests: WRITEs and READs
// are verified where each request lands, bytes in the gaps are no
// request's, and a stride below the block size is refused.
TEST_F(TransferBenchTest, StridedRequestsAreVerifiedWhereTheyLand) {
  ASSERT_NO_FATAL_FAILURE(StartTarget());
  const std::vector<std::string> strided = {"--block_size=1000",
                                            "--block_stride=4096"};
  // Corrupt a gap (after request 0) and request 2 (at 8192) of the
  // target's initial fill; READs checked against it see only the second.
  ASSERT_NO_FATAL_FAILURE(CorruptTarget(1500, 100));
  ASSERT_NO_FATAL_FAILURE(CorruptTarget(2 * 4096 + 5, 1));
  std::vector<std::string> read_flags = strided;
  read_flags.push_back("--noverify_prepare");
  BenchRun read = RunBench(Initiator("read", "json", read_flags));
  EXPECT_NE(read.exit_code, 0) << read.Text();
  EXPECT_GT(read.Count("verify failed: READ of 1000 bytes at buffer offset "
                       "8192: byte 5 is 0xa5"),
            0)
      << read.Text();
  EXPECT_EQ(read.Count("buffer offset 0:"), 0) << read.Text();
  EXPECT_EQ(JsonNumber(read.Json(), "block_stride"), 4096) << read.Text();

  BenchRun write = RunBench(Initiator("write", "json", strided));
  EXPECT_EQ(write.exit_code, 0) << write.Text();
  EXPECT_EQ(JsonNumber(write.Json(), "verify_failures"), 0) << write.Text();
  EXPECT_GT(JsonNumber(write.Json(), "bytes"), 0) << write.Text();
  // The prepare step rewrites the reference over the WRITEs: clean.
  BenchRun prepared = RunBench(Initiator("read", "json", strided));
  EXPECT_EQ(prepared.exit_code, 0) << prepared.Text();
  EXPECT_EQ(JsonNumber(prepared.Json(), "verify_failures"), 0)
      << prepared.Text();

  BenchRun overlap = RunBench(
      Initiator("write", "json", {"--block_size=1000", "--block_stride=999"}));
  EXPECT_NE(overlap.exit_code, 0) << overlap.Text();
  EXPECT_GT(overlap.Count("--block_stride (999) must be 0 or at least "
                          "--block_size (1000)"),
            0)
      << overlap.Text();
}

TEST_F(TransferBenchTest, WrongPatternSeedFailsTheReadVerify) {
  ASSERT_NO_FATAL_FAILURE(StartTarget({"--pattern_seed=12345"}));
  BenchRun run = RunBench(Initiator("read", "json", {"--noverify_prepare"}));
  EXPECT_NE(run.exit_code, 0) << run.Text();
  EXPECT_GT(JsonNumber(run.Json(), "verify_failures"), 0) << run.Text();
  // Details for the first few only.
  EXPECT_EQ(run.Count("verify failed:"), 3) << run.Text();
  BenchRun agree = RunBench(Initiator(
      "read", "json", {"--noverify_prepare", "--pattern_seed=12345"}));
  EXPECT_EQ(agree.exit_code, 0) << agree.Text();
  EXPECT_EQ(JsonNumber(agree.Json(), "verify_failures"), 0) << agree.Text();
}

// A segment whose advertised addresses nothing listens on: the initiator
// must back off, print the status once with a count, and stop non-zero
// after --max_consecutive_errors, instead of millions of resubmissions.
// Flags that used to crash (SIGFPE on an overflowing block x batch size),
// wrap (a port past 65535) or measure nothing without a word: each is an
// exit status 1 with the flag named.
TEST_F(TransferBenchTest, BadFlagsGetAClearError) {
  const std::vector<std::vector<std::string>> cases = {
      {"--mode=target", "--rpc_port=70000"},
      {"--mode=target", "--rpc_port=-1"},
      {"--mode=local", "--block_size=1099511627776", "--batch_size=16777216"},
      {"--mode=local", "--duration=0"},
      {"--mode=local", "--duration=nan"},
      {"--mode=local", "--warmup=-1"},
      {"--mode=local", "--report_unit=GBps"},
      {"--mode=local", "--report_precision=10"},
      {"--mode=local", "--nic_priority_matrix=/nonexistent/matrix.json"},
      {"--mode=local", "--nic_priority_matrix=/dev/zero"},
  };
  for (const auto& args : cases) {
    SCOPED_TRACE(absl::StrJoin(args, " "));
    BenchRun run = RunBench(args);
    EXPECT_EQ(run.exit_code, 1);
    EXPECT_TRUE(std::any_of(run.lines.begin(), run.lines.end(),
                            [](const std::string& l) {
                              return absl::StrContains(l, "INVALID_ARGUMENT");
                            }))
        << absl::StrJoin(run.lines, "\n");
  }
}

// Mooncake's defaults (128 x 64 KiB per batch, 12 threads) and its report
// flags: the rate in the unit and precision asked for, and progress lines
// with the time elapsed and left.
TEST_F(TransferBenchTest, MooncakeDefaultsAndReportFlags) {
  BenchRun run =
      RunBench({"--mode=local", "--buffer_size=134217728", "--duration=1.6",
                "--report_unit=MiB", "--report_precision=3"});
  EXPECT_EQ(run.exit_code, 0) << run.Text();
  const std::regex summary(
      R"(^tcp write: [0-9]+\.[0-9]{3} MiB/s, [0-9]+ transfers/s, .*)");
  const std::regex progress(
      R"(^\[ +1\.[0-9]s, +0\.[0-9]s left\] [0-9]+\.[0-9]{3} MiB/s .*)");
  int summaries = 0, progresses = 0;
  for (const std::string& l : run.lines) {
    summaries += std::regex_match(l, summary);
    progresses += std::regex_match(l, progress);
  }
  EXPECT_EQ(summaries, 1) << run.Text();
  EXPECT_GE(progresses, 1) << run.Text();

  BenchRun json = RunBench({"--mode=local", "--buffer_size=134217728",
                            "--duration=0.5", "--report=json"});
  EXPECT_EQ(json.exit_code, 0) << json.Text();
  EXPECT_EQ(JsonNumber(json.Json(), "batch_size"), 128) << json.Text();
  EXPECT_EQ(JsonNumber(json.Json(), "threads"), 12) << json.Text();
  EXPECT_EQ(JsonNumber(json.Json(), "block_size"), 65536) << json.Text();
}

TEST_F(TransferBenchTest, UnreachableTargetStopsWithOneClearStatus) {
  ASSERT_OK_AND_ASSIGN(auto md, StartTool({RunfilePath("tools/metadata_server"),
                                           "--listen=127.0.0.1:0"}));
  ASSERT_OK_AND_ASSIGN(
      std::string md_addr,
      WaitForLine(*md, "metadata_server listening on ", absl::Seconds(30)));
  // A port that is bound but not listening: connects to it are refused,
  // and nobody else can listen there while the test runs.
  uint16_t dead_port = 0;
  UniqueFd holder(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(holder.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)),
              0);
    socklen_t len = sizeof(a);
    getsockname(holder.get(), reinterpret_cast<sockaddr*>(&a), &len);
    dead_port = ntohs(a.sin_port);
  }
  const std::string dead = absl::StrCat("127.0.0.1:", dead_port);
  descriptor::SegmentDescriptor ghost;
  ghost.set_name("ghost");
  ghost.set_incarnation(7);
  ghost.set_rpc_address(dead);
  auto* t = ghost.add_transports();
  t->set_transport("tcp");
  t->set_address(dead);
  auto* b = ghost.add_buffers();
  b->set_addr(1ull << 32);
  b->set_length(kBuffer);
  b->set_location("cpu:0");
  metadata::MetadataClient client(md_addr, absl::Seconds(3));
  ASSERT_OK(client.Put(metadata::LeasedPutOf(ghost)));

  const absl::Time start = absl::Now();
  BenchRun run =
      RunBench({"--mode=initiator", absl::StrCat("--metadata_server=", md_addr),
                "--segment_id=ghost", "--operation=write",
                absl::StrCat("--buffer_size=", kBuffer), "--block_size=65536",
                "--batch_size=4", "--threads=2", "--duration=30",
                "--max_consecutive_errors=40", "--report=json"});
  const absl::Duration took = absl::Now() - start;
  EXPECT_NE(run.exit_code, 0) << run.Text();
  EXPECT_LT(took, absl::Seconds(25)) << "did not stop on errors";
  const int64_t errors = JsonNumber(run.Json(), "errors");
  EXPECT_GE(errors, 40) << run.Text();
  // At most one batch per thread beyond the limit.
  EXPECT_LE(errors, 40 + 2 * 4) << run.Text();
  EXPECT_EQ(JsonField(run.Json(), "stopped_on_errors"), "true") << run.Text();
  EXPECT_EQ(run.Count("stopping: "), 1) << run.Text();
  // Each distinct status is printed once as it first occurs, and once with
  // its count at the end; never per request.
  const int first = run.Count("transfer failed: ");
  const int summary = run.Count(" requests failed: ");
  EXPECT_GE(first, 1) << run.Text();
  EXPECT_EQ(first, summary) << run.Text();
  EXPECT_LE(first, 4) << run.Text();
  EXPECT_LT(run.lines.size(), 40u) << run.Text();
}

}  // namespace
}  // namespace ferry
