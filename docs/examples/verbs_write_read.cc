// verbs_write_read: the smallest complete one-sided RDMA program -- one RC
// QP per process, an RDMA WRITE and an RDMA READ -- on nothing but
// libibverbs, and a TCP socket for the handshake. docs/verbs-example.md
// reads it beside ferry_write_read.cc, the same transfer on Ferry's API.
//
//   verbs_write_read --server [--port P] [--device NAME] [--gid_index N]
//   verbs_write_read --client HOST [--port P] [--device NAME] [--gid_index N]
//
// The client WRITEs a pattern into the server's buffer, READs it back into
// a second buffer of its own and compares; the server only checks, at the
// end, that the pattern arrived. Without RDMA hardware, run both under
// tools/softrnic-run. --port 0 makes the server pick a free port.
#include <arpa/inet.h>
#include <endian.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr size_t kBytes = 64 << 10;      // Several MTUs: several packets.
constexpr uint8_t kPort = 1;             // The device's first port.
constexpr uint32_t kMagic = 0x46575231;  // "FWR1": this program's handshake.
constexpr int kSocketTimeoutSec = 30;    // Bounds every socket wait.
constexpr auto kCompletionDeadline = std::chrono::seconds(5);

const char* role = "verbs_write_read";

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", role, what.c_str());
  std::exit(1);
}

// Verbs report errors two ways: an errno value returned (ibv_modify_qp,
// ibv_post_send, ibv_query_port), or -1 / NULL with errno set.
void Check(int rc, const std::string& what) {
  if (rc != 0) Fail(what + " failed: " + std::strerror(rc > 0 ? rc : errno));
}
template <typename T>
T* CheckPtr(T* p, const std::string& what) {
  if (p == nullptr) Fail(what + " failed: " + std::strerror(errno));
  return p;
}
int CheckFd(int fd, const std::string& what) {
  if (fd < 0) Fail(what + " failed: " + std::strerror(errno));
  return fd;
}

uint8_t Pattern(size_t i) { return static_cast<uint8_t>(i % 251); }

// Everything the peer needs to connect its QP to ours and to reach our
// buffer. Fixed size, integers big-endian on the wire.
struct QpInfo {
  uint32_t magic;
  uint32_t qpn;     // Our QP number (24 bits).
  uint32_t psn;     // The first packet sequence number we will send.
  uint32_t rkey;    // The key that lets the peer access `addr` (server).
  uint64_t addr;    // Our buffer's virtual address: RDMA uses raw addresses.
  uint64_t length;  // Its size.
  uint8_t gid[16];  // Our port's GID (RoCE: an IP address; IB: optional).
  uint16_t lid;     // Our port's LID (InfiniBand; 0 on RoCE).
  uint8_t mtu;      // Our port's active MTU (an enum ibv_mtu).
  uint8_t zero[5];  // Padding, sent as zeros.
};
static_assert(sizeof(QpInfo) == 56, "the handshake has no hidden padding");

// Host <-> network byte order: the same swap in both directions.
QpInfo Swapped(QpInfo m) {
  m.magic = htonl(m.magic);
  m.qpn = htonl(m.qpn);
  m.psn = htonl(m.psn);
  m.rkey = htonl(m.rkey);
  m.addr = htobe64(m.addr);
  m.length = htobe64(m.length);
  m.lid = htons(m.lid);
  return m;
}

void SendAll(int fd, const void* data, size_t n, const char* what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      Fail(std::string("sending ") + what + ": " + std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void RecvAll(int fd, void* data, size_t n, const char* what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) Fail(std::string("peer closed the socket before ") + what);
    if (k < 0) {
      Fail(std::string("waiting for ") + what + ": " +
           (errno == EAGAIN ? "timed out" : std::strerror(errno)));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

// SO_RCVTIMEO/SO_SNDTIMEO bound every recv, send and connect on `fd`.
int WithTimeouts(int fd) {
  timeval tv{kSocketTimeoutSec, 0};
  Check(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), "SO_RCVTIMEO");
  Check(setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv), "SO_SNDTIMEO");
  return fd;
}

int AcceptOne(int port) {
  int lfd = CheckFd(socket(AF_INET, SOCK_STREAM, 0), "socket");
  int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  sa.sin_port = htons(static_cast<uint16_t>(port));
  Check(bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), "bind");
  Check(listen(lfd, 1), "listen");
  socklen_t len = sizeof sa;
  Check(getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len),
        "getsockname");
  std::printf("server: listening on port %d\n", ntohs(sa.sin_port));
  std::fflush(stdout);
  pollfd p{lfd, POLLIN, 0};
  if (poll(&p, 1, kSocketTimeoutSec * 1000) != 1) Fail("no client came");
  int fd = CheckFd(accept(lfd, nullptr, nullptr), "accept");
  close(lfd);
  return WithTimeouts(fd);
}

int ConnectTo(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints,
                           &res)) {
    Fail(host + ": " + gai_strerror(rc));
  }
  int fd = WithTimeouts(CheckFd(socket(AF_INET, SOCK_STREAM, 0), "socket"));
  int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  Check(rc, "connect to " + host + ":" + std::to_string(port));
  return fd;
}

void CheckPeer(const QpInfo& m, uint64_t need_bytes) {
  static const uint8_t kNoGid[16] = {};
  if (m.magic != kMagic) Fail("handshake: the peer is not this program");
  if (m.qpn == 0 || m.qpn > 0xffffff || m.psn > 0xffffff) {
    Fail("handshake: QPN or PSN does not fit in 24 bits");
  }
  if (m.mtu < IBV_MTU_256 || m.mtu > IBV_MTU_4096) Fail("handshake: bad MTU");
  if (m.lid == 0 && std::memcmp(m.gid, kNoGid, 16) == 0) {
    Fail("handshake: the peer has neither a LID nor a GID");
  }
  if (m.length < need_bytes) Fail("handshake: the peer's buffer is too small");
}

// RESET -> INIT: which port the QP uses and what the peer may do through it.
void ToInit(ibv_qp* qp, bool server) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;  // Partition (IB) key: the default partition.
  a.port_num = kPort;
  // Checked with the MR's own rights on every incoming request: the
  // server's QP accepts WRITEs and READs; the client's accepts none.
  a.qp_access_flags =
      server ? IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ : 0;
  Check(ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                          IBV_QP_ACCESS_FLAGS),
        "ibv_modify_qp(INIT)");
}

// INIT -> RTR (ready to receive), then RTR -> RTS (ready to send).
void Connect(ibv_qp* qp, const QpInfo& self, const QpInfo& peer,
             int gid_index) {
  static const uint8_t kNoGid[16] = {};
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  // Both ports must carry every packet: the smaller of the two MTUs.
  a.path_mtu = static_cast<ibv_mtu>(std::min(self.mtu, peer.mtu));
  a.dest_qp_num = peer.qpn;  // RC: this QP talks to that one QP only.
  a.rq_psn = peer.psn;       // The PSN the peer's first packet will carry.
  a.max_dest_rd_atomic = 1;  // READs we serve at once as a responder.
  a.min_rnr_timer = 12;      // NAK delay if a SEND finds no RECV (0.64 ms).
  // The address vector: a LID within an IB subnet, a GID (a GRH on every
  // packet) on RoCE or when the peer has a GID.
  a.ah_attr.dlid = peer.lid;
  a.ah_attr.port_num = kPort;
  if (std::memcmp(peer.gid, kNoGid, 16) != 0) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
    a.ah_attr.grh.hop_limit = 1;  // One subnet: not routed further.
  }
  Check(ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                          IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER),
        "ibv_modify_qp(RTR)");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = self.psn;  // The PSN we told the peer.
  a.timeout = 14;       // ACK timeout: 4.096 us * 2^14 = 67 ms.
  a.retry_cnt = 7;      // Retransmissions before IBV_WC_RETRY_EXC_ERR.
  a.rnr_retry = 7;      // RNR retries (7: forever; no SENDs here anyway).
  a.max_rd_atomic = 1;  // READs we have in flight as initiator.
  Check(ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                          IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_MAX_QP_RD_ATOMIC),
        "ibv_modify_qp(RTS)");
}

// Posts one signaled RDMA WRITE or READ of kBytes between `local` and the
// peer's buffer, and polls its completion (with a deadline, yielding).
void RdmaAndWait(ibv_qp* qp, ibv_cq* cq, ibv_mr* mr, uint8_t* local,
                 const QpInfo& peer, ibv_wr_opcode op) {
  const char* name = op == IBV_WR_RDMA_WRITE ? "RDMA WRITE" : "RDMA READ";
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uintptr_t>(local);
  sge.length = kBytes;
  sge.lkey = mr->lkey;
  ibv_send_wr wr{};
  wr.wr_id = op;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;  // Ask for a completion.
  wr.wr.rdma.remote_addr = peer.addr;
  wr.wr.rdma.rkey = peer.rkey;
  ibv_send_wr* bad = nullptr;
  Check(ibv_post_send(qp, &wr, &bad),
        std::string("ibv_post_send(") + name + ")");
  const auto deadline = std::chrono::steady_clock::now() + kCompletionDeadline;
  ibv_wc wc{};
  for (;;) {
    int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) Fail("ibv_poll_cq failed");
    if (n == 1) break;
    if (std::chrono::steady_clock::now() > deadline) {
      Fail(std::string(name) + ": no completion within 5 s");
    }
    usleep(20);  // Never spin: a soft NIC needs this core too.
  }
  if (wc.status != IBV_WC_SUCCESS) {
    Fail(std::string(name) + " failed: " + ibv_wc_status_str(wc.status) +
         " (vendor error " + std::to_string(wc.vendor_err) + ")");
  }
  if (wc.wr_id != op) Fail("completion of an unknown work request");
}

}  // namespace

int main(int argc, char** argv) {
  bool server = false;
  std::string host, device;
  int port = 18515, gid_index = 0;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    bool has_value = i + 1 < argc;
    if (arg == "--server") {
      server = true;
    } else if (arg == "--client" && has_value) {
      host = argv[++i];
    } else if (arg == "--port" && has_value) {
      port = std::atoi(argv[++i]);
    } else if (arg == "--device" && has_value) {
      device = argv[++i];
    } else if (arg == "--gid_index" && has_value) {
      gid_index = std::atoi(argv[++i]);
    } else {
      Fail(
          "usage: --server | --client HOST, [--port P] [--device NAME] "
          "[--gid_index N]");
    }
  }
  if (server == !host.empty()) Fail("give exactly one of --server, --client");
  role = server ? "server" : "client";

  // 1. The device, its port and our GID.
  int num = 0;
  ibv_device** devices =
      CheckPtr(ibv_get_device_list(&num), "ibv_get_device_list");
  ibv_device* dev = nullptr;
  for (int i = 0; i < num && dev == nullptr; ++i) {
    if (device.empty() || device == ibv_get_device_name(devices[i]))
      dev = devices[i];
  }
  if (dev == nullptr)
    Fail(device.empty() ? "no RDMA device" : "no device " + device);
  ibv_context* ctx = CheckPtr(ibv_open_device(dev), "ibv_open_device");
  ibv_port_attr port_attr{};
  Check(ibv_query_port(ctx, kPort, &port_attr), "ibv_query_port");
  if (port_attr.state != IBV_PORT_ACTIVE) {
    Fail(std::string("port 1 is ") + ibv_port_state_str(port_attr.state));
  }
  ibv_gid gid{};
  Check(ibv_query_gid(ctx, kPort, gid_index, &gid),
        "ibv_query_gid(" + std::to_string(gid_index) + ")");

  // 2. Protection domain, registered memory, completion queue, RC QP.
  ibv_pd* pd = CheckPtr(ibv_alloc_pd(ctx), "ibv_alloc_pd");
  // Server: the WRITE's target. Client: the WRITE's source, then the READ's
  // destination (the second half), which the NIC writes: LOCAL_WRITE.
  std::vector<uint8_t> buf(server ? kBytes : 2 * kBytes, 0);
  const int access = server ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                  IBV_ACCESS_REMOTE_READ
                            : IBV_ACCESS_LOCAL_WRITE;
  ibv_mr* mr =
      CheckPtr(ibv_reg_mr(pd, buf.data(), buf.size(), access), "ibv_reg_mr");
  ibv_cq* cq =
      CheckPtr(ibv_create_cq(ctx, 4, nullptr, nullptr, 0), "ibv_create_cq");
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;  // Reliable connected: one-sided ops need it.
  init.cap.max_send_wr = 2;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = CheckPtr(ibv_create_qp(pd, &init), "ibv_create_qp");
  ToInit(qp, server);

  // 3. The handshake. The client speaks first; the server answers only once
  //    its QP can receive (RTR), so no request reaches a QP not ready for it.
  QpInfo self{};
  self.magic = kMagic;
  self.qpn = qp->qp_num;
  self.psn = std::random_device{}() & 0xffffff;
  self.rkey = server ? mr->rkey : 0;  // The client exposes nothing.
  self.addr = server ? reinterpret_cast<uintptr_t>(buf.data()) : 0;
  self.length = server ? buf.size() : 0;
  std::memcpy(self.gid, gid.raw, 16);
  self.lid = port_attr.lid;
  self.mtu = static_cast<uint8_t>(port_attr.active_mtu);
  QpInfo peer{}, wire = Swapped(self);
  int fd = server ? AcceptOne(port) : ConnectTo(host, port);
  if (server) {
    RecvAll(fd, &peer, sizeof peer, "the client's QP information");
    CheckPeer(peer = Swapped(peer), 0);
    Connect(qp, self, peer, gid_index);
    SendAll(fd, &wire, sizeof wire, "our QP information");
  } else {
    SendAll(fd, &wire, sizeof wire, "our QP information");
    RecvAll(fd, &peer, sizeof peer, "the server's QP information");
    CheckPeer(peer = Swapped(peer), kBytes);
    Connect(qp, self, peer, gid_index);
  }

  // 4. The client WRITEs, READs back, compares, and tells the server.
  char done = 'D';
  if (!server) {
    for (size_t i = 0; i < kBytes; ++i) buf[i] = Pattern(i);
    RdmaAndWait(qp, cq, mr, buf.data(), peer, IBV_WR_RDMA_WRITE);
    RdmaAndWait(qp, cq, mr, buf.data() + kBytes, peer, IBV_WR_RDMA_READ);
    if (std::memcmp(buf.data(), buf.data() + kBytes, kBytes) != 0) {
      Fail("the bytes READ back differ from those written");
    }
    SendAll(fd, &done, 1, "done");
    std::printf(
        "client: RDMA WRITE of %zu bytes to the server's 0x%llx (rkey 0x%x), "
        "RDMA READ back: equal (QP %u -> %u)\n",
        kBytes, static_cast<unsigned long long>(peer.addr), peer.rkey, self.qpn,
        peer.qpn);
  } else {
    // 5. The server did nothing meanwhile: no receive posted, no completion.
    RecvAll(fd, &done, 1, "the client's done");
    for (size_t i = 0; i < kBytes; ++i) {
      if (buf[i] != Pattern(i)) Fail("byte " + std::to_string(i) + " differs");
    }
    std::printf(
        "server: the client's RDMA WRITE put %zu bytes into my buffer with no "
        "work on my side; pattern verified (QP %u <- %u)\n",
        kBytes, self.qpn, peer.qpn);
  }
  close(fd);

  // 6. Tear down in reverse order of creation.
  Check(ibv_destroy_qp(qp), "ibv_destroy_qp");
  Check(ibv_destroy_cq(cq), "ibv_destroy_cq");
  Check(ibv_dereg_mr(mr), "ibv_dereg_mr");
  Check(ibv_dealloc_pd(pd), "ibv_dealloc_pd");
  Check(ibv_close_device(ctx), "ibv_close_device");
  ibv_free_device_list(devices);
  return 0;
}
