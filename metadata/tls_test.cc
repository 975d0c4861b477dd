// Mutual TLS on the real gRPC metadata and peer services over loopback,
// with certificates openssl makes for the test.
#include "metadata/tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/mutex.h"
#include "common/socket_util.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/metadata_client.h"
#include "metadata/metadata_service.h"
#include "metadata/peer_service.h"
#include "metadata/rpc_server.h"
#include "metadata/store_testing.h"
#include "metadata/tls_testing.h"

namespace ferry::metadata {
namespace {

using ::ferry::metadata::testing::MakeTestPki;
using ::ferry::metadata::testing::TestPki;

std::string TempDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(root != nullptr ? root : "/tmp") + "/" + name;
  std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str());
  return dir;
}

std::shared_ptr<const Tls> MustLoad(const TlsFiles& files) {
  auto tls = Tls::Load(files);
  EXPECT_OK(tls);
  return tls.ok() ? *tls : nullptr;
}

descriptor::SegmentDescriptor Segment(const std::string& name) {
  descriptor::SegmentDescriptor seg;
  seg.set_name(name);
  seg.set_incarnation(7);
  return seg;
}

// Forwards one connection at a time between its port and `to`, keeping a
// copy of every byte either way; for as long as it lives.
class RecordingProxy {
 public:
  explicit RecordingProxy(const std::string& to) : to_(to) {
    auto l = ListenTcp("127.0.0.1", 0, &port_);
    if (l.ok()) listener_ = std::move(*l);
    thread_ = std::thread([this] { Run(); });
  }
  ~RecordingProxy() {
    stop_ = true;
    thread_.join();
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  std::string seen() {
    MutexLock lock(&mu_);
    return seen_;
  }

 private:
  void Run() {
    const absl::Time end = absl::Now() + absl::Seconds(60);
    UniqueFd a, b;
    while (!stop_ && absl::Now() < end) {
      pollfd p[3] = {{listener_.get(), POLLIN, 0},
                     {a.get(), POLLIN, 0},
                     {b.get(), POLLIN, 0}};
      if (::poll(p, 3, 20) <= 0) continue;
      if (p[0].revents & POLLIN) {
        a.Reset(::accept(listener_.get(), nullptr, nullptr));
        auto hp = ParseHostPort(to_);
        auto c = hp.ok() ? ConnectTcp(*hp, absl::Seconds(2)) : hp.status();
        b = c.ok() ? std::move(*c) : UniqueFd();
      }
      for (int i = 1; i <= 2; ++i) {
        if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buf[65536];
        const int from = i == 1 ? a.get() : b.get();
        const int dst = i == 1 ? b.get() : a.get();
        const ssize_t n = ::recv(from, buf, sizeof(buf), 0);
        if (n <= 0 || !WriteFull(dst, buf, n).ok()) {
          a.Reset();
          b.Reset();
          break;
        }
        MutexLock lock(&mu_);
        seen_.append(buf, n);
      }
    }
  }

  const std::string to_;
  uint16_t port_ = 0;
  UniqueFd listener_;
  std::atomic<bool> stop_{false};
  Mutex mu_;
  std::string seen_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto pki = MakeTestPki(TempDir("pki"));
    ASSERT_OK(pki);
    pki_ = new TestPki(*pki);
  }
  static void TearDownTestSuite() { delete pki_; }

  // A metadata and peer service with mutual TLS from `files` (none: plain).
  void Serve(const TlsFiles* files) {
    peer_.SetNotifyHandler([this](const NotifyRequest&, const std::string&) {
      ++notified_;
      return absl::OkStatus();
    });
    RpcServerOptions o;
    if (files != nullptr) o.tls = MustLoad(*files);
    ASSERT_OK_AND_ASSIGN(
        server_, RpcServer::Start("127.0.0.1:0", {&service_, &peer_}, o));
  }

  static TestPki* pki_;
  MetadataServiceImpl service_;
  PeerServiceImpl peer_;
  std::unique_ptr<RpcServer> server_;
  std::atomic<int> notified_{0};  // Written on a gRPC thread.
};
TestPki* TlsTest::pki_ = nullptr;

TEST_F(TlsTest, LoadNamesWhatIsWrong) {
  ASSERT_OK_AND_ASSIGN(auto none, Tls::Load({}));
  EXPECT_EQ(none, nullptr);
  TlsFiles name_only;
  name_only.server_name = "ferry.test";  // Not TLS: refused, not plaintext.
  EXPECT_STATUS(Tls::Load(name_only), absl::StatusCode::kInvalidArgument);
  TlsFiles partial = pki_->node;
  partial.key_file.clear();
  EXPECT_STATUS(Tls::Load(partial), absl::StatusCode::kInvalidArgument);
  TlsFiles missing = pki_->node;
  missing.cert_file = "/nonexistent/cert.pem";
  absl::Status s = Tls::Load(missing).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "/nonexistent/cert.pem")) << s;
  TlsFiles swapped = pki_->node;
  std::swap(swapped.cert_file, swapped.key_file);  // A key is no cert.
  EXPECT_STATUS(Tls::Load(swapped), absl::StatusCode::kInvalidArgument);
  TlsFiles endless = pki_->node;
  endless.ca_file = "/dev/zero";  // Bounded read, then refused.
  s = Tls::Load(endless).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "larger than")) << s;
  EXPECT_OK(Tls::Load(pki_->node));
}

// A certificate names the segments its holder may publish (tls.h): a
// client whose certificate names "prefill-*" publishes prefill-0 and not
// decode-0, one that names none publishes nothing, and the refusal says
// what to add. Reading is not bound: any client of the CA reads.
TEST_F(TlsTest, ACertificatePublishesOnlyTheSegmentsItNames) {
  Serve(&pki_->node);
  MetadataClient prefill(server_->address(), absl::Seconds(3), "",
                         MustLoad(pki_->prefill_only));
  ASSERT_OK(prefill.Put(LeasedPutOf(Segment("prefill-0"))));
  absl::Status s = prefill.Put(LeasedPutOf(Segment("decode-0"))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "URI:ferry-segment:decode-0"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "it names prefill-*")) << s;
  MetadataClient unnamed(server_->address(), absl::Seconds(3), "",
                         MustLoad(pki_->no_segments));
  s = unnamed.Put(LeasedPutOf(Segment("prefill-1"))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "it names none")) << s;
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got,
                       unnamed.Get("prefill-0"));
  EXPECT_EQ(got.name(), "prefill-0");
  MetadataClient any(server_->address(), absl::Seconds(3), "",
                     MustLoad(pki_->node));
  EXPECT_OK(any.Put(LeasedPutOf(Segment("decode-0"))));
  ASSERT_OK_AND_ASSIGN(auto names, any.List());
  EXPECT_EQ(names.size(), 2u) << "a refused Put stored something";
}

// Only a client with a certificate from the cluster CA is served, and it
// talks only to a server with one.
TEST_F(TlsTest, ServesOnlyClientsOfTheClusterCa) {
  Serve(&pki_->node);
  MetadataClient good(server_->address(), absl::Seconds(3), "",
                      MustLoad(pki_->node));
  ASSERT_OK(good.Put(LeasedPutOf(Segment("a"))));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, good.Get("a"));
  EXPECT_EQ(got.incarnation(), 7u);

  MetadataClient plain(server_->address(), absl::Seconds(3));
  EXPECT_STATUS(plain.Get("a"), absl::StatusCode::kUnavailable);
  EXPECT_STATUS(plain.Put(LeasedPutOf(Segment("b"))),
                absl::StatusCode::kUnavailable);
  // A certificate from another CA, presented to a server it trusts.
  TlsFiles impostor = pki_->rogue;
  impostor.ca_file = pki_->node.ca_file;
  MetadataClient rogue(server_->address(), absl::Seconds(3), "",
                       MustLoad(impostor));
  EXPECT_STATUS(rogue.Get("a"), absl::StatusCode::kUnavailable);
  EXPECT_STATUS(rogue.Put(LeasedPutOf(Segment("b"))),
                absl::StatusCode::kUnavailable);
  PeerClient peer(absl::Seconds(3), PeerClient::kMaxStubs, "",
                  MustLoad(impostor));
  EXPECT_STATUS(peer.Notify(server_->address(), "x", "kv-ready", "m", "", 0),
                absl::StatusCode::kUnavailable);
  ASSERT_OK_AND_ASSIGN(auto names, good.List());
  EXPECT_EQ(names.size(), 1u) << "a refused Put stored nothing";
  PeerClient ok_peer(absl::Seconds(3), PeerClient::kMaxStubs, "",
                     MustLoad(pki_->node));
  EXPECT_EQ(notified_, 0);
  EXPECT_OK(ok_peer.Notify(server_->address(), "x", "kv-ready", "m", "", 0));
  EXPECT_EQ(notified_, 1);
}

// The TLS port is served by RpcServer's own accept loop, as the plaintext
// one is: after accept runs out of fds it rests, sheds, and serves again
// (gRPC's own listener stopped for good after one EMFILE).
TEST_F(TlsTest, RecoversFromFdExhaustion) {
  Serve(&pki_->node);
  auto hp = ParseHostPort(server_->address());
  ASSERT_OK(hp);
  MetadataClient before(server_->address(), absl::Seconds(3), "",
                        MustLoad(pki_->node));
  ASSERT_OK(before.Put(LeasedPutOf(Segment("a"))));
  EXPECT_GE(server_->stats().accepted, 1u) << "not the accept loop's";
  // Made while fds are there, connected once they are not.
  std::vector<UniqueFd> flood;
  for (int i = 0; i < 4; ++i) {
    flood.emplace_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  }
  rlimit orig{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &orig), 0);
  const int lowest_free = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lowest_free, 0);
  ::close(lowest_free);
  rlimit none = orig;
  none.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(hp->port);
  inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  for (UniqueFd& fd : flood) {
    ::connect(fd.get(), reinterpret_cast<sockaddr*>(&dst), sizeof(dst));
  }
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (server_->stats().fd_exhausted == 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &orig), 0);
  ASSERT_GE(server_->stats().fd_exhausted, 1u) << "accept never ran out";
  flood.clear();
  MetadataClient after(server_->address(), absl::Seconds(5), "",
                       MustLoad(pki_->node));
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor got, after.Get("a"));
  EXPECT_EQ(got.incarnation(), 7u);
}

// A client does not talk to a server whose certificate another CA signed,
// or whose certificate does not carry the name it expects.
TEST_F(TlsTest, ClientChecksTheServer) {
  TlsFiles impostor = pki_->rogue;
  impostor.ca_file = pki_->node.ca_file;  // Would accept cluster clients.
  Serve(&impostor);
  MetadataClient c(server_->address(), absl::Seconds(3), "",
                   MustLoad(pki_->node));
  EXPECT_STATUS(c.Put(LeasedPutOf(Segment("a"))),
                absl::StatusCode::kUnavailable);
  server_->Shutdown();

  Serve(&pki_->node);
  TlsFiles named = pki_->node;
  named.server_name = "ferry.test";  // In the certificate.
  MetadataClient by_name(server_->address(), absl::Seconds(3), "",
                         MustLoad(named));
  EXPECT_OK(by_name.Put(LeasedPutOf(Segment("a"))));
  named.server_name = "other.test";  // Not in it.
  MetadataClient wrong_name(server_->address(), absl::Seconds(3), "",
                            MustLoad(named));
  EXPECT_STATUS(wrong_name.Get("a"), absl::StatusCode::kUnavailable);
}

// What crosses the network is not readable: the token and the segment
// name are in the recorded bytes without TLS and not with it.
TEST_F(TlsTest, NothingReadableOnTheWire) {
  const std::string token = "wire-secret-token-0123456789";
  const std::string name = "segment-name-on-the-wire";
  service_.SetAuthToken(token);
  for (bool tls : {false, true}) {
    Serve(tls ? &pki_->node : nullptr);
    std::string seen;
    {
      RecordingProxy proxy(server_->address());
      TlsFiles named = pki_->node;
      named.server_name = "ferry.test";
      MetadataClient c(proxy.address(), absl::Seconds(3), token,
                       tls ? MustLoad(named) : nullptr);
      ASSERT_OK(c.Put(LeasedPutOf(Segment(name))));
      ASSERT_OK(c.Get(name));
      seen = proxy.seen();
    }
    EXPECT_GT(seen.size(), 100u);
    EXPECT_EQ(absl::StrContains(seen, token), !tls) << "tls=" << tls;
    EXPECT_EQ(absl::StrContains(seen, name), !tls) << "tls=" << tls;
    server_->Shutdown();
  }
}

}  // namespace
}  // namespace ferry::metadata
