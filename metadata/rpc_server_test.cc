// RpcServer's own accept loop: connection caps (total and per peer), the
// handshake timeout and the back-off when out of fds (on a SimulatedClock),
// the fd limit it raises, and that it keeps serving. The fd-exhaustion
// case with real processes is tools/rpc_server_fd_test.
#include "metadata/rpc_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/simulated_clock.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "grpcpp/create_channel_posix.h"
#include "gtest/gtest.h"
#include "metadata/metadata_client.h"
#include "metadata/metadata_service.h"
#include "metadata/proto/metadata.grpc.pb.h"

namespace ferry::metadata {
namespace {

enum class Answer { kServed, kClosed, kNone };

// What the server did with a connection: gRPC's SETTINGS (served), a close
// or reset (refused or dropped), or nothing within `timeout`.
Answer WaitAnswer(int fd, absl::Duration timeout) {
  pollfd p{fd, POLLIN, 0};
  int n;
  do {
    n = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return Answer::kNone;
  char buf[256];
  ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  return r > 0 ? Answer::kServed : Answer::kClosed;
}

// Whether the server closes `fd` within `timeout`, whatever it sent first.
bool WaitClosed(int fd, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10) <= 0) continue;
    char buf[256];
    const ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

UniqueFd TcpSocket() {
  return UniqueFd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
}

// Connects `fd` from `source_ip` (any 127/8 address is local).
void Connect(int fd, const std::string& source_ip, const HostPort& to) {
  sockaddr_in src{};
  src.sin_family = AF_INET;
  inet_pton(AF_INET, source_ip.c_str(), &src.sin_addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)), 0)
      << strerror(errno);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(to.port);
  inet_pton(AF_INET, to.host.c_str(), &dst.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)), 0)
      << strerror(errno);
}

UniqueFd ConnectFrom(const std::string& source_ip, const HostPort& to) {
  UniqueFd fd = TcpSocket();
  Connect(fd.get(), source_ip, to);
  return fd;
}

// Polls `done` until it holds or `limit` of real time passed: for what
// another thread does, never for time itself.
template <typename Done>
bool Eventually(Done done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time end = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() >= end) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

void SendPreface(int fd) {
  static const char kPreface[] =
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\4\0\0\0\0\0";
  ASSERT_OK(WriteFull(fd, kPreface, sizeof(kPreface) - 1));
}

// A connection from `source_ip` with a gRPC channel over it, so that a test
// can hold connections that carry calls from an address of its choice. The
// channel cannot reconnect: once the server closes it, its calls fail.
std::unique_ptr<MetadataService::Stub> StubFrom(const std::string& source_ip,
                                                const HostPort& to) {
  UniqueFd fd = ConnectFrom(source_ip, to);
  return MetadataService::NewStub(
      grpc::CreateInsecureChannelFromFd("ferry-test", fd.Release()));
}

grpc::Status ListOn(MetadataService::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  ListSegmentsRequest request;
  ListSegmentsResponse response;
  return stub->ListSegments(&ctx, request, &response);
}

class RpcServerTest : public ::testing::Test {
 protected:
  void Start(const RpcServerOptions& options) {
    auto server = RpcServer::Start("127.0.0.1:0", {&service_}, options);
    ASSERT_OK(server);
    server_ = std::move(*server);
    auto hp = ParseHostPort(server_->address());
    ASSERT_OK(hp);
    hp_ = *hp;
  }

  absl::Status Ask() {
    MetadataClient client(server_->address(), absl::Seconds(3));
    return client.List().status();
  }

  // The accept loop's time, for the tests that set options.clock to it.
  SimulatedClock clock_;
  MetadataServiceImpl service_;
  std::unique_ptr<RpcServer> server_;
  HostPort hp_;
};

TEST_F(RpcServerTest, RefusesConnectionsBeyondTheCapAtOnce) {
  RpcServerOptions o;
  o.max_connections = 4;
  o.max_connections_per_peer = 4;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  std::vector<UniqueFd> conns;
  int served = 0, closed = 0;
  for (int i = 0; i < 10; ++i) {
    conns.push_back(ConnectFrom("127.0.0.1", hp_));
    SendPreface(conns.back().get());
    switch (WaitAnswer(conns.back().get(), absl::Seconds(5))) {
      case Answer::kServed:
        ++served;
        break;
      case Answer::kClosed:
        ++closed;
        break;
      case Answer::kNone:
        break;
    }
  }
  EXPECT_EQ(served, 4);
  EXPECT_EQ(closed, 6);
  EXPECT_EQ(server_->stats().refused, 6u);
  EXPECT_EQ(server_->stats().max_connections, 4);
  conns.clear();
  // The slots come back once gRPC has closed its side.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::Status s = Ask();
  while (!s.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));  // Retry pace, not ordering.
    s = Ask();
  }
  EXPECT_OK(s);
}

// At the cap, connections that carried no call for a second go first,
// wherever they come from; a newcomer is refused only when every slot is
// in use and no address holds two more than its own.
TEST_F(RpcServerTest, UselessConnectionsAreShedFirst) {
  RpcServerOptions o;
  o.clock = &clock_;
  o.max_connections = 4;
  o.max_connections_per_peer = 4;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  auto used = StubFrom("127.0.0.2", hp_);
  ASSERT_TRUE(ListOn(used.get()).ok());
  std::vector<UniqueFd> idle;
  for (const char* ip : {"127.0.0.3", "127.0.0.4"}) {
    idle.push_back(ConnectFrom(ip, hp_));
    SendPreface(idle.back().get());
    ASSERT_EQ(WaitAnswer(idle.back().get(), absl::Seconds(5)), Answer::kServed);
  }
  // Calls that are answered with an error (here a method this server does
  // not have) do not make a connection worth its slot.
  auto unknown = PeerService::NewStub(grpc::CreateInsecureChannelFromFd(
      "ferry-test", ConnectFrom("127.0.0.5", hp_).Release()));
  auto call_unknown = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(3));
    ExchangeRequest request;
    ExchangeResponse response;
    return unknown->Exchange(&ctx, request, &response).error_code();
  };
  ASSERT_EQ(call_unknown(), grpc::StatusCode::UNIMPLEMENTED);
  // Within their grace the idle ones keep their slots.
  auto early = StubFrom("127.0.0.6", hp_);
  EXPECT_FALSE(ListOn(early.get()).ok());
  EXPECT_EQ(server_->stats().shed, 0u);
  clock_.Advance(absl::Seconds(1));
  std::vector<std::unique_ptr<MetadataService::Stub>> newcomers;
  for (const char* ip : {"127.0.0.6", "127.0.0.7", "127.0.0.8"}) {
    newcomers.push_back(StubFrom(ip, hp_));
    EXPECT_TRUE(ListOn(newcomers.back().get()).ok()) << ip;
  }
  EXPECT_EQ(server_->stats().shed, 3u);
  for (UniqueFd& fd : idle) EXPECT_TRUE(WaitClosed(fd.get(), absl::Seconds(5)));
  EXPECT_EQ(call_unknown(), grpc::StatusCode::UNAVAILABLE) << "not shed";
  EXPECT_TRUE(ListOn(used.get()).ok()) << "a connection in use was shed";
  // Four addresses, one useful connection each: a fifth waits its turn.
  const uint64_t refused = server_->stats().refused;
  auto late = StubFrom("127.0.0.9", hp_);
  EXPECT_FALSE(ListOn(late.get()).ok());
  EXPECT_GT(server_->stats().refused, refused);
  EXPECT_TRUE(ListOn(used.get()).ok());
}

// Max-min: a newcomer takes the slot of the address holding the most, when
// that is at least two more than its own; a small address keeps its share.
TEST_F(RpcServerTest, SlotsAreSharedFairlyAcrossAddresses) {
  RpcServerOptions o;
  o.clock = &clock_;
  o.max_connections = 6;
  o.max_connections_per_peer = 5;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  std::vector<std::unique_ptr<MetadataService::Stub>> hog;
  for (int i = 0; i < 5; ++i) {
    hog.push_back(StubFrom("127.0.0.2", hp_));
    ASSERT_TRUE(ListOn(hog.back().get()).ok());
  }
  auto small = StubFrom("127.0.0.3", hp_);
  ASSERT_TRUE(ListOn(small.get()).ok());
  clock_.Advance(absl::Seconds(10));  // None is new any more.
  auto first = StubFrom("127.0.0.4", hp_);
  EXPECT_TRUE(ListOn(first.get()).ok());
  auto second = StubFrom("127.0.0.3", hp_);
  EXPECT_TRUE(ListOn(second.get()).ok());
  EXPECT_EQ(server_->stats().shed, 2u);
  int hog_left = 0;
  for (auto& stub : hog) hog_left += ListOn(stub.get()).ok() ? 1 : 0;
  EXPECT_EQ(hog_left, 3);
  EXPECT_TRUE(ListOn(small.get()).ok());
  // The hog cannot take a slot back from addresses holding fewer.
  auto again = StubFrom("127.0.0.2", hp_);
  EXPECT_FALSE(ListOn(again.get()).ok());
  EXPECT_TRUE(ListOn(first.get()).ok());
  EXPECT_TRUE(ListOn(second.get()).ok());
  EXPECT_EQ(server_->stats().shed, 2u);
}

TEST_F(RpcServerTest, CapsEachPeerAddressSeparately) {
  RpcServerOptions o;
  o.max_connections = 8;
  o.max_connections_per_peer = 2;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  std::vector<UniqueFd> conns;
  std::vector<Answer> answers;
  for (const char* ip :
       {"127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"}) {
    conns.push_back(ConnectFrom(ip, hp_));
    SendPreface(conns.back().get());
    answers.push_back(WaitAnswer(conns.back().get(), absl::Seconds(5)));
  }
  EXPECT_EQ(answers[0], Answer::kServed);
  EXPECT_EQ(answers[1], Answer::kServed);
  EXPECT_EQ(answers[2], Answer::kClosed) << "third from one address";
  EXPECT_EQ(answers[3], Answer::kServed) << "another address has its own cap";
  EXPECT_EQ(answers[4], Answer::kServed);
  // 127.0.0.1, the client below, is a third address.
  EXPECT_OK(Ask());
}

// Clients that connect and only speak a little later (as gRPC clients do
// after their connect handshake) must be served however their first bytes
// interleave with other connections being accepted and handed over.
TEST_F(RpcServerTest, ServesClientsThatSpeakLate) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  constexpr int kClients = 20;
  std::vector<UniqueFd> conns;
  for (int i = 0; i < kClients; ++i) {
    conns.push_back(ConnectFrom("127.0.0.1", hp_));
  }
  int served = 0;
  for (int i = 0; i < kClients; ++i) {
    SendPreface(conns[static_cast<size_t>(i)].get());
    if (WaitAnswer(conns[static_cast<size_t>(i)].get(), absl::Seconds(5)) ==
        Answer::kServed) {
      ++served;
    }
    // Another connection accepted while the rest are still silent.
    conns.push_back(ConnectFrom("127.0.0.1", hp_));
  }
  EXPECT_EQ(served, kClients);
  EXPECT_EQ(server_->stats().refused, 0u);
}

TEST_F(RpcServerTest, DropsSilentConnectionsAfterTheHandshakeTimeout) {
  RpcServerOptions o;
  // Longer than the real time the test waits: only the clock can end it.
  o.handshake_timeout = absl::Minutes(1);
  o.clock = &clock_;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  UniqueFd silent = ConnectFrom("127.0.0.1", hp_);
  // Accepted after `silent` (the listen queue is in order): once it is
  // served, `silent` waits with its deadline set from the clock's now.
  UniqueFd probe = ConnectFrom("127.0.0.1", hp_);
  SendPreface(probe.get());
  ASSERT_EQ(WaitAnswer(probe.get(), absl::Seconds(5)), Answer::kServed);
  clock_.Advance(o.handshake_timeout - absl::Milliseconds(1));
  EXPECT_EQ(WaitAnswer(silent.get(), absl::Milliseconds(50)), Answer::kNone)
      << "dropped before its handshake timeout";
  EXPECT_EQ(server_->stats().handshake_timeouts, 0u);
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(WaitAnswer(silent.get(), absl::Seconds(10)), Answer::kClosed);
  EXPECT_EQ(server_->stats().handshake_timeouts, 1u);
  EXPECT_OK(Ask());
}

// Out of fds, the server sheds the queued connection (its client sees a
// close) and rests its listener for the back-off, 10 ms at first, on its
// clock.
TEST_F(RpcServerTest, RestsTheListenerWhenOutOfFds) {
  RpcServerOptions o;
  o.clock = &clock_;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  // Served: the accept loop runs and holds its spare fd. Kept open, so
  // that no fd of the server's is freed behind the limit below.
  UniqueFd first = ConnectFrom("127.0.0.1", hp_);
  SendPreface(first.get());
  ASSERT_EQ(WaitAnswer(first.get(), absl::Seconds(5)), Answer::kServed);
  // Made while fds are there, connected once they are not.
  UniqueFd shed = TcpSocket();
  UniqueFd late = TcpSocket();
  rlimit orig{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &orig), 0);
  const int lowest_free = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  rlimit none = orig;
  none.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  Connect(shed.get(), "127.0.0.1", hp_);
  const bool exhausted =
      Eventually([&] { return server_->stats().fd_exhausted >= 1; });
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &orig), 0);
  ASSERT_TRUE(exhausted) << "accept never ran out of fds";
  EXPECT_EQ(server_->stats().fd_exhausted, 1u);
  EXPECT_EQ(WaitAnswer(shed.get(), absl::Seconds(5)), Answer::kClosed);
  EXPECT_EQ(server_->stats().refused, 1u);
  Connect(late.get(), "127.0.0.1", hp_);
  SendPreface(late.get());
  clock_.Advance(absl::Milliseconds(9));
  EXPECT_EQ(WaitAnswer(late.get(), absl::Milliseconds(50)), Answer::kNone)
      << "accepted during the back-off";
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_EQ(WaitAnswer(late.get(), absl::Seconds(5)), Answer::kServed);
  EXPECT_EQ(server_->stats().fd_exhausted, 1u);
}

TEST_F(RpcServerTest, ClosesIdleConnections) {
  RpcServerOptions o;
  o.idle_timeout = absl::Milliseconds(500);
  ASSERT_NO_FATAL_FAILURE(Start(o));
  UniqueFd idle = ConnectFrom("127.0.0.1", hp_);
  SendPreface(idle.get());
  ASSERT_EQ(WaitAnswer(idle.get(), absl::Seconds(5)), Answer::kServed);
  // gRPC sends GOAWAY, then closes; read until the close.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool closed = false;
  while (!closed && absl::Now() < deadline) {
    closed = WaitAnswer(idle.get(), deadline - absl::Now()) == Answer::kClosed;
  }
  EXPECT_TRUE(closed);
}

TEST_F(RpcServerTest, ShutdownWithConnectionsInEveryState) {
  RpcServerOptions o;
  o.max_connections = 2;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  UniqueFd served = ConnectFrom("127.0.0.1", hp_);
  SendPreface(served.get());
  ASSERT_EQ(WaitAnswer(served.get(), absl::Seconds(5)), Answer::kServed);
  UniqueFd silent = ConnectFrom("127.0.0.1", hp_);
  UniqueFd refused = ConnectFrom("127.0.0.1", hp_);
  EXPECT_EQ(WaitAnswer(refused.get(), absl::Seconds(5)), Answer::kClosed);
  const absl::Time start = absl::Now();
  server_->Shutdown();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(WaitAnswer(silent.get(), absl::Seconds(5)), Answer::kClosed);
  server_->Shutdown();  // Idempotent.
}

TEST_F(RpcServerTest, ReportsAddressInUse) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  auto second = RpcServer::Start(server_->address(), {&service_});
  EXPECT_STATUS(second, absl::StatusCode::kUnavailable);
}

TEST_F(RpcServerTest, RejectsOptionsItCouldNotServeWith) {
  // Each of these used to be accepted and bent silently: a zero handshake
  // timeout closed every client before it spoke.
  auto bad = [&](auto change) {
    RpcServerOptions o;
    change(o);
    return RpcServer::Start("127.0.0.1:0", {&service_}, o).status();
  };
  EXPECT_STATUS(
      bad([](auto& o) { o.handshake_timeout = absl::ZeroDuration(); }),
      absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(bad([](auto& o) { o.idle_timeout = -absl::Seconds(1); }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(bad([](auto& o) { o.idle_timeout = absl::InfiniteDuration(); }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(bad([](auto& o) { o.max_connections = -1; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(bad([](auto& o) { o.max_threads = 0; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(bad([](auto& o) { o.max_streams_per_connection = 0; }),
                absl::StatusCode::kInvalidArgument);
  EXPECT_OK(bad([](auto&) {}));
}

TEST(RaiseFdLimitTest, RaisesTheSoftLimitToTheHardLimit) {
  rlimit orig{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &orig), 0);
  if (orig.rlim_max < 64) GTEST_SKIP() << "hard limit too low to lower";
  rlimit low = orig;
  low.rlim_cur = 32;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto raised = RaiseFdLimitToHard();
  rlimit now{};
  getrlimit(RLIMIT_NOFILE, &now);
  setrlimit(RLIMIT_NOFILE, &orig);
  ASSERT_OK(raised);
  EXPECT_EQ(*raised, orig.rlim_max);
  EXPECT_EQ(now.rlim_cur, orig.rlim_max);
}

}  // namespace
}  // namespace ferry::metadata
