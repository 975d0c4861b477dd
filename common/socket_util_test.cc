#include "common/socket_util.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <string>
#include <thread>

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

TEST(ParseIpv4EndpointTest, AcceptsDottedQuadAndPort) {
  auto sa = ParseIpv4Endpoint("10.1.2.3:4567");
  ASSERT_OK(sa);
  EXPECT_EQ(FormatSockaddr(*sa), "10.1.2.3:4567");
}

TEST(ParseIpv4EndpointTest, RejectsNamesAndGarbageWithoutLookup) {
  for (const char* bad : {"", "nohost", "nohost:80", "localhost:80", ":80",
                          "1.2.3.4:", "1.2.3.4:0", "1.2.3.4:65536", "1.2.3.4:x",
                          "1.2.3:80", "1.2.3.4.5:80", "01234567890123456789:1",
                          "1.2.3.4:80:80", "[::1]:80"}) {
    auto sa = ParseIpv4Endpoint(bad);
    EXPECT_STATUS(sa, absl::StatusCode::kInvalidArgument) << bad;
  }
  // The message names the input, shortened if it is long.
  EXPECT_NE(ParseIpv4Endpoint("nohost").status().message().find("'nohost'"),
            absl::string_view::npos);
  const std::string huge(100000, 'x');
  EXPECT_LT(ParseIpv4Endpoint(huge).status().message().size(), 200u);
}

TEST(SocketTest, StartConnectCompletesOrFails) {
  uint16_t port = 0;
  auto listener = ListenTcp("127.0.0.1", 0, &port);
  ASSERT_OK(listener);
  auto sa = ParseIpv4Endpoint("127.0.0.1:" + std::to_string(port));
  ASSERT_OK(sa);
  auto fd = StartConnect(*sa);
  ASSERT_OK(fd);
  pollfd pfd{fd->get(), POLLOUT, 0};
  ASSERT_EQ(::poll(&pfd, 1, 5000), 1);
  EXPECT_EQ(SocketError(fd->get()), 0);
  listener->Reset();  // Refused from now on.
  auto refused = StartConnect(*sa);
  if (refused.ok()) {  // Not refused at once: the error comes later.
    pollfd p2{refused->get(), POLLOUT, 0};
    ASSERT_EQ(::poll(&p2, 1, 5000), 1);
    EXPECT_EQ(SocketError(refused->get()), ECONNREFUSED);
  } else {
    EXPECT_STATUS(refused, absl::StatusCode::kUnavailable);
  }
}

}  // namespace
}  // namespace ferry
