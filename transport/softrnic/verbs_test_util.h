// Helpers shared by softrnic's conformance tests and their peer binary
// (verbs_peer): RAII wrappers for verbs objects, the three modify_qp steps of
// an RC connection, deadline-bounded CQ polling and async-event waiting,
// data patterns and GID text encoding.
//
// Only the standard libibverbs API is used, so the same helpers would run on
// a real RDMA NIC. Nothing here depends on gtest: functions report failure by
// return value and, where useful, a message in *error.
//
// Not thread-safe: each object is used by one thread at a time.
#ifndef FERRY_TRANSPORT_SOFTRNIC_VERBS_TEST_UTIL_H_
#define FERRY_TRANSPORT_SOFTRNIC_VERBS_TEST_UTIL_H_

#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace softrnic_test {

using Clock = std::chrono::steady_clock;

// Default bound for any wait on the emulator: generous for a loaded 2-core
// machine, but finite so that a broken implementation fails instead of
// hanging the suite.
constexpr int kDefaultTimeoutMs = 10000;

inline int64_t MsSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() -
                                                               start)
      .count();
}

// ---------------------------------------------------------------------------
// Data patterns and checksums.

// Fills `n` bytes with a pattern that depends on `seed` and on the position,
// so that misplaced, stale or truncated data is detected (a constant fill
// would not show an offset error).
inline void FillPattern(uint8_t* p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 0x9e3779b9u;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<uint8_t>(x >> 24);
  }
}

// Index of the first byte that differs from FillPattern(seed), or -1.
inline int64_t FirstPatternMismatch(const uint8_t* p, size_t n, uint32_t seed) {
  std::vector<uint8_t> want(n);
  FillPattern(want.data(), n, seed);
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != want[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// Index of the first byte that is not `value`, or -1.
inline int64_t FirstNotEqual(const uint8_t* p, size_t n, uint8_t value) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != value) return static_cast<int64_t>(i);
  }
  return -1;
}

// FNV-1a, used to compare buffers across processes in one short line.
inline uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

// ---------------------------------------------------------------------------
// GIDs.

inline std::string GidToHex(const ibv_gid& gid) {
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 16; ++i) {
    s += kHex[gid.raw[i] >> 4];
    s += kHex[gid.raw[i] & 15];
  }
  return s;
}

inline bool HexToGid(const std::string& s, ibv_gid* gid) {
  if (s.size() != 32) return false;
  for (int i = 0; i < 16; ++i) {
    unsigned v = 0;
    if (std::sscanf(s.c_str() + 2 * i, "%2x", &v) != 1) return false;
    gid->raw[i] = static_cast<uint8_t>(v);
  }
  return true;
}

// The IPv4 address carried by a RoCE v2 style IPv4-mapped GID, dotted.
inline std::string GidIpv4(const ibv_gid& gid) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, gid.raw + 12, buf, sizeof(buf));
  return buf;
}

// The TCP listener port softrnic carries in GID bytes 8..9 (big-endian).
inline uint16_t GidPort(const ibv_gid& gid) {
  return static_cast<uint16_t>((gid.raw[8] << 8) | gid.raw[9]);
}

// ---------------------------------------------------------------------------
// Devices.

// Opens the device called `name`, or returns nullptr with *error set.
inline ibv_context* OpenDeviceByName(const std::string& name,
                                     std::string* error) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) {
    *error = std::string("ibv_get_device_list: ") + strerror(errno);
    return nullptr;
  }
  ibv_context* ctx = nullptr;
  bool found = false;
  for (int i = 0; i < num; ++i) {
    if (name == ibv_get_device_name(list[i])) {
      found = true;
      ctx = ibv_open_device(list[i]);
      if (ctx == nullptr) {
        *error = "ibv_open_device(" + name + "): " + strerror(errno);
      }
      break;
    }
  }
  ibv_free_device_list(list);
  if (!found) *error = "no device named " + name;
  return ctx;
}

// ---------------------------------------------------------------------------
// Buffers and endpoints.

// A heap buffer registered as an MR; deregistered on destruction.
class Buffer {
 public:
  // Returns nullptr with *error set (and errno preserved) on failure.
  static std::unique_ptr<Buffer> Create(ibv_pd* pd, size_t size, int access,
                                        std::string* error) {
    std::unique_ptr<Buffer> b(new Buffer());
    b->size_ = size;
    // Page-aligned so that tests can reason about exact MR bounds.
    if (posix_memalign(reinterpret_cast<void**>(&b->data_), 4096,
                       size == 0 ? 1 : size) != 0) {
      *error = "posix_memalign failed";
      return nullptr;
    }
    memset(b->data_, 0, size);
    b->mr_ = ibv_reg_mr(pd, b->data_, size, access);
    if (b->mr_ == nullptr) {
      int e = errno;
      *error = std::string("ibv_reg_mr: ") + strerror(e);
      b.reset();
      errno = e;
      return nullptr;
    }
    return b;
  }
  ~Buffer() {
    if (mr_ != nullptr) ibv_dereg_mr(mr_);
    free(data_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  ibv_mr* mr() const { return mr_; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  uint64_t addr(size_t offset = 0) const {
    return reinterpret_cast<uintptr_t>(data_) + offset;
  }
  ibv_sge Sge(size_t offset, uint32_t length) const {
    ibv_sge s;
    s.addr = addr(offset);
    s.length = length;
    s.lkey = lkey();
    return s;
  }
  // Deregisters early (to test stale keys); the memory stays allocated.
  int Deregister() {
    int rc = ibv_dereg_mr(mr_);
    if (rc == 0) mr_ = nullptr;
    return rc;
  }

 private:
  Buffer() = default;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  ibv_mr* mr_ = nullptr;
};

constexpr int kFullAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

struct EndpointOptions {
  int cqe = 256;
  uint32_t max_send_wr = 64;
  uint32_t max_recv_wr = 64;
  uint32_t max_send_sge = 4;
  uint32_t max_recv_sge = 4;
  uint32_t max_inline_data = 64;
  bool sq_sig_all = false;
  ibv_comp_channel* channel = nullptr;  // Not owned; for the CQ.
};

// One side of an RC connection: a PD, one CQ (send and receive), an RC QP
// and the buffers registered on the PD. Owns all of them; the context is
// not owned and must outlive the endpoint.
class Endpoint {
 public:
  static std::unique_ptr<Endpoint> Create(ibv_context* ctx,
                                          const EndpointOptions& o,
                                          std::string* error) {
    std::unique_ptr<Endpoint> e(new Endpoint());
    e->ctx_ = ctx;
    e->pd_ = ibv_alloc_pd(ctx);
    if (e->pd_ == nullptr) {
      *error = std::string("ibv_alloc_pd: ") + strerror(errno);
      return nullptr;
    }
    e->cq_ = ibv_create_cq(ctx, o.cqe, /*cq_context=*/e.get(), o.channel, 0);
    if (e->cq_ == nullptr) {
      *error = std::string("ibv_create_cq: ") + strerror(errno);
      return nullptr;
    }
    ibv_qp_init_attr init = {};
    init.send_cq = e->cq_;
    init.recv_cq = e->cq_;
    init.qp_type = IBV_QPT_RC;
    init.sq_sig_all = o.sq_sig_all ? 1 : 0;
    init.cap.max_send_wr = o.max_send_wr;
    init.cap.max_recv_wr = o.max_recv_wr;
    init.cap.max_send_sge = o.max_send_sge;
    init.cap.max_recv_sge = o.max_recv_sge;
    init.cap.max_inline_data = o.max_inline_data;
    e->qp_ = ibv_create_qp(e->pd_, &init);
    if (e->qp_ == nullptr) {
      *error = std::string("ibv_create_qp: ") + strerror(errno);
      return nullptr;
    }
    // ibv_create_qp reports the actual capabilities (>= requested).
    e->cap_ = init.cap;
    if (ibv_query_gid(ctx, 1, 0, &e->gid_) != 0) {
      *error = "ibv_query_gid failed";
      return nullptr;
    }
    return e;
  }
  ~Endpoint() {
    if (qp_ != nullptr) ibv_destroy_qp(qp_);
    buffers_.clear();  // MRs before the PD.
    if (cq_ != nullptr) ibv_destroy_cq(cq_);
    if (pd_ != nullptr) ibv_dealloc_pd(pd_);
  }
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Registers a new zeroed buffer; nullptr on failure (errno preserved).
  Buffer* Reg(size_t size, int access = kFullAccess,
              std::string* error = nullptr) {
    std::string local;
    auto b = Buffer::Create(pd_, size, access, error ? error : &local);
    if (b == nullptr) return nullptr;
    buffers_.push_back(std::move(b));
    return buffers_.back().get();
  }

  ibv_context* ctx() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  ibv_cq* cq() const { return cq_; }
  ibv_qp* qp() const { return qp_; }
  uint32_t qpn() const { return qp_->qp_num; }
  const ibv_qp_cap& cap() const { return cap_; }
  const ibv_gid& gid() const { return gid_; }

 private:
  Endpoint() = default;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_qp_cap cap_ = {};
  ibv_gid gid_ = {};
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

// ---------------------------------------------------------------------------
// QP state transitions, with exactly the attribute masks of rc_pingpong.

struct ConnectOptions {
  ibv_mtu mtu = IBV_MTU_1024;
  uint8_t timeout = 14;  // 4.096 us * 2^14 = 67 ms per try.
  uint8_t retry_cnt = 7;
  uint8_t rnr_retry = 7;       // 7 = retry forever (IB spec).
  uint8_t min_rnr_timer = 12;  // 0.64 ms.
  uint32_t psn = 0x123;
  int access =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
};

// Returns ibv_modify_qp's result (0 or an errno value).
inline int ModifyToInit(ibv_qp* qp, const ConnectOptions& o) {
  ibv_qp_attr a = {};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = o.access;
  return ibv_modify_qp(
      qp, &a,
      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

inline ibv_qp_attr RtrAttr(uint32_t dest_qpn, const ibv_gid& dgid,
                           const ConnectOptions& o) {
  ibv_qp_attr a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = o.mtu;
  a.dest_qp_num = dest_qpn;
  a.rq_psn = o.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = o.min_rnr_timer;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = dgid;
  a.ah_attr.grh.sgid_index = 0;
  a.ah_attr.grh.hop_limit = 1;
  a.ah_attr.port_num = 1;
  return a;
}

constexpr int kRtrMask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                         IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                         IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;

inline int ModifyToRtr(ibv_qp* qp, uint32_t dest_qpn, const ibv_gid& dgid,
                       const ConnectOptions& o) {
  ibv_qp_attr a = RtrAttr(dest_qpn, dgid, o);
  return ibv_modify_qp(qp, &a, kRtrMask);
}

inline ibv_qp_attr RtsAttr(const ConnectOptions& o) {
  ibv_qp_attr a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = o.timeout;
  a.retry_cnt = o.retry_cnt;
  a.rnr_retry = o.rnr_retry;
  a.sq_psn = o.psn;
  a.max_rd_atomic = 1;
  return a;
}

constexpr int kRtsMask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                         IBV_QP_MAX_QP_RD_ATOMIC;

inline int ModifyToRts(ibv_qp* qp, const ConnectOptions& o) {
  ibv_qp_attr a = RtsAttr(o);
  return ibv_modify_qp(qp, &a, kRtsMask);
}

inline int ModifyToState(ibv_qp* qp, ibv_qp_state state) {
  ibv_qp_attr a = {};
  a.qp_state = state;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

// Brings `qp` from RESET to RTS towards (dest_qpn, dgid). 0 or an errno.
inline int ConnectQp(ibv_qp* qp, uint32_t dest_qpn, const ibv_gid& dgid,
                     const ConnectOptions& o, std::string* error) {
  int rc = ModifyToInit(qp, o);
  if (rc != 0) {
    *error = std::string("modify to INIT: ") + strerror(rc);
    return rc;
  }
  rc = ModifyToRtr(qp, dest_qpn, dgid, o);
  if (rc != 0) {
    *error = std::string("modify to RTR: ") + strerror(rc);
    return rc;
  }
  rc = ModifyToRts(qp, o);
  if (rc != 0) *error = std::string("modify to RTS: ") + strerror(rc);
  return rc;
}

inline int QpState(ibv_qp* qp) {
  ibv_qp_attr a = {};
  ibv_qp_init_attr init = {};
  if (ibv_query_qp(qp, &a, IBV_QP_STATE, &init) != 0) return -1;
  return a.qp_state;
}

// ---------------------------------------------------------------------------
// Posting.

inline int PostRdma(ibv_qp* qp, ibv_wr_opcode opcode, uint64_t wr_id,
                    const Buffer* local, size_t offset, uint32_t length,
                    uint64_t remote_addr, uint32_t rkey, bool signaled = true,
                    uint32_t imm_host = 0) {
  ibv_sge sge = local->Sge(offset, length);
  ibv_send_wr wr = {};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = opcode;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  wr.imm_data = htonl(imm_host);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(qp, &wr, &bad);
}

inline int PostSendMsg(ibv_qp* qp, uint64_t wr_id, const Buffer* local,
                       size_t offset, uint32_t length, bool with_imm = false,
                       uint32_t imm_host = 0, bool signaled = true) {
  ibv_sge sge = local->Sge(offset, length);
  ibv_send_wr wr = {};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = with_imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  wr.imm_data = htonl(imm_host);
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(qp, &wr, &bad);
}

inline int PostRecvBuf(ibv_qp* qp, uint64_t wr_id, const Buffer* local,
                       size_t offset, uint32_t length) {
  ibv_sge sge = local->Sge(offset, length);
  ibv_recv_wr wr = {};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp, &wr, &bad);
}

// ---------------------------------------------------------------------------
// Completions and events.

// Polls until `n` completions are gathered into *out (appended), the CQ
// reports an error (returns -1), or `timeout_ms` passes. Returns the number
// gathered. Yields between empty polls: on 2 cores a busy loop would starve
// the emulator's threads.
inline int PollCompletions(ibv_cq* cq, int n, std::vector<ibv_wc>* out,
                           int timeout_ms = kDefaultTimeoutMs) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  int got = 0;
  int empty = 0;
  while (got < n) {
    ibv_wc wc[16];
    int want = n - got < 16 ? n - got : 16;
    int r = ibv_poll_cq(cq, want, wc);
    if (r < 0) return -1;
    if (r > 0) {
      out->insert(out->end(), wc, wc + r);
      got += r;
      empty = 0;
      continue;
    }
    if (Clock::now() >= deadline) break;
    if (++empty < 200) {
      sched_yield();
    } else {
      usleep(100);
    }
  }
  return got;
}

// One completion within the timeout; false if none (or a poll error).
inline bool PollOne(ibv_cq* cq, ibv_wc* wc,
                    int timeout_ms = kDefaultTimeoutMs) {
  std::vector<ibv_wc> v;
  if (PollCompletions(cq, 1, &v, timeout_ms) != 1) return false;
  *wc = v[0];
  return true;
}

// Waits up to `timeout_ms` for the next async event of `ctx`, copies it to
// *event and acknowledges it. False on timeout.
inline bool NextAsyncEvent(ibv_context* ctx, ibv_async_event* event,
                           int timeout_ms) {
  pollfd pfd = {ctx->async_fd, POLLIN, 0};
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int left =
        static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                             deadline - Clock::now())
                             .count());
    if (left < 0) return false;
    int r = poll(&pfd, 1, left);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    break;
  }
  ibv_async_event ev;
  if (ibv_get_async_event(ctx, &ev) != 0) return false;
  *event = ev;
  ibv_ack_async_event(&ev);
  return true;
}

// Waits for an async event of `type` (skipping others, which are appended
// to *skipped if given). False on timeout.
inline bool WaitAsyncEvent(ibv_context* ctx, ibv_event_type type,
                           ibv_async_event* event, int timeout_ms,
                           std::vector<ibv_event_type>* skipped = nullptr) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int left =
        static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                             deadline - Clock::now())
                             .count());
    if (left < 0) return false;
    ibv_async_event ev;
    if (!NextAsyncEvent(ctx, &ev, left)) return false;
    if (ev.event_type == type) {
      *event = ev;
      return true;
    }
    if (skipped != nullptr) skipped->push_back(ev.event_type);
  }
}

// ---------------------------------------------------------------------------
// Wire robustness.

// Writes `data` to a new TCP connection to ip:port, then waits briefly for
// the emulator to answer or close. Errors are expected (the emulator may
// drop the connection at the first bad byte) and ignored.
inline void SendToListener(const std::string& ip, uint16_t port,
                           const std::vector<uint8_t>& data, bool linger_open) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sockaddr_in sa = {};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  inet_pton(AF_INET, ip.c_str(), &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
    size_t off = 0;
    while (off < data.size()) {
      ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    if (linger_open) {
      pollfd pfd = {fd, POLLIN, 0};
      poll(&pfd, 1, 20);
    }
  }
  close(fd);
}

// A TCP connection from source address `from` to ip:port, or -1 with
// *error set.
inline int ConnectFrom(const std::string& from, const std::string& ip,
                       uint16_t port, std::string* error) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = std::string("socket: ") + strerror(errno);
    return -1;
  }
  sockaddr_in local = {};
  local.sin_family = AF_INET;
  inet_pton(AF_INET, from.c_str(), &local.sin_addr);
  sockaddr_in sa = {};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  inet_pton(AF_INET, ip.c_str(), &sa.sin_addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    *error = std::string("bind/connect: ") + strerror(errno);
    close(fd);
    return -1;
  }
  return fd;
}

// Whether the other end has closed `fd` (EOF or reset) within
// `timeout_ms`. Bytes the other end sent are consumed.
inline bool ClosedByPeer(int fd, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    char buf[256];
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
    if (n > 0) continue;
    const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(
                             deadline - Clock::now())
                             .count();
    if (left <= 0) return false;
    pollfd pfd = {fd, POLLIN | POLLRDHUP, 0};
    poll(&pfd, 1, static_cast<int>(left));
  }
}

inline void PutBe32(std::vector<uint8_t>* v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v->push_back(static_cast<uint8_t>(x >> s));
}

// A frame header in the layout softrnic's wire.h documents (magic 'SRNC',
// version, type, flags, qpn, msn, length, rkey, remote_addr, imm, aux):
// near-valid headers reach deeper into the parser than random bytes do.
inline std::vector<uint8_t> Header(uint8_t version, uint8_t type, uint32_t qpn,
                                   uint32_t length, uint32_t rkey,
                                   uint64_t addr, uint32_t aux) {
  std::vector<uint8_t> v;
  PutBe32(&v, 0x53524e43);
  v.push_back(version);
  v.push_back(type);
  v.push_back(0);
  v.push_back(0);
  PutBe32(&v, qpn);
  PutBe32(&v, 0);  // msn
  PutBe32(&v, length);
  PutBe32(&v, rkey);
  PutBe32(&v, static_cast<uint32_t>(addr >> 32));
  PutBe32(&v, static_cast<uint32_t>(addr));
  PutBe32(&v, 0);  // imm
  PutBe32(&v, aux);
  return v;
}

}  // namespace softrnic_test

#endif  // FERRY_TRANSPORT_SOFTRNIC_VERBS_TEST_UTIL_H_
