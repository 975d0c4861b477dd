// The TCP transport against faults that need a second process: a target
// starved of fds by idle connections, a target SIGSTOPped or killed in the
// middle of a large WRITE. The target is tcp_test_peer; the initiator is a
// TcpTransport in this process.
#include <arpa/inet.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/mutex.h"
#include "common/pattern.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"
#include "transport/tcp/tcp_test_util.h"
#include "transport/tcp/tcp_transport.h"

namespace ferry::tcp {
namespace {

using ::ferry::tcp::testing::RecordingSink;

using ::ferry::testing::RunfilePath;
using ::ferry::testing::Subprocess;

struct PeerStats {
  int threads = 0;
  int fds = 0;
  long cpu_ms = 0;
};

class TcpFaultTest : public ::testing::Test {
 protected:
  // Starts the target with `args` and an initiator transport.
  void StartPeer(std::vector<std::string> args) {
    args.insert(args.begin(), RunfilePath("transport/tcp/tcp_test_peer"));
    ASSERT_OK_AND_ASSIGN(peer_, Subprocess::Start(args));
    ASSERT_OK_AND_ASSIGN(std::string ready, peer_->ReadLine(absl::Seconds(30)));
    std::vector<std::string> f = absl::StrSplit(ready, ' ');
    ASSERT_EQ(f.size(), 6u) << ready;
    ASSERT_EQ(f[0], "READY") << ready;
    ASSERT_TRUE(absl::SimpleAtoi(f[1], &port_));
    ASSERT_TRUE(absl::SimpleAtoi(f[2], &remote_));
    ASSERT_TRUE(absl::SimpleAtoi(f[3], &remote_len_));
    uint64_t key = 0, incarnation = 0;
    ASSERT_TRUE(absl::SimpleAtoi(f[4], &key));
    ASSERT_TRUE(absl::SimpleAtoi(f[5], &incarnation));
    descriptor::SegmentDescriptor d;
    d.set_name("peer");
    d.set_incarnation(incarnation);
    auto* t = d.add_transports();
    t->set_transport("tcp");
    t->set_address(absl::StrCat("127.0.0.1:", port_));
    auto* b = d.add_buffers();
    b->set_addr(remote_);
    b->set_length(remote_len_);
    b->set_tcp_key(key);
    ASSERT_OK_AND_ASSIGN(view_, SegmentView::Create(d));
    NewInitiator();
  }

  // Replaces the initiator: what a new client of the target looks like
  // (no connection of its own yet).
  void NewInitiator() {
    if (initiator_ != nullptr) initiator_->Shutdown();
    initiator_ = std::make_unique<TcpTransport>(TransportOptions());
    TransportEnv env;
    env.local_segment = "initiator";
    env.listen_host = "127.0.0.1";
    descriptor::TransportEndpoint ep;
    ASSERT_OK(initiator_->Install(env, &ep));
  }

  void TearDown() override {
    // pid() is -1 once the child was reaped: never kill(-1, ...).
    if (peer_ != nullptr && peer_->pid() > 0) {
      ::kill(peer_->pid(), SIGCONT);
      peer_->Kill();
    }
    if (initiator_ != nullptr) initiator_->Shutdown();
  }

  absl::StatusOr<PeerStats> Stats() {
    auto line = peer_->Ask("stats", absl::Seconds(10));
    if (!line.ok()) return line.status();
    PeerStats s;
    char t[16], f[16], c[16];
    if (std::sscanf(line->c_str(), "%15s %d %15s %d %15s %ld", t, &s.threads, f,
                    &s.fds, c, &s.cpu_ms) != 6) {
      return absl::InternalError(absl::StrCat("bad stats line: ", *line));
    }
    return s;
  }

  // Submits `n` slices of `op` of `len` bytes each, local[i * len] <->
  // remote_ + offset + i * len, with `deadline`, completing into `sink`.
  std::vector<Slice> MakeSlices(OpCode op, uint8_t* local, uint64_t offset,
                                size_t n, size_t len, absl::Time deadline,
                                RecordingSink* sink) {
    std::vector<Slice> slices(n);
    for (size_t i = 0; i < n; ++i) {
      Slice& s = slices[i];
      s.op = op;
      s.local = local + i * len;
      s.remote = remote_ + offset + i * len;
      s.length = len;
      s.target = view_.get();
      s.remote_buffer = 0;  // The target's only buffer.
      s.deadline = deadline;
      s.sink = sink;
    }
    return slices;
  }

  void Submit(std::vector<Slice>& slices) {
    std::vector<Slice*> ptrs;
    for (Slice& s : slices) ptrs.push_back(&s);
    initiator_->Submit(ptrs);
  }

  // One verified round: WRITE a pattern, have the target check it, READ an
  // untouched range and check it here. OK only if everything matched.
  absl::Status VerifiedTransfer(uint64_t seed) {
    constexpr size_t kLen = 256 << 10;
    std::vector<uint8_t> src(kLen), dst(kLen);
    FillPattern(src.data(), kLen, 0, seed);
    RecordingSink sink;
    auto w = MakeSlices(OpCode::kWrite, src.data(), 0, 1, kLen,
                        absl::Now() + absl::Seconds(2), &sink);
    Submit(w);
    auto st = sink.Wait(1, absl::Seconds(5));
    if (st.size() != 1) return absl::InternalError("WRITE never completed");
    if (!st[0].ok()) return st[0];
    auto check = peer_->Ask(absl::StrCat("check 0 ", kLen, " ", seed));
    if (!check.ok()) return check.status();
    if (*check != "OK") return absl::DataLossError("target: " + *check);
    auto r = MakeSlices(OpCode::kRead, dst.data(), kLen, 1, kLen,
                        absl::Now() + absl::Seconds(2), &sink);
    Submit(r);
    st = sink.Wait(2, absl::Seconds(5));
    if (st.size() != 2) return absl::InternalError("READ never completed");
    if (!st[1].ok()) return st[1];
    if (CheckPattern(dst.data(), kLen, kLen, /*seed=*/1) != kLen) {
      return absl::DataLossError("READ returned wrong bytes");
    }
    return absl::OkStatus();
  }

  // VerifiedTransfer until it succeeds, for at most `bound`.
  absl::Status RetryVerifiedTransfer(absl::Duration bound) {
    const absl::Time end = absl::Now() + bound;
    absl::Status last;
    for (uint64_t seed = 1000; absl::Now() < end; ++seed) {
      last = VerifiedTransfer(seed);
      if (last.ok()) return last;
      absl::SleepFor(absl::Milliseconds(50));  // Polling, with a deadline.
    }
    return last;
  }

  // Opens `n` connections to the peer from 20 source addresses
  // (127.0.0.10..29, round robin), so that a cap per address does not
  // bind; non-blocking, as connects beyond the backlog may hang.
  void Attack(int n, std::vector<UniqueFd>* out) {
    for (int i = 0; i < n; ++i) {
      UniqueFd fd(
          ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      ASSERT_TRUE(fd.valid());
      sockaddr_in src{};
      src.sin_family = AF_INET;
      src.sin_addr.s_addr = htonl(0x7f00000a + i % 20);
      ASSERT_EQ(
          ::bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)), 0);
      sockaddr_in dst{};
      dst.sin_family = AF_INET;
      dst.sin_port = htons(port_);
      dst.sin_addr.s_addr = htonl(0x7f000001);
      ::connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), sizeof(dst));
      out->push_back(std::move(fd));
    }
  }

  std::unique_ptr<Subprocess> peer_;
  uint32_t port_ = 0;
  uint64_t remote_ = 0;
  size_t remote_len_ = 0;
  std::shared_ptr<const SegmentView> view_;
  std::unique_ptr<TcpTransport> initiator_;
};

// Issue 9, defect 2: 1,100 idle connections against a target whose fd
// limit is 1,024 (Debian's default). The target must not spin on EMFILE,
// must not grow a thread per connection, and must serve a verified
// transfer soon after the attacker closed its connections.
TEST_F(TcpFaultTest, FdExhaustionDoesNotMakeTargetDeaf) {
  constexpr int kAttack = 1100;
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  if (rl.rlim_cur < kAttack + 200) {
    if (rl.rlim_max < kAttack + 200) GTEST_SKIP() << "fd hard limit too low";
    rl.rlim_cur = rl.rlim_max;  // This test process only.
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
  }
  // The limit comes after the transport started, so that its connection
  // cap (half the limit it saw) does not bind first: descriptors run out
  // as when other parts of the process hold them.
  StartPeer({"--fd_limit=256", "--fd_limit_after_install"});
  ASSERT_OK(VerifiedTransfer(11));
  std::vector<UniqueFd> attack;
  ASSERT_NO_FATAL_FAILURE(Attack(kAttack, &attack));
  // Wait (bounded) until the target ran out of fds.
  const absl::Time fill_end = absl::Now() + absl::Seconds(20);
  PeerStats st;
  do {
    ASSERT_OK_AND_ASSIGN(st, Stats());
  } while (st.fds < 250 && absl::Now() < fill_end);
  EXPECT_GE(st.fds, 250) << "the attack did not exhaust the target's fds";
  // CPU over one second of the exhausted state: a spinning accept loop
  // would burn the whole second.
  ASSERT_OK_AND_ASSIGN(PeerStats before, Stats());
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Seconds(1));  // A measurement window, not ordering.
  ASSERT_OK_AND_ASSIGN(PeerStats after, Stats());
  const double window_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
  EXPECT_LT(after.cpu_ms - before.cpu_ms, window_ms * 0.2)
      << "the target burns CPU while its fds are exhausted";
  EXPECT_LE(after.threads, 16) << "threads grow with connections";
  attack.clear();
  // Serves a new client again by itself, soon.
  NewInitiator();
  const absl::Time start = absl::Now();
  ASSERT_OK(RetryVerifiedTransfer(absl::Seconds(10)))
      << "the target stayed deaf after the attack";
  std::printf(
      "cpu %ld ms in %.0f ms exhausted; threads %d; served again "
      "after %s\n",
      after.cpu_ms - before.cpu_ms, window_ms, after.threads,
      absl::FormatDuration(absl::Now() - start).c_str());
}

// Issue 26, failure 6: connections from many addresses fill every slot
// and stay; a newcomer must still get in, well within the handshake
// timeout that would close the idle ones anyway. The cap (half the fd
// limit) binds before the descriptors run out, and at the cap the
// newcomer takes the slot of a connection from the address that holds
// the most.
TEST_F(TcpFaultTest, ManyAddressesCannotShutOutANewcomer) {
  StartPeer({"--fd_limit=256"});  // A cap of 128 connections.
  ASSERT_OK(VerifiedTransfer(13));
  std::vector<UniqueFd> attack;
  ASSERT_NO_FATAL_FAILURE(Attack(400, &attack));
  // Wait (bounded) until the target holds its cap of them.
  const absl::Time fill_end = absl::Now() + absl::Seconds(5);
  PeerStats st;
  do {
    ASSERT_OK_AND_ASSIGN(st, Stats());
  } while (st.fds < 128 && absl::Now() < fill_end);
  EXPECT_GE(st.fds, 128) << "the attack did not fill the target's slots";
  EXPECT_LT(st.fds, 200) << "the cap did not bind before the fd limit";
  NewInitiator();
  const absl::Time start = absl::Now();
  ASSERT_OK(RetryVerifiedTransfer(absl::Seconds(5)))
      << "shut out while the attack stayed";
  std::printf("served during the attack after %s\n",
              absl::FormatDuration(absl::Now() - start).c_str());
}

// Issue 9, defect 3: a target SIGSTOPped while a large WRITE is on the
// way. sendmsg would block once the socket buffers are full; every slice
// must still end by its deadline plus the documented bound.
TEST_F(TcpFaultTest, StoppedPeerEndsLargeWriteByDeadline) {
  StartPeer({"--buffer_size=134217728"});
  ASSERT_OK(VerifiedTransfer(5));  // The connection is up.
  ASSERT_EQ(::kill(peer_->pid(), SIGSTOP), 0);
  constexpr size_t kSlices = 16, kLen = 4 << 20;
  std::vector<uint8_t> src(kSlices * kLen, 0x5a);
  RecordingSink sink;
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  // Above the ranges VerifiedTransfer uses: a timed-out WRITE may have
  // been applied in part.
  auto w = MakeSlices(OpCode::kWrite, src.data(), 64 << 20, kSlices, kLen,
                      deadline, &sink);
  Submit(w);
  auto st = sink.Wait(kSlices, absl::Seconds(6));
  ASSERT_EQ(st.size(), kSlices) << "slices outlived their deadline by seconds";
  absl::Duration late = absl::ZeroDuration();
  for (absl::Time t : sink.times()) late = std::max(late, t - deadline);
  for (const absl::Status& s : st) {
    EXPECT_STATUS(s, absl::StatusCode::kDeadlineExceeded);
  }
  // Room for a loaded CI machine; far below "seconds".
  EXPECT_LT(late, absl::Seconds(1)) << "completed too late";
  std::printf("latest completion: %s after the deadline\n",
              absl::FormatDuration(late).c_str());
  // Resumed, the target serves again (on a new connection, once the
  // back-off earned by the connection that never answered has passed).
  ASSERT_EQ(::kill(peer_->pid(), SIGCONT), 0);
  EXPECT_OK(RetryVerifiedTransfer(absl::Seconds(10)));
}

// A target killed in the middle of a large WRITE: the slices fail with
// Unavailable at once, not at their deadline.
TEST_F(TcpFaultTest, KilledPeerFailsWriteAtOnce) {
  StartPeer({"--buffer_size=134217728"});
  ASSERT_OK(VerifiedTransfer(6));
  ASSERT_EQ(::kill(peer_->pid(), SIGSTOP), 0);  // The WRITE stays mid-way.
  constexpr size_t kSlices = 16, kLen = 4 << 20;
  std::vector<uint8_t> src(kSlices * kLen, 0xa5);
  RecordingSink sink;
  auto w = MakeSlices(OpCode::kWrite, src.data(), 64 << 20, kSlices, kLen,
                      absl::Now() + absl::Seconds(30), &sink);
  Submit(w);
  const absl::Time killed = absl::Now();
  peer_->Kill();
  auto st = sink.Wait(kSlices, absl::Seconds(10));
  ASSERT_EQ(st.size(), kSlices);
  for (const absl::Status& s : st) {
    EXPECT_STATUS(s, absl::StatusCode::kUnavailable);
  }
  for (absl::Time t : sink.times()) EXPECT_LT(t - killed, absl::Seconds(3));
}

// Issue 9, defect 2: with a thread limit (a container's pids limit), a
// target must neither abort when it cannot create a thread nor need one
// per connection. Run as a user of its own with RLIMIT_NPROC (root is
// exempt).
TEST_F(TcpFaultTest, ThreadLimitNeverAborts) {
  // No thread to spare at all: Install fails cleanly.
  {
    ASSERT_OK_AND_ASSIGN(
        auto peer,
        Subprocess::Start(
            {RunfilePath("transport/tcp/tcp_test_peer"), "--nproc_limit=1"}));
    ASSERT_OK_AND_ASSIGN(std::string line, peer->ReadLine(absl::Seconds(30)));
    if (absl::StartsWith(line, "ERR cannot drop")) {
      GTEST_SKIP() << "no user to drop to here (a sandbox?): " << line;
    }
    EXPECT_TRUE(absl::StartsWith(line, "ERR RESOURCE_EXHAUSTED")) << line;
    ASSERT_OK_AND_ASSIGN(int code, peer->Finish(absl::Seconds(10)));
    EXPECT_EQ(code, 1) << "died instead of failing cleanly";
  }
  // Just enough threads for the transport: 200 connections need none.
  StartPeer({"--nproc_limit=4"});
  std::vector<UniqueFd> conns;
  for (int i = 0; i < 200; ++i) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in src{};
    src.sin_family = AF_INET;
    src.sin_addr.s_addr = htonl(0x7f000040 + i % 10);  // 127.0.0.64..73
    ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&src), sizeof(src)),
              0);
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(port_);
    dst.sin_addr.s_addr = htonl(0x7f000001);
    ASSERT_EQ(
        ::connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), sizeof(dst)), 0);
    conns.push_back(std::move(fd));
  }
  ASSERT_OK(VerifiedTransfer(31));
  ASSERT_OK_AND_ASSIGN(PeerStats st, Stats());
  EXPECT_LE(st.threads, 4);
}

}  // namespace
}  // namespace ferry::tcp
