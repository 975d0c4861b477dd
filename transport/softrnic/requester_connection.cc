// The requester's outgoing connection: dialing the peer's listener with a
// HELLO (proven under a cluster token), the thread that reads the peer's
// responses, and connecting and disconnecting a QP as it changes state.
#include <atomic>
#include <cstdio>
#include <string>

#include "transport/softrnic/datapath.h"
#include "transport/softrnic/hello_auth.h"
#include "transport/softrnic/requester.h"

namespace softrnic {
namespace {

constexpr int kDialTimeoutMs = 1000;

void ResponseLoop(std::shared_ptr<Qp> qp, std::shared_ptr<Connection> conn) {
  SocketSource src(conn.get());
  uint8_t hdr[kHeaderBytes];
  while (!conn->closed()) {
    Frame f;
    if (!conn->Read(hdr, sizeof(hdr)) || !DecodeFrame(hdr, kMaxMsgSize, &f)) {
      break;
    }
    if (f.type == FrameType::kChallenge) {
      // The peer's listener wants the cluster token's proof, and this
      // process has no token: the HELLO is refused.
      static std::atomic<bool> told{false};
      if (!told.exchange(true)) {
        std::fprintf(stderr,
                     "softrnic: %s: a peer's device asks for the cluster "
                     "token and this process has none (set "
                     "FERRY_AUTH_TOKEN_FILE as the peer's is)\n",
                     qp->dev->name.c_str());
      }
      break;
    }
    bool kick = false;
    if (!HandleResponse(qp, f, &src, &kick)) break;
    if (kick) Kick(qp);
  }
  conn->Close();
  // The peer closed it or it broke: release the descriptor now. The QP
  // keeps RC semantics without it: its next transmission finds no
  // connection and is lost, and the retransmission timer dials again
  // (peer alive) or ends in IBV_WC_RETRY_EXC_ERR (peer gone).
  ferry::MutexLock lock(&qp->mu);
  if (qp->conn == conn) qp->conn.reset();
}

}  // namespace

bool DialPeer(const std::shared_ptr<Qp>& qp) {
  in_addr ip;
  uint16_t port;
  uint32_t dest;
  {
    ferry::MutexLock lock(&qp->mu);
    if (qp->loopback || qp->destroyed) return qp->loopback;
    if (qp->conn != nullptr && !qp->conn->closed()) return true;
    ip = qp->peer_ip;
    port = qp->peer_port;
    dest = qp->attr.dest_qp_num;
  }
  if (!qp->dev->LinkUp() || port == 0) return false;  // port 0: unroutable.
  // Under a cluster token the listener speaks first: a CHALLENGE, which
  // the HELLO answers with its proof (hello_auth.h).
  const std::string* token = ClusterToken();
  uint8_t challenge[kHeaderBytes];
  std::shared_ptr<Connection> conn =
      Dial(qp->dev, ip, port, kDialTimeoutMs,
           token != nullptr ? challenge : nullptr, kHeaderBytes);
  if (conn == nullptr) return false;
  Frame hello{};
  hello.type = FrameType::kHello;
  hello.qpn = dest;
  hello.aux = qp->qp.qp_num;
  if (qp->sgid_v1.load(std::memory_order_acquire)) hello.flags = kFlagRoceV1;
  uint8_t out[kHeaderBytes];
  uint8_t proof[kHelloProofBytes];
  iovec iov[2] = {{out, sizeof(out)}, {proof, sizeof(proof)}};
  if (token != nullptr) {
    Frame c;
    if (!DecodeFrame(challenge, kMaxMsgSize, &c) ||
        c.type != FrameType::kChallenge) {
      conn->Close();
      return false;
    }
    hello.length = kHelloProofBytes;
    EncodeFrame(hello, out);
    HelloProof(*token, challenge, out, proof);
  } else {
    EncodeFrame(hello, out);
  }
  {
    ferry::MutexLock lock(&conn->mu);
    if (!conn->WriteAll(iov, token != nullptr ? 2 : 1)) return false;
  }
  std::shared_ptr<Connection> old;
  {
    ferry::MutexLock lock(&qp->mu);
    if (qp->destroyed) {
      conn->Close();
      return false;
    }
    old = std::move(qp->conn);
    qp->conn = conn;
  }
  if (old != nullptr) old->Close();
  if (!StartThread("srnic-resp", [qp, conn] { ResponseLoop(qp, conn); })) {
    conn->Close();  // As a dial that failed: the timer tries again.
    ferry::MutexLock lock(&qp->mu);
    if (qp->conn == conn) qp->conn.reset();
    return false;
  }
  return true;
}

void ConnectQp(const std::shared_ptr<Qp>& qp) {
  uint32_t dest;
  bool loopback;
  {
    ferry::MutexLock lock(&qp->mu);
    qp->loopback = FindDeviceByAddress(qp->peer_ip, qp->peer_port) != nullptr;
    qp->send_index = 0;
    loopback = qp->loopback;
    dest = qp->attr.dest_qp_num;
  }
  if (loopback) {
    // Found once here, so the data path needs no table lookup.
    std::shared_ptr<Qp> peer = FindQp(dest);
    ferry::MutexLock lock(&qp->mu);
    qp->loop_peer = peer;
    qp->has_loop_peer = peer != nullptr;
    return;
  }
  DialPeer(qp);  // If it fails, the timer dials again when there is work.
}

void DisconnectQp(const std::shared_ptr<Qp>& qp, bool also_accepted) {
  std::shared_ptr<Connection> c, a;
  {
    ferry::MutexLock lock(&qp->mu);
    c = std::move(qp->conn);
    if (also_accepted) a = std::move(qp->accepted);
  }
  if (c != nullptr) c->Close();
  if (a != nullptr) a->Close();
}

}  // namespace softrnic
