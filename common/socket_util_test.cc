#include "common/socket_util.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

TEST(ParseHostPortTest, AcceptsHostAndPort) {
  auto hp = ParseHostPort("127.0.0.1:8080");
  ASSERT_OK(hp);
  EXPECT_EQ(hp->host, "127.0.0.1");
  EXPECT_EQ(hp->port, 8080);
  EXPECT_EQ(hp->ToString(), "127.0.0.1:8080");
}

TEST(ParseHostPortTest, RejectsMalformed) {
  for (const char* bad : {"", "nohost", ":80", "host:", "h:99999", "h:x1"}) {
    EXPECT_EQ(ParseHostPort(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(SocketTest, ConnectWriteRead) {
  uint16_t port = 0;
  auto listener = ListenTcp("127.0.0.1", 0, &port);
  ASSERT_OK(listener);
  ASSERT_NE(port, 0);
  std::thread server([&] {
    UniqueFd conn(::accept(listener->get(), nullptr, nullptr));
    char buf[5];
    ASSERT_OK(ReadFull(conn.get(), buf, 5));
    ASSERT_OK(WriteFull(conn.get(), buf, 5));
  });
  auto fd = ConnectTcp({"127.0.0.1", port}, absl::Seconds(2));
  ASSERT_OK(fd);
  ASSERT_OK(WriteFull(fd->get(), "hello", 5));
  char back[5];
  ASSERT_OK(ReadFull(fd->get(), back, 5));
  EXPECT_EQ(std::string(back, 5), "hello");
  server.join();
  // The server closed: the next read reports a clean close.
  EXPECT_EQ(ReadFull(fd->get(), back, 1).code(), absl::StatusCode::kOutOfRange);
}

TEST(SocketTest, ConnectRefusedIsUnavailable) {
  uint16_t port = 0;
  { auto l = ListenTcp("127.0.0.1", 0, &port); }  // closed again: refused
  auto fd = ConnectTcp({"127.0.0.1", port}, absl::Seconds(2));
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable);
}

TEST(SocketTest, RecvTimeoutIsDeadlineExceeded) {
  uint16_t port = 0;
  auto listener = ListenTcp("127.0.0.1", 0, &port);
  ASSERT_OK(listener);
  auto fd = ConnectTcp({"127.0.0.1", port}, absl::Seconds(2));
  ASSERT_OK(fd);
  SetRecvTimeout(fd->get(), absl::Milliseconds(50));
  char c;
  EXPECT_EQ(ReadFull(fd->get(), &c, 1).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(ParseNumericEndpointTest, AcceptsIpv4AndBracketedIpv6) {
  auto sa = ParseNumericEndpoint("10.1.2.3:4567");
  ASSERT_OK(sa);
  EXPECT_EQ(sa->family(), AF_INET);
  EXPECT_EQ(sa->ToString(), "10.1.2.3:4567");
  EXPECT_FALSE(sa->IsLoopback());
  auto v6 = ParseNumericEndpoint("[fd00::1:2]:80");
  ASSERT_OK(v6);
  EXPECT_EQ(v6->family(), AF_INET6);
  EXPECT_EQ(v6->Host(), "fd00::1:2");
  EXPECT_EQ(v6->port(), 80);
  EXPECT_EQ(v6->ToString(), "[fd00::1:2]:80");
  ASSERT_OK_AND_ASSIGN(SockAddr lo6, ParseNumericEndpoint("[::1]:9"));
  EXPECT_TRUE(lo6.IsLoopback());
  ASSERT_OK_AND_ASSIGN(SockAddr lo4, ParseNumericEndpoint("127.3.2.1:9"));
  EXPECT_TRUE(lo4.IsLoopback());
  ASSERT_OK_AND_ASSIGN(SockAddr any, ParseNumericEndpoint("0.0.0.0:9"));
  EXPECT_TRUE(any.IsWildcard());
  // One key per IP whatever the family it came in.
  ASSERT_OK_AND_ASSIGN(SockAddr mapped,
                       ParseNumericEndpoint("[::ffff:10.1.2.3]:1"));
  EXPECT_EQ(mapped.IpKey(), sa->IpKey());
  EXPECT_NE(v6->IpKey(), sa->IpKey());
  ASSERT_OK_AND_ASSIGN(SockAddr mapped_any,
                       ParseNumericEndpoint("[::ffff:0.0.0.0]:9"));
  EXPECT_TRUE(mapped_any.IsWildcard());
  // Fairness groups: an IPv4 address alone, an IPv6 one by its /64.
  EXPECT_EQ(mapped.AddressGroupKey(), sa->AddressGroupKey());
  ASSERT_OK_AND_ASSIGN(SockAddr same64,
                       ParseNumericEndpoint("[fd00::9:9:9:9]:1"));
  ASSERT_OK_AND_ASSIGN(SockAddr other64,
                       ParseNumericEndpoint("[fd00:0:0:1::1:2]:1"));
  EXPECT_NE(same64.IpKey(), v6->IpKey());
  EXPECT_EQ(same64.AddressGroupKey(), v6->AddressGroupKey());
  EXPECT_NE(other64.AddressGroupKey(), v6->AddressGroupKey());
  ASSERT_OK_AND_ASSIGN(SockAddr next4, ParseNumericEndpoint("10.1.2.4:1"));
  EXPECT_NE(next4.AddressGroupKey(), sa->AddressGroupKey());
}

TEST(ParseNumericEndpointTest, RejectsNamesAndGarbageWithoutLookup) {
  for (const char* bad :
       {"", "nohost", "nohost:80", "localhost:80", ":80",
        "1.2.3.4:", "1.2.3.4:0", "1.2.3.4:65536", "1.2.3.4:x", "1.2.3:80",
        "1.2.3.4.5:80", "01234567890123456789:1", "1.2.3.4:80:80", "::1:80",
        "[::1:80", "[]:80", "[1.2.3.4]:80", "[fe80::1%eth0]:80"}) {
    auto sa = ParseNumericEndpoint(bad);
    EXPECT_STATUS(sa, absl::StatusCode::kInvalidArgument) << bad;
  }
  // The message names the input, shortened if it is long.
  EXPECT_NE(ParseNumericEndpoint("nohost").status().message().find("'nohost'"),
            absl::string_view::npos);
  const std::string huge(100000, 'x');
  EXPECT_LT(ParseNumericEndpoint(huge).status().message().size(), 200u);
}

TEST(ParseHostPortTest, BracketsIpv6) {
  ASSERT_OK_AND_ASSIGN(HostPort hp, ParseHostPort("[::1]:50"));
  EXPECT_EQ(hp.host, "::1");
  EXPECT_EQ(hp.ToString(), "[::1]:50");
  EXPECT_EQ(JoinHostPort("fd00::2", 7), "[fd00::2]:7");
  EXPECT_EQ(JoinHostPort("host-a", 7), "host-a:7");
}

TEST(ResolveHostTest, LiteralsAndNames) {
  ASSERT_OK_AND_ASSIGN(std::string v4, ResolveHost("10.0.0.1"));
  EXPECT_EQ(v4, "10.0.0.1");
  ASSERT_OK_AND_ASSIGN(std::string v6, ResolveHost("::1"));
  EXPECT_EQ(v6, "::1");
  // "localhost" is in every /etc/hosts; IPv4 is preferred.
  ASSERT_OK_AND_ASSIGN(std::string named, ResolveHost("localhost"));
  EXPECT_EQ(named, "127.0.0.1");
  EXPECT_STATUS(ResolveHost("no-such-host.invalid"),
                absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("localhost"));  // Only literals.
  EXPECT_TRUE(IsWildcardHost(""));
  EXPECT_TRUE(IsWildcardHost("::"));
  EXPECT_TRUE(IsWildcardHost("0.0.0.0"));
  EXPECT_FALSE(IsWildcardHost("10.0.0.1"));
}

TEST(SocketTest, Ipv6AndDualStackListeners) {
  // Every interface of both families: reachable over IPv4 and IPv6.
  uint16_t port = 0;
  ASSERT_OK_AND_ASSIGN(UniqueFd any, ListenTcp("", 0, &port));
  for (const char* host : {"127.0.0.1", "::1"}) {
    SCOPED_TRACE(host);
    ASSERT_OK_AND_ASSIGN(UniqueFd c,
                         ConnectTcp({host, port}, absl::Seconds(2)));
    UniqueFd s(::accept(any.get(), nullptr, nullptr));
    ASSERT_TRUE(s.valid());
    ASSERT_OK_AND_ASSIGN(SockAddr peer, PeerAddress(s.get()));
    // A dual-stack socket sees IPv4 peers as IPv4, not ::ffff:a.b.c.d.
    EXPECT_EQ(peer.Host(), host);
  }
  // An IPv6 literal.
  uint16_t port6 = 0;
  ASSERT_OK_AND_ASSIGN(UniqueFd l6, ListenTcp("::1", 0, &port6));
  ASSERT_OK_AND_ASSIGN(SockAddr local, LocalAddress(l6.get()));
  EXPECT_EQ(local.ToString(), JoinHostPort("::1", port6));
  ASSERT_OK_AND_ASSIGN(UniqueFd c6,
                       ConnectTcp({"::1", port6}, absl::Seconds(2)));
}

// A listener on 127.0.0.1 and the address to reach it at.
struct LoopbackListener {
  UniqueFd fd;
  SockAddr addr;
};
absl::StatusOr<LoopbackListener> ListenOnLoopback() {
  uint16_t port = 0;
  auto fd = ListenTcp("127.0.0.1", 0, &port);
  if (!fd.ok()) return fd.status();
  auto sa = ParseNumericEndpoint("127.0.0.1:" + std::to_string(port));
  if (!sa.ok()) return sa.status();
  return LoopbackListener{std::move(*fd), *sa};
}

// How a connect StartConnect began ended: its error (0: connected), or -1
// if it has not ended within 5 s.
int ConnectOutcome(int fd) {
  pollfd pfd{fd, POLLOUT, 0};
  return ::poll(&pfd, 1, 5000) == 1 ? SocketError(fd) : -1;
}

TEST(SocketTest, StartConnectCompletesOrFails) {
  ASSERT_OK_AND_ASSIGN(LoopbackListener listener, ListenOnLoopback());
  auto fd = StartConnect(listener.addr);
  ASSERT_OK(fd);
  EXPECT_EQ(ConnectOutcome(fd->get()), 0);
  listener.fd.Reset();  // Refused from now on.
  auto refused = StartConnect(listener.addr);
  if (refused.ok()) {  // Not refused at once: the error comes later.
    EXPECT_EQ(ConnectOutcome(refused->get()), ECONNREFUSED);
  } else {
    EXPECT_STATUS(refused, absl::StatusCode::kUnavailable);
  }
}

// A connection to loopback comes from the loopback source asked for (any
// port); any other source is left to the kernel.
TEST(SocketTest, StartConnectFromASourceAddress) {
  ASSERT_OK_AND_ASSIGN(LoopbackListener listener, ListenOnLoopback());
  for (const char* source : {"127.0.0.7", "198.51.100.77"}) {
    ASSERT_OK_AND_ASSIGN(SockAddr src,
                         ParseNumericEndpoint(std::string(source) + ":9"));
    auto fd = StartConnect(listener.addr, &src);
    ASSERT_OK(fd);
    ASSERT_EQ(ConnectOutcome(fd->get()), 0) << source;
    UniqueFd conn(::accept(listener.fd.get(), nullptr, nullptr));
    ASSERT_TRUE(conn.valid());
    ASSERT_OK_AND_ASSIGN(SockAddr peer, PeerAddress(conn.get()));
    // 198.51.100.77 (TEST-NET-2) is no loopback address: not bound.
    EXPECT_EQ(peer.Host(),
              std::string(source) == "127.0.0.7" ? "127.0.0.7" : "127.0.0.1");
    EXPECT_NE(peer.port(), 9);
  }
}

// A burst of connections far past 128 at once (a handshake storm) waits
// in the accept queue, not on the kernel's SYN retransmission.
TEST(SocketTest, AListenerHoldsABurstOfConnections) {
  constexpr int kBurst = 600;
  std::ifstream f("/proc/sys/net/core/somaxconn");
  int somaxconn = 0;
  if (!(f >> somaxconn) || somaxconn < kBurst) {
    GTEST_SKIP() << "net.core.somaxconn is " << somaxconn << ", below "
                 << kBurst;
  }
  ASSERT_OK_AND_ASSIGN(LoopbackListener listener, ListenOnLoopback());
  std::vector<UniqueFd> fds;
  for (int i = 0; i < kBurst; ++i) {
    auto fd = StartConnect(listener.addr);
    ASSERT_OK(fd) << i;
    fds.push_back(std::move(*fd));
  }
  // None accepted: each connected (within a SYN retransmission's 1 s) only
  // if the accept queue has room for it.
  int connected = 0;
  const absl::Time deadline = absl::Now() + absl::Milliseconds(500);
  for (const UniqueFd& fd : fds) {
    const int ms = static_cast<int>(std::max<int64_t>(
        0, absl::ToInt64Milliseconds(deadline - absl::Now())));
    pollfd pfd{fd.get(), POLLOUT, 0};
    if (::poll(&pfd, 1, ms) == 1 && SocketError(fd.get()) == 0) ++connected;
  }
  EXPECT_EQ(connected, kBurst);
}

}  // namespace
}  // namespace ferry
