#include "common/socket_util.h"

#include <sys/socket.h>

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

}  // namespace
}  // namespace ferry
