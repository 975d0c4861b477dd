// Garbage into every port (issue 9, tooling): a real target
// (tools/transfer_bench --mode=target --protocol=rdma,tcp on softrnic) and a
// real standalone tools/metadata_server, then rounds of bounded garbage into
// every port they listen on:
//   - the metadata server's gRPC port and the target engine's gRPC port,
//   - the target's TCP transport port (from its segment descriptor),
//   - the target's softrnic ports (one per soft NIC, from the GIDs in its
//     descriptor: bytes 8-9 carry the listener's port).
// After each round both processes must be alive, still serve a verified
// transfer (an initiator engine per transport in this process) and their
// RPCs, and keep their thread count, RSS and open fds within bounds of
// what they used before the garbage.
//
// The garbage is deterministic (seeded; FERRY_GARBAGE_SEED overrides) and
// bounded: a few connections of a few KiB per port per round, a few hundred
// idle connections in one round, and every socket operation has a timeout.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/pattern.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "metadata/grpc_status.h"
#include "metadata/metadata_client.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "testing/process_usage.h"
#include "testing/subprocess.h"
#include "tools/tool_test_util.h"

namespace ferry {
namespace {

using ::ferry::testing::ProcessAlive;
using ::ferry::testing::ProcessUsage;
using ::ferry::testing::ReadProcessUsage;
using ::ferry::testing::RunfilePath;
using ::ferry::testing::StartTool;
using ::ferry::testing::Subprocess;
using ::ferry::testing::WaitForLine;

// Debian's default, as in the reproductions.
constexpr int kFdLimit = 1024;
constexpr uint64_t kTargetBuffer = 16 << 20;
// Verified transfers use the lower half of the target's buffer; garbage
// that is allowed to write (a well-formed WRITE cut short) uses the upper.
constexpr uint64_t kCheckBytes = 1 << 20;
constexpr int kConnsPerPortPerKind = 4;
constexpr int kIdlePerPort = 60;
constexpr absl::Duration kIoTimeout = absl::Seconds(2);
constexpr absl::Duration kTransferWait = absl::Seconds(15);
constexpr absl::Duration kFdSettle = absl::Seconds(10);
// The whole test, garbage and checks, must end within this.
constexpr absl::Duration kTestBudget = absl::Minutes(3);
// Bounds over the usage measured before any garbage.
constexpr int kThreadSlack = 16;
// RSS may not grow past this over the baseline at any check. A tighter
// bound after the garbage is not meaningful: the allocator keeps what one
// large hostile request made it allocate (a PutSegment of 1M buffers, an
// 11 MB message, was measured to raise metadata_server's RSS by 120-200
// MB each time, not growing with repetition).
constexpr int64_t kRssCeilingKb = 256 << 10;
constexpr int kFdSlack = 32;

// Wire constants, restated from the protocols' headers (tcp/wire.h,
// softrnic/wire.h) on purpose: the test speaks the documented wire format,
// not whatever the code under test encodes.
constexpr uint32_t kTcpMagic = 0x46525259;  // "FRRY"
constexpr uint8_t kTcpWrite = 1, kTcpRead = 2;
constexpr uint32_t kSrncMagic = 0x53524e43;  // "SRNC"
constexpr uint8_t kSrncHello = 1, kSrncWrite = 12, kSrncRead = 14;

enum class PortKind { kGrpc, kTcpTransport, kSoftrnic };

struct Port {
  std::string name;
  HostPort addr;
  PortKind kind;
};

class Bytes {
 public:
  Bytes& U8(uint8_t v) {
    s_.push_back(static_cast<char>(v));
    return *this;
  }
  Bytes& U16(uint16_t v) { return U8(v >> 8).U8(v & 0xff); }
  Bytes& U24(uint32_t v) { return U8((v >> 16) & 0xff).U16(v & 0xffff); }
  Bytes& U32(uint32_t v) { return U16(v >> 16).U16(v & 0xffff); }
  Bytes& U64(uint64_t v) { return U32(v >> 32).U32(v & 0xffffffffu); }
  Bytes& Str(const std::string& v) {
    s_ += v;
    return *this;
  }
  const std::string& str() const { return s_; }

 private:
  std::string s_;
};

std::string TcpRequest(uint8_t op, uint64_t id, uint64_t addr, uint64_t len,
                       uint8_t version = 1) {
  return Bytes()
      .U32(kTcpMagic)
      .U8(version)
      .U8(op)
      .U16(0)
      .U64(id)
      .U64(addr)
      .U64(len)
      .str();
}

std::string SrncFrame(uint8_t type, uint32_t qpn, uint32_t msn, uint32_t len,
                      uint32_t rkey, uint64_t addr, uint32_t aux = 0) {
  return Bytes()
      .U32(kSrncMagic)
      .U8(1)
      .U8(type)
      .U16(0)
      .U32(qpn)
      .U32(msn)
      .U32(len)
      .U32(rkey)
      .U64(addr)
      .U32(0)
      .U32(aux)
      .str();
}

// HTTP/2 frame: 24-bit length, type, flags, stream.
std::string H2Frame(uint8_t type, uint8_t flags, uint32_t stream,
                    const std::string& payload, int64_t claimed_len = -1) {
  return Bytes()
      .U24(claimed_len >= 0 ? static_cast<uint32_t>(claimed_len)
                            : static_cast<uint32_t>(payload.size()))
      .U8(type)
      .U8(flags)
      .U32(stream)
      .Str(payload)
      .str();
}

// A HEADERS block (HPACK, literals without indexing) of a real gRPC call,
// so the server starts a handler for it.
std::string GrpcRequestHeaders() {
  auto lit = [](uint8_t name_index, const std::string& v) {
    return Bytes().U8(name_index).U8(v.size()).Str(v).str();
  };
  return Bytes()
      .U8(0x83)  // :method POST
      .U8(0x86)  // :scheme http
      .Str(lit(0x04, "/ferry.metadata.MetadataService/ListSegments"))
      .Str(lit(0x01, "garbage"))  // :authority
      .U8(0x0f)
      .U8(0x10)  // content-type (static index 31)
      .U8(16)
      .Str("application/grpc")
      .U8(0x00)
      .U8(2)
      .Str("te")
      .U8(8)
      .Str("trailers")
      .str();
}

constexpr uint8_t kH2Data = 0, kH2Headers = 1, kH2RstStream = 3,
                  kH2Settings = 4, kH2Ping = 6, kH2WindowUpdate = 8,
                  kH2Continuation = 9;
constexpr uint8_t kEndHeaders = 0x4;

// One garbage connection: what to send, and whether to linger reading the
// answer (so the server gets to process it) before closing.
struct Shot {
  std::string bytes;
  bool linger = true;
};

// Garbage comes from its own address, as from another host: per-peer caps
// may then refuse it without refusing the test's initiators (127.0.0.1).
constexpr char kGarbageSource[] = "127.0.0.9";

UniqueFd Connect(const HostPort& to) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  sockaddr_in src{};
  src.sin_family = AF_INET;
  inet_pton(AF_INET, kGarbageSource, &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(to.port);
  if (!fd.valid() || inet_pton(AF_INET, to.host.c_str(), &dst.sin_addr) != 1 ||
      bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0) {
    return UniqueFd();
  }
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) != 0) {
    if (errno != EINPROGRESS) return UniqueFd();
    pollfd p{fd.get(), POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(kIoTimeout))) <=
            0 ||
        getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 ||
        err != 0) {
      return UniqueFd();
    }
  }
  timeval tv{static_cast<time_t>(absl::ToInt64Seconds(kIoTimeout)), 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  // Sends block (bounded by SO_SNDTIMEO) so big shots are not cut short by
  // a full buffer.
  fcntl(fd.get(), F_SETFL, fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
  return fd;
}

// Sends `shot` on a new connection; reads what comes back for a moment
// (bounded), then closes. Failures to connect or send are part of the game
// (a server may refuse or reset), so they are only counted, as is what the
// server did: closed the connection, answered, or neither.
struct ShotResult {
  int refused = 0;  // Could not connect.
  int closed = 0;   // The server closed or reset the connection.
  int answered = 0;
  int silent = 0;  // Still open, nothing said, when the shot gave up.
};

void Fire(const Port& port, const Shot& shot, ShotResult* r) {
  UniqueFd fd = Connect(port.addr);
  if (!fd.valid()) {
    ++r->refused;
    return;
  }
  size_t off = 0;
  const absl::Time deadline = absl::Now() + kIoTimeout;
  while (off < shot.bytes.size() && absl::Now() < deadline) {
    ssize_t n = send(fd.get(), shot.bytes.data() + off, shot.bytes.size() - off,
                     MSG_NOSIGNAL);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  if (!shot.linger) return;
  // Read until the server closes or goes quiet, so it has handled the
  // shot before the connection goes away.
  char buf[4096];
  bool answered = false;
  const absl::Time read_until = absl::Now() + absl::Milliseconds(300);
  while (true) {
    const absl::Duration left = read_until - absl::Now();
    pollfd p{fd.get(), POLLIN, 0};
    if (left <= absl::ZeroDuration() ||
        poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <=
            0) {
      ++(answered ? r->answered : r->silent);
      return;
    }
    if (recv(fd.get(), buf, sizeof(buf), MSG_DONTWAIT) <= 0) {
      ++r->closed;
      return;
    }
    answered = true;
  }
}

// The segment's buffer, where well-formed garbage may write.
struct TargetInfo {
  uint64_t buffer_addr = 0;
  uint64_t buffer_len = 0;
};

class GarbageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* seed = std::getenv("FERRY_GARBAGE_SEED");
    seed_ = seed != nullptr ? std::strtoull(seed, nullptr, 0) : 20261203;
    rng_.seed(seed_);
    std::printf("garbage seed %llu (FERRY_GARBAGE_SEED to repeat)\n",
                static_cast<unsigned long long>(seed_));
    test_deadline_ = absl::Now() + kTestBudget;

    ASSERT_OK_AND_ASSIGN(md_, StartTool({RunfilePath("tools/metadata_server"),
                                         "--listen=127.0.0.1:0"},
                                        kFdLimit));
    ASSERT_OK_AND_ASSIGN(md_addr_, WaitForLine(*md_,
                                               "metadata_server "
                                               "listening on ",
                                               absl::Seconds(30)));
    ASSERT_OK_AND_ASSIGN(
        target_,
        StartTool({RunfilePath("tools/transfer_bench"), "--mode=target",
                   "--segment_id=garbage_target", "--protocol=rdma,tcp",
                   absl::StrCat("--metadata_server=", md_addr_),
                   absl::StrCat("--buffer_size=", kTargetBuffer)},
                  kFdLimit));
    ASSERT_OK(WaitForLine(*target_, "target ready:", absl::Seconds(30)));
    ASSERT_NO_FATAL_FAILURE(FindPorts());

    for (const std::string transport : {"tcp", "rdma"}) {
      auto& i = initiators_.emplace_back();
      i.transport = transport;
      EngineOptions o;
      o.local_segment_name = absl::StrCat("garbage_initiator_", transport);
      o.metadata_endpoint = md_addr_;
      o.transports = {transport};
      o.transfer_timeout = absl::Seconds(5);
      i.engine = std::make_unique<TransferEngine>();
      ASSERT_OK(i.engine->Init(o));
      i.local.reset(new uint8_t[2 * kCheckBytes]);
      ASSERT_OK(i.engine->RegisterLocalMemory(i.local.get(), 2 * kCheckBytes,
                                              "cpu:0", false));
      ASSERT_OK_AND_ASSIGN(i.seg, i.engine->OpenSegment("garbage_target"));
    }
    // Warm up every path once, then take the usage baseline.
    CheckServing("before any garbage", /*check_bounds=*/false);
    ASSERT_FALSE(HasFailure());
    ASSERT_OK_AND_ASSIGN(md_base_, ReadProcessUsage(md_->pid()));
    ASSERT_OK_AND_ASSIGN(target_base_, ReadProcessUsage(target_->pid()));
    std::printf(
        "baseline: metadata_server %d threads %lld KiB %d fds; target %d "
        "threads %lld KiB %d fds\n",
        md_base_.threads, static_cast<long long>(md_base_.rss_kb),
        md_base_.open_fds, target_base_.threads,
        static_cast<long long>(target_base_.rss_kb), target_base_.open_fds);
  }

  void TearDown() override {
    for (auto& i : initiators_) {
      if (i.engine != nullptr) i.engine->Shutdown();
    }
  }

  void FindPorts() {
    metadata::MetadataClient client(md_addr_, absl::Seconds(3));
    ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor d,
                         client.Get("garbage_target"));
    ASSERT_GT(d.buffers_size(), 0);
    info_.buffer_addr = d.buffers(0).addr();
    info_.buffer_len = d.buffers(0).length();
    ASSERT_OK_AND_ASSIGN(HostPort md, ParseHostPort(md_addr_));
    ports_.push_back({"metadata_server gRPC", md, PortKind::kGrpc});
    ASSERT_OK_AND_ASSIGN(HostPort rpc, ParseHostPort(d.rpc_address()));
    target_rpc_ = d.rpc_address();
    ports_.push_back({"target gRPC", rpc, PortKind::kGrpc});
    for (const auto& t : d.transports()) {
      if (t.transport() == "tcp") {
        ASSERT_OK_AND_ASSIGN(HostPort tcp, ParseHostPort(t.address()));
        ports_.push_back(
            {"target TCP transport", tcp, PortKind::kTcpTransport});
      }
      if (t.transport() == "rdma") {
        for (const auto& dev : t.devices()) {
          ASSERT_EQ(dev.gid().size(), 16u);
          const auto* g = reinterpret_cast<const uint8_t*>(dev.gid().data());
          char ip[INET_ADDRSTRLEN];
          inet_ntop(AF_INET, g + 12, ip, sizeof(ip));
          HostPort hp{ip, static_cast<uint16_t>((g[8] << 8) | g[9])};
          ports_.push_back({absl::StrCat("target softrnic ", dev.name()), hp,
                            PortKind::kSoftrnic});
        }
      }
    }
    std::string list;
    for (const Port& p : ports_) {
      absl::StrAppend(&list, "\n  ", p.name, " ", p.addr.ToString());
    }
    std::printf("ports under test:%s\n", list.c_str());
    // gRPC x2, TCP, and one softrnic port per soft NIC.
    ASSERT_GE(ports_.size(), 4u) << list;
  }

  // The checks after every round. Non-fatal, so one round reports every
  // way it broke; the caller stops when a process is gone.
  void CheckServing(const std::string& when, bool check_bounds = true) {
    SCOPED_TRACE(when);
    const bool md_alive = ProcessAlive(md_->pid());
    const bool target_alive = ProcessAlive(target_->pid());
    EXPECT_TRUE(md_alive) << "metadata_server died " << when;
    EXPECT_TRUE(target_alive) << "target died " << when;
    if (!md_alive || !target_alive) return;
    for (auto& i : initiators_) {
      // A path that failed once is reported once: waiting on it again in
      // every round would only spend the time budget.
      if (i.broken) continue;
      absl::Status s = VerifiedTransfer(i);
      EXPECT_OK(s) << "over " << i.transport << " " << when
                   << " (not checked again)";
      i.broken = !s.ok();
    }
    metadata::MetadataClient client(md_addr_, absl::Seconds(3));
    EXPECT_OK(client.Get("garbage_target")) << "metadata_server RPC " << when;
    EXPECT_OK(PeerServiceAnswers()) << "target gRPC " << when;
    if (!check_bounds) return;
    CheckUsage("metadata_server", md_->pid(), md_base_);
    CheckUsage("target", target_->pid(), target_base_);
  }

  void CheckUsage(const std::string& who, pid_t pid, const ProcessUsage& base) {
    auto u = ReadProcessUsage(pid);
    ASSERT_OK(u);
    EXPECT_LE(u->threads, base.threads + kThreadSlack)
        << who << " threads: " << base.threads
        << " before the garbage; now: " << testing::DescribeThreads(pid);
    EXPECT_LE(u->rss_kb, base.rss_kb + kRssCeilingKb)
        << who << " RSS (KiB): " << base.rss_kb << " before the garbage";
    std::printf("  %s: %d threads, %lld KiB, %d fds\n", who.c_str(), u->threads,
                static_cast<long long>(u->rss_kb), u->open_fds);
  }

  // After a round's connections are closed the servers must give their fds
  // back (bounded wait: some close on a timeout of their own).
  void CheckFdsSettle(const std::string& who, pid_t pid,
                      const ProcessUsage& base) {
    // Once a process kept its fds it keeps them: look, but do not wait.
    const absl::Time deadline =
        fds_kept_.count(who) > 0 ? absl::Now() : absl::Now() + kFdSettle;
    int fds = 0;
    while (true) {
      auto u = ReadProcessUsage(pid);
      if (!u.ok()) return;  // Death is reported by CheckServing.
      fds = u->open_fds;
      if (fds <= base.open_fds + kFdSlack || absl::Now() >= deadline) break;
      absl::SleepFor(absl::Milliseconds(100));  // Poll pace, not ordering.
    }
    EXPECT_LE(fds, base.open_fds + kFdSlack)
        << who << " kept its fds " << absl::FormatDuration(kFdSettle)
        << " after the clients left (" << base.open_fds
        << " before); now: " << testing::DescribeFds(pid);
    if (fds > base.open_fds + kFdSlack) fds_kept_.insert(who);
  }

  struct Initiator {
    std::string transport;
    std::unique_ptr<TransferEngine> engine;
    std::unique_ptr<uint8_t[]> local;
    SegmentHandle seg = 0;
    uint64_t checks = 0;
    bool broken = false;
  };

  absl::Status RunOne(Initiator& i, OpCode op, uint8_t* local,
                      uint64_t remote) {
    auto batch = i.engine->AllocateBatch(1);
    if (!batch.ok()) return batch.status();
    TransferRequest r;
    r.opcode = op;
    r.source = local;
    r.target_id = i.seg;
    r.target_offset = remote;
    r.length = kCheckBytes;
    if (absl::Status s = i.engine->SubmitTransfer(*batch, {r}); !s.ok()) {
      return s;
    }
    auto st = i.engine->WaitBatch(*batch, kTransferWait);
    if (!st.ok()) return st.status();
    i.engine->FreeBatch(*batch).IgnoreError();
    if (st->state != TransferState::kCompleted) {
      return absl::Status(st->first_error.ok() ? absl::StatusCode::kUnknown
                                               : st->first_error.code(),
                          absl::StrCat(TransferStateName(st->state), ": ",
                                       st->first_error.message()));
    }
    return absl::OkStatus();
  }

  // WRITE a fresh pattern, READ it back into zeroed memory, compare.
  absl::Status VerifiedTransfer(Initiator& i) {
    const uint64_t seed = Mix64(seed_ ^ (++i.checks << 8) ^ i.transport[0]);
    // Each initiator has its own slice of the checked half.
    const uint64_t remote =
        info_.buffer_addr + (i.transport == "tcp" ? 0 : 2 * kCheckBytes);
    uint8_t* out = i.local.get();
    uint8_t* back = i.local.get() + kCheckBytes;
    FillPattern(out, kCheckBytes, 0, seed);
    if (absl::Status s = RunOne(i, OpCode::kWrite, out, remote); !s.ok()) {
      return s;
    }
    std::memset(back, 0, kCheckBytes);
    if (absl::Status s = RunOne(i, OpCode::kRead, back, remote); !s.ok()) {
      return s;
    }
    const size_t bad = CheckPattern(back, kCheckBytes, 0, seed);
    if (bad != kCheckBytes) {
      return absl::DataLossError(
          absl::StrCat("READ back differs from the WRITE at byte ", bad));
    }
    return absl::OkStatus();
  }

  // Any answer from the target's peer service on a fresh connection (an
  // unknown transport is an error, but an answered one).
  absl::Status PeerServiceAnswers() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = metadata::PeerService::NewStub(grpc::CreateCustomChannel(
        target_rpc_, grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(3));
    metadata::ExchangeRequest req;
    req.set_transport("garbage-test-probe");
    req.set_from_segment("garbage_test");
    metadata::ExchangeResponse resp;
    grpc::Status s = stub->Exchange(&ctx, req, &resp);
    // An unregistered sender is refused, at once or (as read just before)
    // with "try again": both are answers.
    if (metadata::IsRetryLater(metadata::FromGrpcStatus(s, "Exchange"))) {
      return absl::OkStatus();
    }
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::UnavailableError(s.error_message());
    }
    return absl::OkStatus();
  }

  std::string Random(size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng_() & 0xff);
    return s;
  }

  // The shots of one round for one port.
  using Round = std::function<std::vector<Shot>(const Port&)>;

  void RunRound(const std::string& name, const Round& round) {
    SCOPED_TRACE(name);
    ASSERT_LT(absl::Now(), test_deadline_) << "out of time budget";
    const absl::Time start = absl::Now();
    std::string outcome;
    for (const Port& p : ports_) {
      ShotResult r;
      for (const Shot& s : round(p)) Fire(p, s, &r);
      absl::StrAppend(&outcome, "\n  ", p.name, ": ", r.closed, " closed, ",
                      r.answered, " answered and kept, ", r.silent,
                      " kept silently, ", r.refused, " refused");
    }
    std::printf("round %s (%.1f s):%s\n", name.c_str(),
                absl::ToDoubleSeconds(absl::Now() - start), outcome.c_str());
    CheckServing(absl::StrCat("after round ", name));
    CheckFdsSettle("metadata_server", md_->pid(), md_base_);
    CheckFdsSettle("target", target_->pid(), target_base_);
  }

  bool BothAlive() {
    return ProcessAlive(md_->pid()) && ProcessAlive(target_->pid());
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  absl::Time test_deadline_;
  std::unique_ptr<Subprocess> md_;
  std::unique_ptr<Subprocess> target_;
  std::string md_addr_;
  std::string target_rpc_;
  TargetInfo info_;
  std::vector<Port> ports_;
  std::vector<Initiator> initiators_;
  ProcessUsage md_base_;
  ProcessUsage target_base_;
  std::set<std::string> fds_kept_;
};

TEST_F(GarbageTest, EveryPortKeepsServingThroughGarbage) {
  // Addresses well-formed garbage may name: in the target's buffer (upper
  // half), and outside any registered memory.
  const uint64_t inside = info_.buffer_addr + info_.buffer_len / 2;
  const uint64_t outside = 0x1000;

  RunRound("random bytes", [&](const Port&) {
    std::vector<Shot> v;
    for (int i = 0; i < kConnsPerPortPerKind; ++i) {
      v.push_back({Random(1024 + (rng_() % 16384)), true});
    }
    return v;
  });
  if (!BothAlive()) return;

  // The right magic and a valid-looking header, then random bytes.
  RunRound("valid prefix, random rest", [&](const Port& p) {
    std::vector<Shot> v;
    for (int i = 0; i < kConnsPerPortPerKind; ++i) {
      std::string prefix;
      switch (p.kind) {
        case PortKind::kGrpc:
          prefix = testing::Http2ClientPreface();
          break;
        case PortKind::kTcpTransport:
          prefix = Bytes().U32(kTcpMagic).U8(1).str();
          break;
        case PortKind::kSoftrnic:
          prefix = Bytes().U32(kSrncMagic).U8(1).str();
          break;
      }
      v.push_back({prefix + Random(64 + (rng_() % 4096)), true});
    }
    return v;
  });
  if (!BothAlive()) return;

  RunRound("absurd lengths", [&](const Port& p) {
    std::vector<Shot> v;
    switch (p.kind) {
      case PortKind::kGrpc:
        // A frame far above the peer's max frame size; a gRPC message
        // prefix claiming 4 GiB; a window update overflowing the window.
        v.push_back(
            {testing::Http2ClientPreface() +
             H2Frame(kH2Headers, kEndHeaders, 1, Random(64), 0xffffff)});
        v.push_back(
            {testing::Http2ClientPreface() +
             H2Frame(kH2Headers, kEndHeaders, 1, GrpcRequestHeaders()) +
             H2Frame(kH2Data, 0, 1,
                     Bytes().U8(0).U32(0xffffffffu).Str(Random(100)).str())});
        v.push_back(
            {testing::Http2ClientPreface() +
             H2Frame(kH2WindowUpdate, 0, 0, Bytes().U32(0x7fffffff).str()) +
             H2Frame(kH2WindowUpdate, 0, 0, Bytes().U32(0x7fffffff).str())});
        v.push_back({testing::Http2ClientPreface() +
                     H2Frame(kH2Settings, 0, 0, Random(6), 6 * 100000)});
        break;
      case PortKind::kTcpTransport:
        for (uint64_t len : {(64ull << 20) + 1, 1ull << 40, ~0ull}) {
          v.push_back(
              {TcpRequest(kTcpWrite, rng_(), inside, len) + Random(4096)});
          v.push_back({TcpRequest(kTcpRead, rng_(), inside, len)});
        }
        v.push_back({TcpRequest(kTcpRead, 1, ~0ull - 10, 4096)});
        break;
      case PortKind::kSoftrnic:
        for (uint32_t len : {0xffffffffu, 0x80000000u, (64u << 20) + 1}) {
          v.push_back({SrncFrame(kSrncHello, 1, 0, 0, 0, 0, 1) +
                       SrncFrame(kSrncWrite, 1, 0, len, 0x1234, inside) +
                       Random(4096)});
          v.push_back({SrncFrame(kSrncWrite, rng_(), 0, len, rng_(), inside) +
                       Random(1024)});
          v.push_back({SrncFrame(kSrncRead, rng_(), 0, len, rng_(), outside)});
        }
        break;
    }
    return v;
  });
  if (!BothAlive()) return;

  // Headers cut short, and frames whose announced payload never fully
  // arrives: the connection closes mid-frame.
  RunRound("truncated and cut mid-frame", [&](const Port& p) {
    std::vector<Shot> v;
    switch (p.kind) {
      case PortKind::kGrpc: {
        const std::string full = testing::Http2ClientPreface();
        v.push_back({full.substr(0, 10), false});
        v.push_back(
            {full + H2Frame(kH2Headers, kEndHeaders, 1, GrpcRequestHeaders())
                        .substr(0, 5),
             false});
        v.push_back(
            {full + H2Frame(kH2Headers, kEndHeaders, 1, GrpcRequestHeaders()) +
                 H2Frame(kH2Data, 0, 1, Bytes().U8(0).U32(1000).Str("x").str(),
                         1005),
             false});
        break;
      }
      case PortKind::kTcpTransport: {
        const std::string h = TcpRequest(kTcpWrite, 7, inside, 1 << 20);
        v.push_back({h.substr(0, 17), false});
        v.push_back({h + Random(100000), false});  // 1 MiB announced.
        v.push_back({TcpRequest(kTcpRead, 8, inside, 4 << 20), false});
        break;
      }
      case PortKind::kSoftrnic: {
        const std::string hello = SrncFrame(kSrncHello, 1, 0, 0, 0, 0, 1);
        v.push_back({hello.substr(0, 20), false});
        v.push_back({hello +
                         SrncFrame(kSrncWrite, 1, 0, 1 << 20, 0x1234, inside) +
                         Random(50000),
                     false});
        v.push_back({SrncFrame(kSrncRead, 1, 0, 1 << 20, 0, inside), false});
        break;
      }
    }
    return v;
  });
  if (!BothAlive()) return;

  // Protocol abuse on gRPC: rapid reset (CVE-2023-44487), a CONTINUATION
  // flood, a PING flood; on the data ports, a stream of well-formed
  // requests that all fail validation.
  RunRound("floods of small frames", [&](const Port& p) {
    std::vector<Shot> v;
    switch (p.kind) {
      case PortKind::kGrpc: {
        std::string reset = testing::Http2ClientPreface();
        for (uint32_t s = 1; s < 2 * 300; s += 2) {
          reset += H2Frame(kH2Headers, kEndHeaders, s, GrpcRequestHeaders());
          reset += H2Frame(kH2RstStream, 0, s, Bytes().U32(8).str());
        }
        v.push_back({reset});
        std::string cont =
            testing::Http2ClientPreface() + H2Frame(kH2Headers, 0, 1, "");
        for (int i = 0; i < 2000; ++i) {
          cont += H2Frame(kH2Continuation, 0, 1, Random(512));
        }
        v.push_back({cont});
        std::string ping = testing::Http2ClientPreface();
        for (int i = 0; i < 2000; ++i)
          ping += H2Frame(kH2Ping, 0, 0, Random(8));
        v.push_back({ping});
        break;
      }
      case PortKind::kTcpTransport: {
        std::string s;
        for (int i = 0; i < 2000; ++i) s += TcpRequest(kTcpRead, i, outside, 8);
        v.push_back({s});
        std::string bad_version;
        for (int i = 0; i < 100; ++i) {
          bad_version += TcpRequest(kTcpRead, i, inside, 8, /*version=*/9);
        }
        v.push_back({bad_version});
        break;
      }
      case PortKind::kSoftrnic: {
        std::string s;
        for (uint32_t i = 0; i < 2000; ++i) {
          s += SrncFrame(kSrncHello, i, 0, 0, 0, 0, i);
        }
        v.push_back({s});
        std::string reads = SrncFrame(kSrncHello, 1, 0, 0, 0, 0, 1);
        for (uint32_t i = 0; i < 2000; ++i) {
          reads += SrncFrame(kSrncRead, 1, i, 8, rng_(), outside);
        }
        v.push_back({reads});
        break;
      }
    }
    return v;
  });
  if (!BothAlive()) return;

  // Well-formed RPCs with hostile contents: each must be refused with an
  // error, and nothing else may change (the target's entry stays).
  {
    SCOPED_TRACE("hostile RPCs");
    ASSERT_LT(absl::Now(), test_deadline_) << "out of time budget";
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxSendMessageSize(64 << 20);
    auto md = metadata::MetadataService::NewStub(grpc::CreateCustomChannel(
        md_addr_, grpc::InsecureChannelCredentials(), args));
    auto peer = metadata::PeerService::NewStub(grpc::CreateCustomChannel(
        target_rpc_, grpc::InsecureChannelCredentials(), args));
    auto ctx = [] {
      auto c = std::make_unique<grpc::ClientContext>();
      c->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(5));
      return c;
    };
    auto valid = [&] {
      descriptor::SegmentDescriptor d;
      d.set_name("hostile");
      d.set_incarnation(1);
      d.set_rpc_address("127.0.0.1:1");
      auto* b = d.add_buffers();
      b->set_addr(1 << 20);
      b->set_length(4096);
      b->set_location("cpu:0");
      return d;
    };
    std::vector<std::pair<std::string, descriptor::SegmentDescriptor>> bad;
    bad.push_back({"empty name", valid()});
    bad.back().second.set_name("");
    bad.push_back({"name with a space", valid()});
    bad.back().second.set_name("a b");
    bad.push_back({"name of 100 KiB", valid()});
    bad.back().second.set_name(std::string(100 << 10, 'n'));
    bad.push_back({"zero-length buffer", valid()});
    bad.back().second.mutable_buffers(0)->set_length(0);
    bad.push_back({"buffer wrapping the address space", valid()});
    bad.back().second.mutable_buffers(0)->set_addr(~0ull - 10);
    bad.push_back({"overlapping buffers", valid()});
    *bad.back().second.add_buffers() = bad.back().second.buffers(0);
    bad.push_back({"too many transports", valid()});
    for (int i = 0; i < 100; ++i) {
      bad.back().second.add_transports()->set_transport("tcp");
    }
    bad.push_back({"gid of 3 bytes", valid()});
    {
      auto* t = bad.back().second.add_transports();
      t->set_transport("rdma");
      t->add_devices()->set_gid("abc");
    }
    // Over the limit of 65536 buffers, in a 3 MB message.
    bad.push_back({"300000 buffers", valid()});
    for (int i = 1; i < 300000; ++i) {
      auto* b = bad.back().second.add_buffers();
      b->set_addr((2ull << 20) + static_cast<uint64_t>(i) * 8192);
      b->set_length(4096);
    }
    for (const auto& [what, d] : bad) {
      metadata::PutSegmentRequest req;
      *req.mutable_segment() = d;
      metadata::PutSegmentResponse resp;
      grpc::Status st = md->PutSegment(ctx().get(), req, &resp);
      EXPECT_FALSE(st.ok()) << "PutSegment with " << what << " was accepted";
      EXPECT_NE(st.error_code(), grpc::StatusCode::UNAVAILABLE) << what;
      EXPECT_NE(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << what;
    }
    {
      metadata::UpdateBuffersRequest req;
      req.set_name("garbage_target");
      req.set_incarnation(12345);  // Not the target's.
      auto* b = req.add_add();
      b->set_addr(1 << 20);
      b->set_length(4096);
      metadata::UpdateBuffersResponse resp;
      EXPECT_FALSE(md->UpdateBuffers(ctx().get(), req, &resp).ok())
          << "another incarnation changed the target's buffers";
      metadata::RemoveSegmentRequest rm;
      rm.set_name("garbage_target");
      rm.set_incarnation(12345);
      metadata::RemoveSegmentResponse rm_resp;
      md->RemoveSegment(ctx().get(), rm, &rm_resp).error_code();
    }
    {
      metadata::ExchangeRequest req;
      req.set_transport("rdma");
      req.set_from_segment("hostile");
      req.set_payload(std::string((1 << 20) + 1, 'x'));
      metadata::ExchangeResponse resp;
      EXPECT_FALSE(peer->Exchange(ctx().get(), req, &resp).ok())
          << "an oversized handshake payload was accepted";
      req.set_payload(Random(200));  // Not a handshake message.
      EXPECT_FALSE(peer->Exchange(ctx().get(), req, &resp).ok())
          << "a random handshake payload was accepted";
      metadata::NotifyRequest n;
      n.set_from_segment("hostile");
      n.set_name(std::string(300, 'n'));
      n.set_message("m");
      metadata::NotifyResponse n_resp;
      EXPECT_FALSE(peer->Notify(ctx().get(), n, &n_resp).ok())
          << "a notification name of 300 bytes was accepted";
      n.set_name("n");
      n.set_message(std::string((64 << 10) + 1, 'm'));
      EXPECT_FALSE(peer->Notify(ctx().get(), n, &n_resp).ok())
          << "a notification of 64 KiB + 1 was accepted";
    }
    CheckServing("after hostile RPCs");
  }
  if (!BothAlive()) return;

  // Hundreds of connections held open and silent (some after a valid
  // start), checked while they are held, then released.
  {
    SCOPED_TRACE("idle connections");
    ASSERT_LT(absl::Now(), test_deadline_) << "out of time budget";
    std::vector<UniqueFd> idle;
    int refused = 0;
    for (const Port& p : ports_) {
      for (int i = 0; i < kIdlePerPort; ++i) {
        UniqueFd fd = Connect(p.addr);
        if (!fd.valid()) {
          ++refused;
          continue;
        }
        if (i % 3 == 1 && p.kind == PortKind::kGrpc) {
          const std::string pre = testing::Http2ClientPreface();
          (void)send(fd.get(), pre.data(), pre.size(), MSG_NOSIGNAL);
        }
        idle.push_back(std::move(fd));
      }
    }
    std::printf("idle: %zu connections held, %d refused\n", idle.size(),
                refused);
    CheckServing("while hundreds of idle connections are held");
    idle.clear();
    CheckServing("after the idle connections left");
    CheckFdsSettle("metadata_server", md_->pid(), md_base_);
    CheckFdsSettle("target", target_->pid(), target_base_);
  }
  for (const auto& [who, pid] : {std::make_pair("metadata_server", md_->pid()),
                                 std::make_pair("target", target_->pid())}) {
    auto u = ReadProcessUsage(pid);
    ASSERT_OK(u);
    std::printf("%s at the end: %d threads, %lld KiB, %d fds\n", who,
                u->threads, static_cast<long long>(u->rss_kb), u->open_fds);
  }
}

}  // namespace
}  // namespace ferry
