// TcpTransport between two instances in one process, over real loopback
// sockets, plus hostile peers speaking raw bytes.
#include "transport/tcp/tcp_transport.h"

#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

// Collects completions; waits for a count.
class Sink : public SliceSink {
 public:
  void OnSliceDone(Slice* slice, const absl::Status& status) override {
    MutexLock lock(&mu_);
    statuses_.push_back(status);
    cv_.SignalAll();
  }
  std::vector<absl::Status> Wait(size_t n) {
    MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (statuses_.size() < n && !cv_.WaitWithDeadline(&mu_, deadline)) {
    }
    return statuses_;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

class TcpTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TransportOptions opts;
    target_ = std::make_unique<TcpTransport>(opts);
    initiator_ = std::make_unique<TcpTransport>(opts);
    TransportEnv env;
    env.local_segment = "t";
    env.listen_host = "127.0.0.1";
    metadata::TransportEndpoint ep;
    ASSERT_OK(target_->Install(env, &ep));
    metadata::TransportEndpoint ep2;
    ASSERT_OK(initiator_->Install(env, &ep2));
    target_buf_.assign(1 << 20, 0);
    MemoryRegion r;
    r.addr = reinterpret_cast<uintptr_t>(target_buf_.data());
    r.length = target_buf_.size();
    r.remote_accessible = true;
    metadata::Buffer published;
    ASSERT_OK(target_->RegisterMemory(r, &published));
    metadata::SegmentDescriptor d;
    d.set_name("target");
    auto* t = d.add_transports();
    t->set_transport("tcp");
    t->set_address(ep.address());
    target_addr_ = ep.address();
    auto* b = d.add_buffers();
    b->set_addr(r.addr);
    b->set_length(r.length);
    view_ = *SegmentView::Create(d);
  }

  Slice MakeSlice(OpCode op, void* local, uint64_t remote, size_t len) {
    Slice s;
    s.op = op;
    s.local = local;
    s.remote = remote;
    s.length = len;
    s.target = view_.get();
    s.deadline = absl::Now() + absl::Seconds(10);
    s.sink = &sink_;
    return s;
  }

  // A view of the target whose TCP endpoint is `port` on loopback.
  std::shared_ptr<const SegmentView> ViewWithPort(uint16_t port) {
    metadata::SegmentDescriptor d = view_->descriptor();
    d.mutable_transports(0)->set_address("127.0.0.1:" + std::to_string(port));
    return *SegmentView::Create(d);
  }

  // Submits one 8-byte READ to `view` and returns its completion status.
  absl::Status ReadOnce(const SegmentView* view, absl::Duration deadline,
                        bool shutdown_after_submit = false) {
    char buf[8];
    Slice s = MakeSlice(OpCode::kRead, buf, Remote(0), 8);
    s.target = view;
    s.deadline = absl::Now() + deadline;
    Slice* ss[] = {&s};
    initiator_->Submit(ss);
    if (shutdown_after_submit) initiator_->Shutdown();
    auto st = sink_.Wait(1);
    return st.size() == 1 ? st[0] : absl::InternalError("no completion");
  }

  uint64_t Remote(size_t off) {
    return reinterpret_cast<uint64_t>(target_buf_.data()) + off;
  }

  // Declared first, destroyed last: what the transports' threads may still
  // touch while they shut down (a server thread may still be in sendmsg on
  // the memory when a READ has already completed at the initiator; a
  // shutdown completes slices through the sink).
  std::vector<uint8_t> target_buf_;
  std::shared_ptr<const SegmentView> view_;
  std::string target_addr_;
  Sink sink_;
  std::unique_ptr<TcpTransport> target_, initiator_;
};

TEST_F(TcpTransportTest, WriteThenRead) {
  std::vector<uint8_t> src(300000);
  std::iota(src.begin(), src.end(), 0);
  Slice w = MakeSlice(OpCode::kWrite, src.data(), Remote(1000), src.size());
  Slice* ws[] = {&w};
  initiator_->Submit(ws);
  auto st = sink_.Wait(1);
  ASSERT_EQ(st.size(), 1u);
  ASSERT_OK(st[0]) << st[0];
  // Applied at the target when the WRITE completed.
  EXPECT_EQ(std::memcmp(target_buf_.data() + 1000, src.data(), src.size()), 0);
  std::vector<uint8_t> dst(src.size());
  Slice r = MakeSlice(OpCode::kRead, dst.data(), Remote(1000), dst.size());
  Slice* rs[] = {&r};
  initiator_->Submit(rs);
  st = sink_.Wait(2);
  ASSERT_OK(st[1]) << st[1];
  EXPECT_EQ(dst, src);
}

TEST_F(TcpTransportTest, OutOfBoundsWriteFailsAndWritesNothing) {
  std::vector<uint8_t> src(4096, 0xab);
  // Last 100 bytes of the buffer plus 3996 beyond it.
  Slice w = MakeSlice(OpCode::kWrite, src.data(),
                      Remote(target_buf_.size() - 100), src.size());
  Slice ok = MakeSlice(OpCode::kWrite, src.data(), Remote(0), 16);
  Slice* ws[] = {&w, &ok};
  initiator_->Submit(ws);
  auto st = sink_.Wait(2);
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(st[0].code(), absl::StatusCode::kInvalidArgument) << st[0];
  EXPECT_OK(st[1]) << st[1];  // Same connection still works.
  for (size_t i = target_buf_.size() - 100; i < target_buf_.size(); ++i) {
    ASSERT_EQ(target_buf_[i], 0) << i;
  }
}

TEST_F(TcpTransportTest, GarbageFrameClosesOnlyThatConnection) {
  auto hp = ParseHostPort(target_addr_);
  auto bad = ConnectTcp(*hp, absl::Seconds(2));
  ASSERT_OK(bad);
  char garbage[64];
  std::memset(garbage, 0x5a, sizeof(garbage));
  ASSERT_OK(WriteFull(bad->get(), garbage, sizeof(garbage)));
  SetRecvTimeout(bad->get(), absl::Seconds(5));
  char c;
  EXPECT_EQ(ReadFull(bad->get(), &c, 1).code(), absl::StatusCode::kOutOfRange);
  // A truncated header then close: also harmless.
  auto trunc = ConnectTcp(*hp, absl::Seconds(2));
  ASSERT_OK(trunc);
  uint8_t hdr[kRequestHeaderBytes];
  EncodeRequest({WireOp::kWrite, 1, Remote(0), 1000}, hdr);
  ASSERT_OK(WriteFull(trunc->get(), hdr, 10));
  trunc->Reset();
  // A WRITE header followed by a short payload and close writes nothing
  // beyond what arrived and is not acknowledged.
  std::vector<uint8_t> src(64, 7);
  Slice w = MakeSlice(OpCode::kWrite, src.data(), Remote(64), src.size());
  Slice* ws[] = {&w};
  initiator_->Submit(ws);
  auto st = sink_.Wait(1);
  ASSERT_OK(st[0]) << st[0];
  EXPECT_EQ(target_buf_[64], 7);
}

TEST_F(TcpTransportTest, UnreachablePeerFailsFast) {
  uint16_t port = 0;
  { auto l = ListenTcp("127.0.0.1", 0, &port); }  // Closed: refused.
  auto dead = ViewWithPort(port);
  absl::Status s = ReadOnce(dead.get(), absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST_F(TcpTransportTest, SilentPeerHitsDeadline) {
  uint16_t port = 0;
  auto listener = ListenTcp("127.0.0.1", 0, &port);  // Never answers.
  ASSERT_OK(listener);
  auto silent = ViewWithPort(port);
  absl::Status s = ReadOnce(silent.get(), absl::Milliseconds(200));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

TEST_F(TcpTransportTest, ShutdownCancelsInFlight) {
  uint16_t port = 0;
  auto listener = ListenTcp("127.0.0.1", 0, &port);
  ASSERT_OK(listener);
  auto silent = ViewWithPort(port);
  absl::Status s = ReadOnce(silent.get(), absl::Seconds(10),
                            /*shutdown_after_submit=*/true);
  EXPECT_FALSE(s.ok());
}

}  // namespace
}  // namespace ferry::tcp
