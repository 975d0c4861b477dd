// A client that opens calls and then stops reading must not freeze a
// service for everyone else (issue 26, failure 1). The stuck reader here
// speaks raw HTTP/2: it announces a stream receive window of zero, so no
// response can reach it, and keeps its calls open. With gRPC's synchronous
// API each such call held a server thread until the thread cap was
// reached, and every other caller got RESOURCE_EXHAUSTED.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/metadata_client.h"
#include "metadata/metadata_service.h"
#include "metadata/peer_service.h"
#include "metadata/rpc_server.h"
#include "metadata/segment_store.h"
#include "metadata/store_testing.h"

namespace ferry::metadata {
namespace {

constexpr char kToken[] = "slow-client-test-token-0123456789";
// Two connections of 32 calls each: the calls one client may hold under
// the server's default limits (32 streams per connection), and as many as
// the synchronous server had threads (64).
constexpr int kConnections = 2;
constexpr int kStreamsPerConnection = 32;
constexpr char kAttacker[] = "127.0.0.2";

void AppendInt(std::string* out, uint8_t first, int prefix_bits, uint64_t v) {
  const uint64_t max = (uint64_t{1} << prefix_bits) - 1;
  if (v < max) {
    out->push_back(static_cast<char>(first | v));
    return;
  }
  out->push_back(static_cast<char>(first | max));
  v -= max;
  while (v >= 128) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// HPACK "literal header field without indexing, new name", no Huffman.
void AppendHeader(std::string* out, const std::string& name,
                  const std::string& value) {
  out->push_back(0);
  AppendInt(out, 0, 7, name.size());
  out->append(name);
  AppendInt(out, 0, 7, value.size());
  out->append(value);
}

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream,
                  const std::string& payload) {
  std::string f;
  const uint32_t len = payload.size();
  f.push_back(static_cast<char>(len >> 16));
  f.push_back(static_cast<char>(len >> 8));
  f.push_back(static_cast<char>(len));
  f.push_back(static_cast<char>(type));
  f.push_back(static_cast<char>(flags));
  for (int shift = 24; shift >= 0; shift -= 8) {
    f.push_back(static_cast<char>(stream >> shift));
  }
  return f + payload;
}

constexpr uint8_t kData = 0, kHeaders = 1, kRstStream = 3, kSettings = 4,
                  kPing = 6;
constexpr uint8_t kAck = 1, kEndStream = 1, kEndHeaders = 4;

// One HTTP/2 connection that opens `streams` calls of `path` with
// `request` and never lets a response byte in.
class StuckReader {
 public:
  // From kAttacker, so that the service tells it from the test's own
  // clients (on 127.0.0.1) as a remote attacker would be told apart.
  StuckReader(uint16_t port, const std::string& path,
              const std::string& request, const std::string& token, int streams,
              const char* source = kAttacker) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in from{};
    from.sin_family = AF_INET;
    ::inet_pton(AF_INET, source, &from.sin_addr);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof(from));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ =
        ::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
    std::string out = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    // SETTINGS_ENABLE_PUSH = 0, SETTINGS_INITIAL_WINDOW_SIZE = 0.
    out += Frame(kSettings, 0, 0,
                 std::string("\x00\x02\x00\x00\x00\x00"
                             "\x00\x04\x00\x00\x00\x00",
                             12));
    std::string message(5, '\0');
    message[1] = static_cast<char>(request.size() >> 24);
    message[2] = static_cast<char>(request.size() >> 16);
    message[3] = static_cast<char>(request.size() >> 8);
    message[4] = static_cast<char>(request.size());
    message += request;
    for (int i = 0; i < streams; ++i) {
      const uint32_t id = 1 + 2 * i;
      std::string block;
      AppendHeader(&block, ":method", "POST");
      AppendHeader(&block, ":scheme", "http");
      AppendHeader(&block, ":path", path);
      AppendHeader(&block, ":authority", "localhost");
      AppendHeader(&block, "content-type", "application/grpc");
      AppendHeader(&block, "te", "trailers");
      if (!token.empty()) {
        AppendHeader(&block, "authorization", absl::StrCat("Bearer ", token));
      }
      out += Frame(kHeaders, kEndHeaders, id, block);
      out += Frame(kData, kEndStream, id, message);
    }
    connected_ = connected_ && Send(out);
    reader_ = std::thread([this] { ReadLoop(); });
  }
  ~StuckReader() {
    stop_ = true;
    reader_.join();
    ::close(fd_);
  }

  bool connected() const { return connected_; }
  // Streams the server has answered with headers, and streams it has
  // ended (trailers or a reset): a stuck call has the first, not the
  // second.
  int answered() const { return answered_.load(); }
  int ended() const { return ended_.load(); }

 private:
  bool Send(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n =
          ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += n;
    }
    return true;
  }

  // Acknowledges the server's SETTINGS and PINGs, so that the connection
  // stays healthy: only the receive window is withheld.
  void ReadLoop() {
    std::string in;
    char buf[16384];
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return;
      in.append(buf, n);
      while (in.size() >= 9) {
        const size_t len =
            (uint8_t(in[0]) << 16) | (uint8_t(in[1]) << 8) | uint8_t(in[2]);
        if (in.size() < 9 + len) break;
        const uint8_t type = in[3], flags = in[4];
        const std::string payload = in.substr(9, len);
        if (type == kSettings && !(flags & kAck)) {
          Send(Frame(kSettings, kAck, 0, ""));
        } else if (type == kPing && !(flags & kAck)) {
          Send(Frame(kPing, kAck, 0, payload));
        } else if (type == kHeaders) {
          if (flags & kEndStream) {
            ++ended_;
          } else {
            ++answered_;
          }
        } else if (type == kRstStream) {
          ++ended_;
        }
        in.erase(0, 9 + len);
      }
    }
  }

  int fd_ = -1;
  bool connected_ = false;
  std::atomic<bool> stop_{false};
  std::atomic<int> answered_{0};
  std::atomic<int> ended_{0};
  std::thread reader_;
};

struct Case {
  const char* name;
  bool with_token;
};

class SlowClientTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    token_ = GetParam().with_token ? kToken : "";
    service_.SetAuthToken(token_);
    peer_.SetAuthToken(token_);
    peer_.SetExchangeHandler(
        "echo",
        [](const std::string&, const std::string& payload)
            -> absl::StatusOr<std::string> { return payload; });
    ASSERT_OK_AND_ASSIGN(server_,
                         RpcServer::Start("127.0.0.1:0", {&service_, &peer_}));
    client_ = std::make_unique<MetadataClient>(server_->address(),
                                               absl::Seconds(5), token_);
    peers_ = std::make_unique<PeerClient>(absl::Seconds(5),
                                          PeerClient::kMaxStubs, token_);
    descriptor::SegmentDescriptor seg;
    seg.set_name("victim");
    seg.set_incarnation(7);
    auto* t = seg.add_transports();
    t->set_transport("tcp");
    t->set_address("127.0.0.1:5000");
    ASSERT_OK(client_->Put(LeasedPutOf(seg)));
  }

  // What every other caller does while the stuck reader sits there.
  void ExpectServed(const char* when) {
    for (int i = 0; i < 10; ++i) {
      auto got = client_->Get("victim");
      ASSERT_TRUE(got.ok()) << when << ", call " << i << ": " << got.status();
      auto names = client_->List();
      ASSERT_TRUE(names.ok()) << when << ": " << names.status();
      auto echo = peers_->Exchange(server_->address(), "echo", "caller", "hi");
      ASSERT_TRUE(echo.ok()) << when << ": " << echo.status();
      EXPECT_EQ(*echo, "hi");
    }
  }

  // Opens the stuck reader's calls and waits until the server has taken
  // them all up (answered their headers) without ending any.
  void StartStuckReaders(const std::string& path, const std::string& request,
                         const std::string& token) {
    for (int c = 0; c < kConnections; ++c) {
      readers_.push_back(std::make_unique<StuckReader>(
          server_->port(), path, request, token, kStreamsPerConnection));
      ASSERT_TRUE(readers_.back()->connected());
    }
  }
  // The attack: a token holder (in the token configuration) holds every
  // call it may open on `path`; everyone else is served meanwhile and
  // after it leaves.
  void HoldCallsAndExpectOthersServed(const std::string& path,
                                      const std::string& request) {
    ASSERT_NO_FATAL_FAILURE(StartStuckReaders(path, request, token_));
    const int calls = kConnections * kStreamsPerConnection;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Answered() + Ended() < calls && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    // The server took every call and could finish none: the reader holds
    // them all, as the attack needs. (The synchronous server refused the
    // last one: it keeps a thread to poll with.)
    EXPECT_EQ(Answered(), calls);
    EXPECT_EQ(Ended(), 0);
    ASSERT_NO_FATAL_FAILURE(ExpectServed("while the stuck reader stays"));
    // Its answered calls still hold its share, though no thread: one more
    // from it is refused at once (RESOURCE_EXHAUSTED, in trailers).
    StuckReader more(server_->port(), path, request, token_, 1);
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (more.ended() == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(more.ended(), 1);
    EXPECT_EQ(more.answered(), 0);
    readers_.clear();
    ASSERT_NO_FATAL_FAILURE(ExpectServed("after it left"));
  }
  int Answered() const {
    int n = 0;
    for (const auto& r : readers_) n += r->answered();
    return n;
  }
  int Ended() const {
    int n = 0;
    for (const auto& r : readers_) n += r->ended();
    return n;
  }

  std::string token_;
  MetadataServiceImpl service_;
  PeerServiceImpl peer_;
  std::unique_ptr<RpcServer> server_;
  std::unique_ptr<MetadataClient> client_;
  std::unique_ptr<PeerClient> peers_;
  std::vector<std::unique_ptr<StuckReader>> readers_;
};

TEST_P(SlowClientTest, StuckReaderOfMetadataCallsFreezesNothing) {
  GetSegmentRequest req;
  req.set_name("victim");
  ASSERT_NO_FATAL_FAILURE(HoldCallsAndExpectOthersServed(
      "/ferry.metadata.MetadataService/GetSegment", req.SerializeAsString()));
}

TEST_P(SlowClientTest, StuckReaderOfPeerCallsFreezesNothing) {
  ExchangeRequest req;
  req.set_transport("echo");
  req.set_from_segment("attacker");
  req.set_payload("x");
  ASSERT_NO_FATAL_FAILURE(HoldCallsAndExpectOthersServed(
      "/ferry.metadata.PeerService/Exchange", req.SerializeAsString()));
}

// Without the token, the reader's calls end at once (UNAUTHENTICATED, in
// trailers, which no window holds back) and take nothing.
TEST_P(SlowClientTest, CallsWithoutTheTokenEndAtOnce) {
  if (token_.empty()) GTEST_SKIP() << "no token in this configuration";
  GetSegmentRequest req;
  req.set_name("victim");
  ASSERT_NO_FATAL_FAILURE(StartStuckReaders(
      "/ferry.metadata.MetadataService/GetSegment", req.SerializeAsString(),
      /*token=*/""));
  const int calls = kConnections * kStreamsPerConnection;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Ended() < calls && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Ended(), calls);
  ASSERT_NO_FATAL_FAILURE(ExpectServed("beside refused callers"));
}

// Whether the service's admitted calls come to `calls` within 10 s: a call
// is over only once gRPC is done with it, a moment after its client has
// the answer.
bool CallsSettleAt(MetadataServiceImpl& service, int calls) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (service.CallsForTesting() != calls && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return service.CallsForTesting() == calls;
}

// Many addresses, each holding its share of calls with responses it never
// reads, filled the pool (a probe had 16 addresses take all 1,024 calls).
// Now a newcomer takes the slot of a waiting call from whoever holds the
// most, when that is two more than its own: the reader sees that call
// reset, and everyone else is served.
TEST(SlowClientFairnessTest, ManyAddressesCannotTakeEveryCall) {
  SegmentStore store;
  SimulatedClock clock;
  CallPoolOptions pool;
  pool.max_calls = 8;
  pool.max_calls_per_caller = 4;
  pool.clock = &clock;  // Times how long responses wait (cancel_after).
  MetadataServiceImpl service(&store, pool);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<RpcServer> server,
                       RpcServer::Start("127.0.0.1:0", {&service}));
  MetadataClient client(server->address(), absl::Seconds(5));
  descriptor::SegmentDescriptor seg;
  seg.set_name("victim");
  seg.set_incarnation(7);
  ASSERT_OK(client.Put(LeasedPutOf(seg)));
  GetSegmentRequest req;
  req.set_name("victim");
  // The Put's call is over only once gRPC is done with it, a moment after
  // its client has the answer.
  auto settled = [&](int calls) { return CallsSettleAt(service, calls); };
  ASSERT_TRUE(settled(0));
  std::vector<std::unique_ptr<StuckReader>> readers;
  for (const char* from : {"127.0.0.2", "127.0.0.3"}) {
    readers.push_back(std::make_unique<StuckReader>(
        server->port(), "/ferry.metadata.MetadataService/GetSegment",
        req.SerializeAsString(), "", 4, from));
    ASSERT_TRUE(readers.back()->connected());
  }
  auto held = [&] { return readers[0]->answered() + readers[1]->answered(); };
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (held() < 8 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(held(), 8) << "the readers do not fill the pool";
  ASSERT_TRUE(settled(8));
  // Responses just made ready are not cancelled: a client that reads
  // gets them in a round trip.
  auto early = client.Get("victim");
  EXPECT_EQ(early.status().code(), absl::StatusCode::kResourceExhausted)
      << early.status();
  clock.Advance(pool.cancel_after);
  for (int i = 0; i < 10; ++i) {
    auto got = client.Get("victim");
    ASSERT_TRUE(got.ok()) << "call " << i << ": " << got.status();
    // One reader's call cancelled (the first time) and this one over.
    ASSERT_TRUE(settled(7)) << "call " << i;
  }
  EXPECT_GE(readers[0]->ended() + readers[1]->ended(), 1)
      << "no waiting call was cancelled";
  // A third reader takes slots while another holds two more than it
  // would, and no further: the first while there is room, one more by
  // cancelling a call of the reader that still holds 4.
  StuckReader third(server->port(),
                    "/ferry.metadata.MetadataService/GetSegment",
                    req.SerializeAsString(), "", 4, "127.0.0.4");
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (third.answered() + third.ended() < 4 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(third.answered() + third.ended(), 4);
  EXPECT_EQ(third.answered(), 2) << "more or less than its share";
  EXPECT_EQ(third.ended(), 2);
}

// A call refused at admission (the pool full) is retried by the client
// within its deadline (ChannelArgs' retry policy): once the slot is free it
// goes through, where it used to fail RESOURCE_EXHAUSTED at once.
TEST(SlowClientFairnessTest, ACallRefusedAtAdmissionIsRetried) {
  SegmentStore store;
  CallPoolOptions pool;
  pool.max_calls = 1;
  MetadataServiceImpl service(&store, pool);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<RpcServer> server,
                       RpcServer::Start("127.0.0.1:0", {&service}));
  MetadataClient client(server->address(), absl::Seconds(5));
  descriptor::SegmentDescriptor seg;
  seg.set_name("busy");
  seg.set_incarnation(7);
  ASSERT_OK(client.Put(LeasedPutOf(seg)));
  // The Put's call is over only once gRPC is done with it.
  ASSERT_TRUE(CallsSettleAt(service, 0));
  GetSegmentRequest req;
  req.set_name("busy");
  auto reader = std::make_unique<StuckReader>(
      server->port(), "/ferry.metadata.MetadataService/GetSegment",
      req.SerializeAsString(), "", 1, "127.0.0.2");
  ASSERT_TRUE(reader->connected());
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (reader->answered() < 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(reader->answered(), 1) << "the reader does not hold the pool";
  std::thread release([&] {
    absl::SleepFor(absl::Milliseconds(300));
    reader.reset();  // Its call ends with its connection.
  });
  const absl::Time start = absl::Now();
  auto got = client.Get("busy");
  release.join();
  EXPECT_TRUE(got.ok()) << got.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250)) << "not refused";
}

INSTANTIATE_TEST_SUITE_P(Configs, SlowClientTest,
                         ::testing::Values(Case{"default", false},
                                           Case{"token", true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace ferry::metadata
