// Two-process tests for softrnic: this test process and verbs_peer (a
// separate process on its own softrnic instance, with its own TCP listener
// per device) connect RC QPs and exchange data; the peer is killed to check
// that a vanished peer ends requests in IBV_WC_RETRY_EXC_ERR within a
// bounded time; garbage on the peer's listener must not disturb it; and the
// device configuration from FERRY_SOFTRNIC_DEVICES (and its default) is
// checked in a fresh process.
#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "testing/process_usage.h"
#include "testing/subprocess.h"
#include "transport/softrnic/softrnic_control.h"
#include "transport/softrnic/verbs_test_util.h"

namespace softrnic_test {
namespace {

using ferry::testing::RunfilePath;
using ferry::testing::Subprocess;

constexpr size_t kPeerBuffer = 1 << 20;

// How many of `fds` the other end has closed once `want` of them are, or
// `timeout_ms` passed.
int CountClosedByPeer(const std::vector<int>& fds, int want, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<bool> closed(fds.size(), false);
  int n = 0;
  while (true) {
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!closed[i] && ClosedByPeer(fds[i], 0)) {
        closed[i] = true;
        ++n;
      }
    }
    if (n >= want || Clock::now() >= deadline) {
      return n;
    }
    usleep(10000);
  }
}

std::string Hex64(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(v));
  return buf;
}

struct PeerQp {
  uint32_t qpn = 0;
  ibv_gid gid = {};
  uint64_t addr = 0;
  uint32_t rkey = 0;
};

class TwoProcessTest : public ::testing::Test {
 protected:
  void SetUp() override { signal(SIGPIPE, SIG_IGN); }

  // Destroys the local and the peer's QP (to connect a fresh pair).
  void Disconnect() {
    local_.reset();
    buf_ = nullptr;
    if (ctx_ != nullptr) ibv_close_device(ctx_);
    ctx_ = nullptr;
    ASSERT_EQ(Ask("close").size(), 0u);
  }

  void TearDown() override {
    if (link_down_) softrnic::SetLink("softrnic0", true);
    if (delayed_) softrnic::SetDelayUs("softrnic0", 0);
    if (peer_ != nullptr) peer_->Kill();
    for (int fd : idle_) close(fd);
    local_.reset();
    kept_.clear();
    if (ctx_ != nullptr) ibv_close_device(ctx_);
  }

  // Starts verbs_peer (with `flags`) and waits for its "ready" line.
  void StartPeer(const std::vector<std::string>& flags = {}) {
    std::vector<std::string> argv = {
        RunfilePath("transport/softrnic/verbs_peer")};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto p = Subprocess::Start(argv);
    ASSERT_OK(p);
    peer_ = std::move(*p);
    auto ready = peer_->ReadLine(absl::Seconds(30));
    ASSERT_OK(ready);
    ASSERT_EQ(ready->rfind("ready", 0), 0u) << *ready;
  }

  // Sends a command; returns the answer's words after "ok" (fails the test
  // on "err" or no answer).
  std::vector<std::string> Ask(const std::string& cmd,
                               absl::Duration timeout = absl::Seconds(30)) {
    auto words = peer_->AskOk(cmd, timeout);
    if (!words.ok()) ADD_FAILURE() << words.status();
    return words.ok() ? *std::move(words) : std::vector<std::string>{};
  }

  // Opens the peer's QP on `peer_dev` and a local one on `local_dev`, and
  // connects them. `co` applies to both sides.
  void ConnectToPeer(const std::string& local_dev, const std::string& peer_dev,
                     const ConnectOptions& co = {}) {
    std::vector<std::string> w =
        Ask(absl::StrCat("open ", peer_dev, " ", kPeerBuffer));
    ASSERT_EQ(w.size(), 4u);
    remote_.qpn = static_cast<uint32_t>(std::stoul(w[0]));
    ASSERT_TRUE(HexToGid(w[1], &remote_.gid)) << w[1];
    remote_.addr = std::stoull(w[2]);
    remote_.rkey = static_cast<uint32_t>(std::stoul(w[3]));

    std::string err;
    if (ctx_ == nullptr) ctx_ = OpenDeviceByName(local_dev, &err);
    ASSERT_NE(ctx_, nullptr) << err;
    local_ = Endpoint::Create(ctx_, EndpointOptions(), &err);
    ASSERT_NE(local_, nullptr) << err;
    buf_ = local_->Reg(kPeerBuffer);
    ASSERT_NE(buf_, nullptr);
    ASSERT_EQ(ConnectQp(local_->qp(), remote_.qpn, remote_.gid, co, &err), 0)
        << err;
    ASSERT_EQ(Ask(absl::StrCat("connect ", local_->qpn(), " ",
                               GidToHex(local_->gid()), " ", int{co.timeout},
                               " ", int{co.retry_cnt}, " ", int{co.rnr_retry},
                               " ", int{co.min_rnr_timer}))
                  .size(),
              0u);
  }

  // One RDMA WRITE of `len` pattern bytes to the peer's buffer at `off`,
  // checked by the peer's checksum right after the send completion.
  void WriteToPeerAndCheck(size_t off, uint32_t len, uint32_t seed) {
    FillPattern(buf_->data(), len, seed);
    ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, seed, buf_, 0, len,
                       remote_.addr + off, remote_.rkey),
              0);
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(local_->cq(), &wc)) << "no completion";
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    ASSERT_EQ(wc.wr_id, seed);
    std::vector<std::string> sum = Ask(absl::StrCat("sum ", off, " ", len));
    ASSERT_EQ(sum.size(), 1u);
    EXPECT_EQ(sum[0], Hex64(Fnv1a(buf_->data(), len)));
  }

  // Polls the peer's CQ: {wr_id, status, opcode, byte_len, imm}.
  std::vector<std::string> PeerPoll() {
    return Ask(absl::StrCat("poll ", kDefaultTimeoutMs),
               absl::Milliseconds(kDefaultTimeoutMs + 5000));
  }

  // The peer's listener address (from its GID).
  std::pair<std::string, uint16_t> PeerListener() const {
    return {GidIpv4(remote_.gid), GidPort(remote_.gid)};
  }

  // Opens `n` idle TCP connections from `from` to the peer's listener
  // (kept in idle_, closed at teardown) and returns them.
  std::vector<int> OpenIdle(const std::string& from, int n) {
    std::vector<int> fds;
    const auto [ip, port] = PeerListener();
    for (int i = 0; i < n; ++i) {
      std::string err;
      int fd = ConnectFrom(from, ip, port, &err);
      if (fd < 0) {
        ADD_FAILURE() << "connection " << i << " from " << from << ": " << err;
        break;
      }
      fds.push_back(fd);
      idle_.push_back(fd);
    }
    return fds;
  }

  // Closes the idle connections opened so far.
  void CloseIdle() {
    for (int fd : idle_) close(fd);
    idle_.clear();
  }

  std::unique_ptr<Subprocess> peer_;
  std::vector<int> idle_;
  // Local endpoints of earlier sessions, kept alive as an application
  // that does not destroy its QPs would.
  std::vector<std::unique_ptr<Endpoint>> kept_;
  bool link_down_ = false;  // softrnic0 of this process; restored.
  bool delayed_ = false;
  ibv_context* ctx_ = nullptr;
  std::unique_ptr<Endpoint> local_;
  Buffer* buf_ = nullptr;
  PeerQp remote_;
};

class TwoProcessOpsTest : public TwoProcessTest,
                          public ::testing::WithParamInterface<const char*> {};

TEST_P(TwoProcessOpsTest, AllOperationsAcrossProcesses) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", GetParam()));

  // RDMA WRITE, small and multi-frame.
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 100, 1));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(4096, 512 * 1024, 2));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, kPeerBuffer, 20));

  // RDMA READ of what the peer filled.
  const uint32_t len = 256 * 1024;
  ASSERT_EQ(Ask(absl::StrCat("fill 0 ", len, " 3")).size(), 0u);
  memset(buf_->data(), 0, len);
  ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_READ, 3, buf_, 0, len,
                     remote_.addr, remote_.rkey),
            0);
  ibv_wc wc = {};
  ASSERT_TRUE(PollOne(local_->cq(), &wc));
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(FirstPatternMismatch(buf_->data(), len, 3), -1);

  // SEND with immediate into the peer's receive.
  ASSERT_EQ(Ask("recv 5 0 4096").size(), 0u);
  FillPattern(buf_->data(), 3000, 4);
  ASSERT_EQ(PostSendMsg(local_->qp(), 4, buf_, 0, 3000, true, 0xabcdef01), 0);
  ASSERT_TRUE(PollOne(local_->cq(), &wc));
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  std::vector<std::string> r = PeerPoll();
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0], "5");
  EXPECT_EQ(r[1], std::to_string(IBV_WC_SUCCESS));
  EXPECT_EQ(r[2], std::to_string(IBV_WC_RECV));
  EXPECT_EQ(r[3], "3000");
  EXPECT_EQ(r[4], "abcdef01");
  std::vector<std::string> sum = Ask("sum 0 3000");
  ASSERT_EQ(sum.size(), 1u);
  EXPECT_EQ(sum[0], Hex64(Fnv1a(buf_->data(), 3000)));

  // RDMA WRITE with immediate consumes a receive at the peer.
  ASSERT_EQ(Ask("recv 6 0 64").size(), 0u);
  FillPattern(buf_->data(), 2048, 5);
  ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE_WITH_IMM, 6, buf_, 0, 2048,
                     remote_.addr + 8192, remote_.rkey, true, 0x1234),
            0);
  ASSERT_TRUE(PollOne(local_->cq(), &wc));
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  r = PeerPoll();
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0], "6");
  EXPECT_EQ(r[1], std::to_string(IBV_WC_SUCCESS));
  EXPECT_EQ(r[2], std::to_string(IBV_WC_RECV_RDMA_WITH_IMM));
  EXPECT_EQ(r[4], "00001234");
  sum = Ask("sum 8192 2048");
  ASSERT_EQ(sum.size(), 1u);
  EXPECT_EQ(sum[0], Hex64(Fnv1a(buf_->data(), 2048)));

  // SEND from the peer into a local receive.
  memset(buf_->data(), 0, 4096);
  ASSERT_EQ(PostRecvBuf(local_->qp(), 7, buf_, 0, 4096), 0);
  ASSERT_EQ(Ask("fill 0 2048 6").size(), 0u);
  ASSERT_EQ(Ask("send 8 0 2048 -").size(), 0u);
  r = PeerPoll();
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0], "8");
  EXPECT_EQ(r[1], std::to_string(IBV_WC_SUCCESS));
  EXPECT_EQ(r[2], std::to_string(IBV_WC_SEND));
  ASSERT_TRUE(PollOne(local_->cq(), &wc));
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(wc.wr_id, 7u);
  EXPECT_EQ(wc.opcode, IBV_WC_RECV);
  EXPECT_EQ(wc.byte_len, 2048u);
  EXPECT_EQ(FirstPatternMismatch(buf_->data(), 2048, 6), -1);

  // The peer's RDMA WRITE into local memory.
  memset(buf_->data(), 0, 8192);
  ASSERT_EQ(Ask("fill 0 8192 7").size(), 0u);
  ASSERT_EQ(
      Ask(absl::StrCat("write 9 0 8192 ", buf_->addr(), " ", buf_->rkey()))
          .size(),
      0u);
  r = PeerPoll();
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[1], std::to_string(IBV_WC_SUCCESS));
  EXPECT_EQ(FirstPatternMismatch(buf_->data(), 8192, 7), -1);

  std::vector<std::string> state = Ask("state");
  ASSERT_EQ(state.size(), 1u);
  EXPECT_EQ(state[0], std::to_string(IBV_QPS_RTS));
  EXPECT_EQ(Ask("quit").size(), 0u);
  auto rc = peer_->Finish(absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
}

INSTANTIATE_TEST_SUITE_P(PeerDevice, TwoProcessOpsTest,
                         ::testing::Values("softrnic0", "softrnic1"));

TEST_F(TwoProcessTest, KilledPeerGivesRetryExceededWithinBoundedTime) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  ConnectOptions co;
  // ~268 ms a try, 4 tries: a dead peer fails the QP within ~1.1 s, and
  // the healthy write first is acknowledged though softrnic's ACK comes
  // from the peer process, which a loaded host may not run for a while
  // (~4 ms tries failed it at load 9).
  co.timeout = 16;
  co.retry_cnt = 3;
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0", co));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 4096, 1));
  peer_->Kill();
  const auto start = Clock::now();
  ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, 2, buf_, 0, 4096,
                     remote_.addr, remote_.rkey),
            0);
  ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, 3, buf_, 0, 4096,
                     remote_.addr, remote_.rkey),
            0);
  ibv_wc wc = {};
  ASSERT_TRUE(PollOne(local_->cq(), &wc)) << "no completion";
  const int64_t ms = MsSince(start);
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(wc.status);
  // (1 + retry_cnt) tries of ~268 ms, with room for a loaded machine.
  EXPECT_LT(ms, 3000) << "retry exhaustion took " << ms << " ms";
  ASSERT_TRUE(PollOne(local_->cq(), &wc));
  EXPECT_EQ(wc.wr_id, 3u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(QpState(local_->qp()), IBV_QPS_ERR);
}

TEST_F(TwoProcessTest, GarbageOnPeerListenerDoesNotDisturbPeer) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 4096, 1));
  const std::string ip = GidIpv4(remote_.gid);
  const uint16_t port = GidPort(remote_.gid);
  ASSERT_NE(port, 0) << "peer GID carries no listener port: "
                     << GidToHex(remote_.gid);
  std::vector<std::vector<uint8_t>> inputs;
  inputs.push_back({});
  inputs.push_back(Header(1, 1, 0x00ffffff, 0, 0, 0, 1));
  inputs.push_back(Header(1, 10, remote_.qpn, 0xffffffffu, 0, 0, 0));
  inputs.push_back(Header(7, 200, remote_.qpn, 0, 0, 0, 0));
  uint32_t x = 777;
  for (int i = 0; i < 30; ++i) {
    x = x * 1103515245 + 12345;
    std::vector<uint8_t> junk((x >> 8) % 50000 + 1);
    FillPattern(junk.data(), junk.size(), x);
    inputs.push_back(std::move(junk));
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    SendToListener(ip, port, inputs[i], i % 2 == 0);
  }
  // The peer process is alive and its QP still works both ways.
  std::vector<std::string> state = Ask("state");
  ASSERT_EQ(state.size(), 1u);
  EXPECT_EQ(state[0], std::to_string(IBV_QPS_RTS));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(8192, 65536, 2));
  ASSERT_EQ(Ask("fill 0 1024 3").size(), 0u);
  ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_READ, 3, buf_, 0, 1024,
                     remote_.addr, remote_.rkey),
            0);
  ibv_wc wc = {};
  ASSERT_TRUE(PollOne(local_->cq(), &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(FirstPatternMismatch(buf_->data(), 1024, 3), -1);
  EXPECT_EQ(Ask("quit").size(), 0u);
  auto rc = peer_->Finish(absl::Seconds(10));
  ASSERT_OK(rc);
  EXPECT_EQ(*rc, 0);
}

// Across processes the QPs talk over real TCP connections, so cutting them
// mid-transfer exercises reconnection and retransmission: each WR completes
// (data intact, every SEND delivered once) or fails cleanly.
TEST_F(TwoProcessTest, CutConnectionsMidTransferCompleteOrFailCleanly) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  const uint32_t len = kPeerBuffer / 2;
  int ok = 0;
  bool failed = false;
  for (uint32_t i = 0; i < 10 && !failed; ++i) {
    SCOPED_TRACE("iteration " + std::to_string(i));
    ASSERT_EQ(Ask(absl::StrCat("recv ", 500 + i, " ", len, " 4096")).size(),
              0u);
    FillPattern(buf_->data(), len, 100 + i);
    ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, i, buf_, 0, len,
                       remote_.addr, remote_.rkey),
              0);
    ASSERT_EQ(PostSendMsg(local_->qp(), 1000 + i, buf_, 0, 4096), 0);
    ASSERT_EQ(softrnic::CutConnections("softrnic0"), 0) << strerror(errno);
    std::vector<ibv_wc> wcs;
    ASSERT_EQ(PollCompletions(local_->cq(), 2, &wcs), 2) << "transfer hung";
    EXPECT_EQ(wcs[0].wr_id, i);
    EXPECT_EQ(wcs[1].wr_id, 1000 + i);
    if (wcs[0].status == IBV_WC_SUCCESS) {
      std::vector<std::string> sum = Ask(absl::StrCat("sum 0 ", len));
      ASSERT_EQ(sum.size(), 1u);
      EXPECT_EQ(sum[0], Hex64(Fnv1a(buf_->data(), len)));
    }
    if (wcs[1].status == IBV_WC_SUCCESS) {
      std::vector<std::string> r = PeerPoll();
      ASSERT_EQ(r.size(), 5u);
      EXPECT_EQ(r[0], std::to_string(500 + i));
      EXPECT_EQ(r[1], std::to_string(IBV_WC_SUCCESS));
      std::vector<std::string> sum = Ask(absl::StrCat("sum ", len, " 4096"));
      ASSERT_EQ(sum.size(), 1u);
      EXPECT_EQ(sum[0], Hex64(Fnv1a(buf_->data(), 4096)));
    }
    if (wcs[0].status == IBV_WC_SUCCESS && wcs[1].status == IBV_WC_SUCCESS) {
      ++ok;
    } else {
      failed = true;
      EXPECT_TRUE(wcs[0].status == IBV_WC_RETRY_EXC_ERR ||
                  wcs[1].status == IBV_WC_RETRY_EXC_ERR)
          << ibv_wc_status_str(wcs[0].status) << " / "
          << ibv_wc_status_str(wcs[1].status);
      EXPECT_EQ(QpState(local_->qp()), IBV_QPS_ERR);
    }
  }
  std::printf("CutConnections across processes: %d of 10 succeeded\n", ok);
  if (!failed) {
    // A retransmitted SEND must not have consumed a second receive.
    auto extra = peer_->Ask("poll 200");
    ASSERT_OK(extra);
    EXPECT_EQ(*extra, "err timeout") << "duplicate delivery";
  }
}

TEST_F(TwoProcessTest, SetDelayUsAddsLatencyOnTheWire) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  ConnectOptions co;
  co.timeout = 18;  // ~1 s: the delay must not look like a lost frame.
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0", co));
  auto one_write_us = [&](uint64_t id) -> int64_t {
    const auto start = Clock::now();
    if (PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, id, buf_, 0, 64, remote_.addr,
                 remote_.rkey) != 0) {
      return -1;
    }
    ibv_wc wc = {};
    if (!PollOne(local_->cq(), &wc) || wc.status != IBV_WC_SUCCESS) return -1;
    return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() -
                                                                 start)
        .count();
  };
  for (int i = 0; i < 5; ++i) ASSERT_GE(one_write_us(i), 0);
  const uint32_t delay_us = 30000;
  delayed_ = true;
  ASSERT_EQ(softrnic::SetDelayUs("softrnic0", delay_us), 0);
  for (int i = 0; i < 5; ++i) {
    const int64_t us = one_write_us(100 + i);
    ASSERT_GE(us, 0);
    EXPECT_GE(us, delay_us * 9 / 10) << "write " << i << " took " << us;
  }
  ASSERT_EQ(softrnic::SetDelayUs("softrnic0", 0), 0);
  std::vector<int64_t> after;
  for (int i = 0; i < 9; ++i) after.push_back(one_write_us(200 + i));
  std::sort(after.begin(), after.end());
  ASSERT_GE(after[0], 0);
  EXPECT_LT(after[4], delay_us / 2) << "delay not removed";
}

TEST_F(TwoProcessTest, LocalLinkDownFailsRequestsToPeer) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  ConnectOptions co;
  co.timeout = 16;  // As above: the healthy write first must survive load.
  co.retry_cnt = 3;
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0", co));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 4096, 1));
  link_down_ = true;
  ASSERT_EQ(softrnic::SetLink("softrnic0", false), 0);
  const auto start = Clock::now();
  ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, 2, buf_, 0, 4096,
                     remote_.addr, remote_.rkey),
            0);
  ibv_wc wc = {};
  ASSERT_TRUE(PollOne(local_->cq(), &wc));
  EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_LT(MsSince(start), 3000);
  // The peer process is not affected by this process's link.
  std::vector<std::string> state = Ask("state");
  ASSERT_EQ(state.size(), 1u);
  EXPECT_EQ(state[0], std::to_string(IBV_QPS_RTS));
}

// The responder's checks over the wire (the in-process path may take a
// shortcut): a bad rkey is a remote access error that moves the QP to ERR,
// flushes what follows and writes nothing; a SEND without a receive is
// RNR-retried and either fails once rnr_retry is spent or succeeds when a
// receive is posted in time.
TEST_F(TwoProcessTest, ResponderErrorsAcrossProcesses) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  {
    SCOPED_TRACE("bad rkey");
    ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
    ASSERT_EQ(Ask("fill 0 65536 1").size(), 0u);
    std::vector<std::string> before = Ask("sum 0 65536");
    ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, 1, buf_, 0, 4096,
                       remote_.addr, remote_.rkey ^ 0x00202000),
              0);
    ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, 2, buf_, 0, 4096,
                       remote_.addr + 8192, remote_.rkey),
              0);
    // Out of the peer's MR bounds.
    ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, 3, buf_, 0, 4096,
                       remote_.addr + kPeerBuffer - 100, remote_.rkey),
              0);
    std::vector<ibv_wc> wcs;
    ASSERT_EQ(PollCompletions(local_->cq(), 3, &wcs), 3);
    EXPECT_EQ(wcs[0].wr_id, 1u);
    EXPECT_EQ(wcs[0].status, IBV_WC_REM_ACCESS_ERR)
        << ibv_wc_status_str(wcs[0].status);
    EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(wcs[2].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(QpState(local_->qp()), IBV_QPS_ERR);
    EXPECT_EQ(Ask("sum 0 65536"), before);
    ASSERT_NO_FATAL_FAILURE(Disconnect());
  }
  {
    SCOPED_TRACE("out of bounds");
    ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
    ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, 4, buf_, 0, 4096,
                       remote_.addr + kPeerBuffer - 100, remote_.rkey),
              0);
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(local_->cq(), &wc));
    EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(wc.status);
    ASSERT_NO_FATAL_FAILURE(Disconnect());
  }
  {
    SCOPED_TRACE("RNR retries exhausted");
    ConnectOptions co;
    co.rnr_retry = 1;
    co.min_rnr_timer = 1;
    ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0", co));
    ASSERT_EQ(PostSendMsg(local_->qp(), 5, buf_, 0, 64), 0);
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(local_->cq(), &wc));
    EXPECT_EQ(wc.status, IBV_WC_RNR_RETRY_EXC_ERR)
        << ibv_wc_status_str(wc.status);
    ASSERT_NO_FATAL_FAILURE(Disconnect());
  }
  {
    SCOPED_TRACE("receive posted during the RNR window");
    ConnectOptions co;
    co.rnr_retry = 6;
    co.min_rnr_timer = 26;  // 81.92 ms.
    ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0", co));
    FillPattern(buf_->data(), 512, 6);
    ASSERT_EQ(PostSendMsg(local_->qp(), 6, buf_, 0, 512), 0);
    // Neither success nor RNR exhaustion (~570 ms away) before a receive.
    std::vector<ibv_wc> none;
    EXPECT_EQ(PollCompletions(local_->cq(), 1, &none, 150), 0)
        << "wr_id " << (none.empty() ? 0 : none[0].wr_id) << " status "
        << (none.empty() ? "" : ibv_wc_status_str(none[0].status));
    ASSERT_EQ(Ask("recv 7 0 4096").size(), 0u);
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(local_->cq(), &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    std::vector<std::string> r = PeerPoll();
    ASSERT_EQ(r.size(), 5u);
    EXPECT_EQ(r[0], "7");
    EXPECT_EQ(r[3], "512");
    EXPECT_EQ(Ask("sum 0 512"),
              std::vector<std::string>{Hex64(Fnv1a(buf_->data(), 512))});
  }
}

// Many WRs in flight over TCP: completions in posting order, only the
// signaled ones reported, unsignaled slots freed, all data applied.
TEST_F(TwoProcessTest, PipelinedAndUnsignaledWrsAcrossProcesses) {
  ASSERT_NO_FATAL_FAILURE(StartPeer());
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  const uint32_t s = local_->cap().max_send_wr;
  const uint32_t chunk = kPeerBuffer / s;
  ASSERT_GE(chunk, 1024u);
  FillPattern(buf_->data(), kPeerBuffer, 77);
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    // Odd rounds: all signaled; even rounds: only the last one.
    for (uint32_t i = 0; i < s; ++i) {
      const bool signaled = round % 2 == 1 || i == s - 1;
      ASSERT_EQ(PostRdma(local_->qp(), IBV_WR_RDMA_WRITE, round * 1000 + i,
                         buf_, i * chunk, chunk, remote_.addr + i * chunk,
                         remote_.rkey, signaled),
                0)
          << "WR " << i;
    }
    const int want = round % 2 == 1 ? static_cast<int>(s) : 1;
    std::vector<ibv_wc> wcs;
    ASSERT_EQ(PollCompletions(local_->cq(), want, &wcs), want);
    for (int k = 0; k < want; ++k) {
      EXPECT_EQ(wcs[k].status, IBV_WC_SUCCESS);
      EXPECT_EQ(wcs[k].wr_id, round * 1000u + (want == 1 ? s - 1 : k));
    }
    std::vector<ibv_wc> extra;
    EXPECT_EQ(PollCompletions(local_->cq(), 1, &extra, 250), 0)
        << "unexpected completion wr_id "
        << (extra.empty() ? 0 : extra[0].wr_id);
    EXPECT_EQ(Ask(absl::StrCat("sum 0 ", s * chunk)),
              std::vector<std::string>{Hex64(Fnv1a(buf_->data(), s * chunk))});
  }
}

// RC: the responder acknowledges a request once it has applied it, so a
// requester's SEND succeeds even when the responder's application exits
// right after seeing the receive completion (ibv_rc_pingpong's server does
// exactly this after its last message). An ACK sent only after the
// completion became visible can be lost with the exiting process.
TEST_F(TwoProcessTest, SendSucceedsWhenResponderExitsRightAfterReceive) {
  int failures = 0;
  std::string statuses;
  // The race window is microseconds wide: try many times.
  for (int i = 0; i < 30; ++i) {
    ASSERT_NO_FATAL_FAILURE(StartPeer());
    ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
    ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 64, 1));
    ASSERT_EQ(Ask("exit_on_recv 3 0 4096").size(), 0u);
    ASSERT_EQ(PostSendMsg(local_->qp(), 4, buf_, 0, 1024), 0);
    auto line = peer_->ReadLine(absl::Seconds(15));
    ASSERT_OK(line);
    EXPECT_EQ(*line, absl::StrCat("ok 3 ", int{IBV_WC_SUCCESS}));
    ibv_wc wc = {};
    ASSERT_TRUE(PollOne(local_->cq(), &wc));
    EXPECT_EQ(wc.wr_id, 4u);
    if (wc.status != IBV_WC_SUCCESS) {
      ++failures;
      statuses += std::string(" ") + ibv_wc_status_str(wc.status);
    }
    auto rc = peer_->Finish(absl::Seconds(10));
    EXPECT_OK(rc);
    peer_.reset();
    local_.reset();
    buf_ = nullptr;
    ibv_close_device(ctx_);
    ctx_ = nullptr;
  }
  EXPECT_EQ(failures, 0) << "SEND failed although the peer received it:"
                         << statuses;
}

// ===========================================================================
// Hostile connections to a softrnic listener (the peer is the target).

// A connection that never completes its HELLO is closed after the
// handshake timeout, however it stalls; the listener keeps serving.
TEST_F(TwoProcessTest, HandshakeTimeoutClosesConnectionsThatSayNothing) {
  ASSERT_NO_FATAL_FAILURE(
      StartPeer({"--setenv=FERRY_SOFTRNIC_HANDSHAKE_TIMEOUT_MS=300"}));
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  std::vector<int> fds = OpenIdle("127.0.0.9", 4);
  ASSERT_EQ(fds.size(), 4u);
  // Half a header, then silence.
  ASSERT_EQ(send(fds[0], "SRNC\x01\x01", 6, MSG_NOSIGNAL), 6);
  const auto start = Clock::now();
  EXPECT_EQ(CountClosedByPeer(fds, 4, 5000), 4)
      << "idle connections still open after 5 s; handshake timeout 300 ms";
  EXPECT_GE(MsSince(start), 200) << "closed before the handshake timeout";
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 65536, 1));
}

// Connections from one source address beyond the per-address cap, and
// from all addresses beyond the global cap, are closed at once; the
// legitimate QP keeps working throughout, and once the attacker leaves a
// new QP connects again.
TEST_F(TwoProcessTest, ConnectionCapsPerAddressAndGlobal) {
  ASSERT_NO_FATAL_FAILURE(
      StartPeer({"--setenv=FERRY_SOFTRNIC_HANDSHAKE_TIMEOUT_MS=60000",
                 "--setenv=FERRY_SOFTRNIC_MAX_CONNECTIONS=20",
                 "--setenv=FERRY_SOFTRNIC_MAX_CONNECTIONS_PER_ADDRESS=8"}));
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 4096, 1));
  // The legitimate connection (from 127.0.0.1) holds one of the 20.
  std::vector<int> a = OpenIdle("127.0.0.9", 12);
  ASSERT_EQ(a.size(), 12u);
  // Admission is in arrival order: the first 8 stay, the last 4 are
  // refused, so once 4 are closed all 12 were seen.
  EXPECT_EQ(CountClosedByPeer(a, 4, 5000), 4) << "per-address cap is 8";
  std::vector<int> b = OpenIdle("127.0.0.10", 12);
  ASSERT_EQ(b.size(), 12u);
  // 1 + 8 + 8 = 17: three more fit under the global cap of 20.
  EXPECT_EQ(CountClosedByPeer(b, 4, 5000), 4) << "per-address cap is 8";
  std::vector<int> c = OpenIdle("127.0.0.11", 6);
  ASSERT_EQ(c.size(), 6u);
  EXPECT_EQ(CountClosedByPeer(c, 3, 5000), 3) << "global cap is 20";
  // The admitted ones stay open (no handshake timeout yet).
  int open_ones = 0;
  for (const auto* v : {&a, &b, &c}) {
    for (int fd : *v) open_ones += ClosedByPeer(fd, 0) ? 0 : 1;
  }
  EXPECT_EQ(open_ones, 19);
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 65536, 2));
  // The attacker leaves: a new QP pair connects and works.
  CloseIdle();
  ASSERT_NO_FATAL_FAILURE(Disconnect());
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 65536, 3));
}

// With the target's descriptors exhausted by idle connections, accept
// fails with EMFILE: the target backs off instead of spinning, and serves
// again once the attacker has left.
TEST_F(TwoProcessTest, FdExhaustionBacksOffAndRecovers) {
  ASSERT_NO_FATAL_FAILURE(
      StartPeer({"--setenv=FERRY_SOFTRNIC_HANDSHAKE_TIMEOUT_MS=60000"}));
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 4096, 1));
  rlimit old = {};
  ASSERT_EQ(prlimit(peer_->pid(), RLIMIT_NOFILE, nullptr, &old), 0)
      << strerror(errno);
  rlimit lim = {64, old.rlim_max};  // Only the soft limit: no privilege.
  ASSERT_EQ(prlimit(peer_->pid(), RLIMIT_NOFILE, &lim, nullptr), 0)
      << strerror(errno);
  // From several addresses, so that no per-address cap stops them first.
  for (int i = 0; i < 8; ++i) {
    OpenIdle("127.0.0." + std::to_string(20 + i), 12);
  }
  // The peer's CPU time over a second of EMFILE.
  auto cpu_ms = [&]() -> int64_t {
    FILE* f =
        fopen(("/proc/" + std::to_string(peer_->pid()) + "/stat").c_str(), "r");
    if (f == nullptr) return -1;
    char buf[1024] = {};
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    std::string s(buf, n);
    size_t paren = s.rfind(')');
    if (paren == std::string::npos) return -1;
    std::vector<std::string> f2 =
        absl::StrSplit(s.substr(paren + 2), ' ', absl::SkipEmpty());
    if (f2.size() < 13) return -1;
    // utime and stime are fields 14 and 15 (11 and 12 after the name).
    return (std::stoll(f2[11]) + std::stoll(f2[12])) * 1000 /
           sysconf(_SC_CLK_TCK);
  };
  const int64_t before = cpu_ms();
  ASSERT_GE(before, 0);
  const auto start = Clock::now();
  usleep(1000000);  // Measures a rate; orders nothing.
  const int64_t used = cpu_ms() - before;
  const int64_t wall = MsSince(start);
  EXPECT_LT(used, wall / 5) << "the target burnt " << used << " ms of CPU in "
                            << wall << " ms while out of descriptors";
  CloseIdle();
  ASSERT_EQ(prlimit(peer_->pid(), RLIMIT_NOFILE, &old, nullptr), 0)
      << strerror(errno);
  ASSERT_NO_FATAL_FAILURE(Disconnect());
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0"));
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 65536, 2));
}

// ===========================================================================
// Dead peers.

// Sessions with peers that are then killed leave no descriptor behind
// here, although the local QPs stay (as an application's endpoint cache
// keeps them); a QP whose peer died then fails its next request as RC
// hardware does.
TEST_F(TwoProcessTest, KilledPeersLeaveNoDescriptorsBehind) {
  std::string err;
  ctx_ = OpenDeviceByName("softrnic0", &err);
  ASSERT_NE(ctx_, nullptr) << err;
  const int baseline = ::ferry::testing::OpenFds();
  ASSERT_GT(baseline, 0);
  ConnectOptions co;
  // ACK timeout ~67 ms, 7 retries: a dead peer still fails the QP within
  // about half a second, and a live one that is slow to answer (a loaded
  // machine, a sanitizer build) does not.
  co.timeout = 14;
  co.retry_cnt = 7;
  constexpr int kSessions = 8;
  for (int i = 0; i < kSessions; ++i) {
    SCOPED_TRACE("session " + std::to_string(i));
    ASSERT_NO_FATAL_FAILURE(StartPeer());
    ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "softrnic0", co));
    // Traffic both ways: the peer writes here, this process writes there.
    ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 4096, 1));
    ASSERT_EQ(Ask("fill 0 4096 7").size(), 0u);
    ASSERT_EQ(
        Ask(absl::StrCat("write 9 0 4096 ", buf_->addr(), " ", buf_->rkey()))
            .size(),
        0u);
    std::vector<std::string> r = PeerPoll();
    ASSERT_EQ(r.size(), 5u);
    EXPECT_EQ(r[1], std::to_string(IBV_WC_SUCCESS));
    if (i % 2 == 0) {
      peer_->Kill();
    } else {
      EXPECT_EQ(Ask("quit").size(), 0u);
      EXPECT_OK(peer_->Finish(absl::Seconds(10)));
    }
    peer_.reset();
    buf_ = nullptr;
    kept_.push_back(std::move(local_));
  }
  // The peers' exits are seen asynchronously: wait for the count to drop.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  int now = ::ferry::testing::OpenFds();
  while (now > baseline && Clock::now() < deadline) {
    usleep(10000);
    now = ::ferry::testing::OpenFds();
  }
  EXPECT_LE(now, baseline) << kSessions << " sessions with dead peers left "
                           << now - baseline << " descriptors open";
  // The oldest QP's peer is gone: its next WRITE ends in RETRY_EXC_ERR.
  Endpoint* old = kept_.front().get();
  Buffer* b = old->Reg(4096);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(PostRdma(old->qp(), IBV_WR_RDMA_WRITE, 77, b, 0, 4096, 0x1000, 1),
            0);
  ibv_wc wc = {};
  ASSERT_TRUE(PollOne(old->cq(), &wc));
  EXPECT_EQ(wc.wr_id, 77u);
  EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR) << ibv_wc_status_str(wc.status);
  EXPECT_EQ(QpState(old->qp()), IBV_QPS_ERR);
}

// Parses "name=gidhex ..." into (name, dotted IPv4) pairs.
std::vector<std::pair<std::string, std::string>> ParseDevices(
    const std::vector<std::string>& words) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& w : words) {
    size_t eq = w.find('=');
    ibv_gid gid = {};
    if (eq == std::string::npos || !HexToGid(w.substr(eq + 1), &gid)) {
      ADD_FAILURE() << "bad device entry " << w;
      continue;
    }
    out.emplace_back(w.substr(0, eq), GidIpv4(gid));
  }
  return out;
}

TEST_F(TwoProcessTest, DefaultConfigIsOneDeviceSoftrnic0OnLoopback) {
  ASSERT_NO_FATAL_FAILURE(StartPeer({"--unsetenv=FERRY_SOFTRNIC_DEVICES"}));
  auto devices = ParseDevices(Ask("devices"));
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(devices, (std::vector<P>{P("softrnic0", "127.0.0.1")}));
}

TEST_F(TwoProcessTest, ConfigFromEnvironmentNamesDevicesAndAddresses) {
  ASSERT_NO_FATAL_FAILURE(StartPeer(
      {"--setenv=FERRY_SOFTRNIC_DEVICES=alpha=127.0.0.3,beta=127.0.0.4"}));
  auto devices = ParseDevices(Ask("devices"));
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(devices,
            (std::vector<P>{P("alpha", "127.0.0.3"), P("beta", "127.0.0.4")}));
  // And the configured device carries traffic to this process's softrnic0.
  ASSERT_NO_FATAL_FAILURE(ConnectToPeer("softrnic0", "beta"));
  EXPECT_EQ(GidIpv4(remote_.gid), "127.0.0.4");
  ASSERT_NO_FATAL_FAILURE(WriteToPeerAndCheck(0, 65536, 9));
}

}  // namespace
}  // namespace softrnic_test
