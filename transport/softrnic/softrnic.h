// softrnic internals: the objects behind the libibverbs handles.
//
// Every verbs object is a struct whose first member is the libibverbs
// struct the application sees (ibv_context, ibv_pd, ...), so a handle casts
// to its softrnic object. Objects are reference-counted where data-path
// threads may still hold them when the application destroys them.
//
// Threads: per device one acceptor thread (TCP listener for peers' QPs;
// it also reads every connection's HELLO, so connections that never
// identify a QP cost no thread) and one timer thread (retransmission and
// ack timeouts); per connected QP at most one thread reading responses
// from its outgoing connection and one serving its accepted connection.
// So threads grow with the application's QPs, never with what arrives on
// the listener. All block in the kernel when idle.
#ifndef FERRY_TRANSPORT_SOFTRNIC_SOFTRNIC_H_
#define FERRY_TRANSPORT_SOFTRNIC_SOFTRNIC_H_

#include <infiniband/verbs.h>
#include <netinet/in.h>

// verbs.h turns these into inline wrappers; softrnic defines the real
// exported functions under these names.
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_reg_mr_iova

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/dma_annotations.h"
#include "common/mutex.h"

#define SOFTRNIC_EXPORT extern "C" __attribute__((visibility("default")))

namespace softrnic {

// The emulated NIC's own time: its ack timeouts, RNR waits, injected wire
// delay and DMA drain run on the steady clock, as a NIC's timers run on
// its own oscillator. This is hardware time, not Ferry's: softrnic is
// loaded as a separate libibverbs.so.1 and never sees the engine's
// ferry::Clock (common/clock.h), so a SimulatedClock does not move it.
using Clock = std::chrono::steady_clock;

// Capacities of the emulation: no profile may report more (Profile).
constexpr int kMaxQpWr = 32768;
constexpr int kMaxSge = 30;
constexpr int kMaxCqe = 4194303;
constexpr uint32_t kMaxInline = 256;
constexpr uint32_t kMaxMsgSize = 1u << 30;
constexpr int kMaxQp = 1 << 16;
constexpr int kMaxGidTableLen = 4;

struct DeviceConfig {
  std::string name;
  std::string ip;  // Dotted IPv4.
};

// Limits that protect a device (and its process) from what arrives on its
// listener; each can be set through the environment variable named.
struct Limits {
  // A connection must complete its HELLO within this long, or it is
  // closed (FERRY_SOFTRNIC_HANDSHAKE_TIMEOUT_MS; default 5000).
  int handshake_timeout_ms = 5000;
  // Accepted connections per device, in handshake or serving
  // (FERRY_SOFTRNIC_MAX_CONNECTIONS; default half the soft descriptor
  // limit when the first device starts, between 16 and 4096).
  int max_connections = 1024;
  // Of those, from one source address
  // (FERRY_SOFTRNIC_MAX_CONNECTIONS_PER_ADDRESS; default a quarter of
  // max_connections, at least 4).
  int max_connections_per_address = 256;
};

// Read from the environment on first use.
const Limits& GetLimits();

// What a device reports (ibv_query_device, ibv_query_port) and enforces
// (create and modify of QPs and CQs), as a given kind of hardware would.
// Chosen by FERRY_SOFTRNIC_PROFILE (default "softrnic"); an unknown name is
// reported on stderr and the default used. Every value is within the
// emulation's capacities above.
struct Profile {
  const char* name;
  // The port's MTU: modify_qp with a larger path_mtu fails with EINVAL.
  ibv_mtu active_mtu;
  ibv_mtu max_mtu;
  int max_qp_wr;            // create_qp: max_send_wr/max_recv_wr above: EINVAL.
  int max_sge;              // create_qp: max_send_sge/max_recv_sge above.
  int max_cqe;              // create_cq/resize_cq above.
  uint32_t max_inline;      // create_qp: max_inline_data above.
  int max_qp_rd_atom;       // modify_qp: max_dest_rd_atomic above.
  int max_qp_init_rd_atom;  // modify_qp: max_rd_atomic above.
  // GID entries: 1 (one RoCE v2 IPv4-mapped GID), 2 (a port with RoCE v1
  // only: link-local and IPv4-mapped v1), or 4, as a RoCE NIC's
  // table on a netdev with one IPv4 address: [0] link-local RoCE v1,
  // [1] link-local RoCE v2, [2] IPv4-mapped RoCE v1, [3] IPv4-mapped RoCE
  // v2. A QP reaches only QPs of its own source GID's type (a v1 packet is
  // dropped by a v2 QP; the sender times out), and a link-local GID routes
  // nowhere here.
  int gid_table_len;
  // IBV_LINK_LAYER_ETHERNET (RoCE: QPs address peers by GID, with a GRH)
  // or IBV_LINK_LAYER_INFINIBAND: the port gets a LID from the emulated
  // subnet manager (subnet.cc), its one GID is fe80::<port GUID>, and a QP
  // reaches its peer by DLID, with or without a GRH.
  uint8_t link_layer;
};
const Profile& GetProfile();
inline bool InfiniBand() {
  return GetProfile().link_layer == IBV_LINK_LAYER_INFINIBAND;
}

// The emulated subnet manager's LID table (subnet.cc). LID 1 is the subnet
// manager's own; AssignLid gives the port listening at ip:port a unicast
// LID of its own, or 0 (reported on stderr) if the table cannot be written:
// such a port stays in INIT, as one with no subnet manager does.
constexpr uint16_t kSubnetManagerLid = 1;
uint16_t AssignLid(in_addr ip, uint16_t port);
// The listener of the live port holding `lid`; false if none does (a DLID
// that no port holds routes nowhere).
bool ResolveLid(uint16_t lid, in_addr* ip, uint16_t* port);

// Runs `fn` on a new detached thread named `name` (at most 15 characters);
// false (with a message on stderr) if the system refuses one, e.g. under a
// thread or pids limit: callers degrade (close a connection, fail a verb),
// the process never aborts.
bool StartThread(const char* name, std::function<void()> fn);

// Parses FERRY_SOFTRNIC_DEVICES ("name=ip,name=ip") or the file named by
// FERRY_SOFTRNIC_CONFIG (one "name ip" per line); default softrnic0 on
// 127.0.0.1. Invalid entries are reported on stderr and skipped.
std::vector<DeviceConfig> LoadDeviceConfig();

struct Context;
struct Qp;
struct Mr;

// One emulated NIC. Lives for the whole process (ibv_device must stay
// valid after ibv_free_device_list).
struct Device {
  ibv_device ibdev;  // Must be first.
  std::string name;
  in_addr ip{};
  uint64_t guid = 0;  // Network byte order.
  // The port is up while all hold: the fault-injection switch
  // (softrnic_set_link), the carrier of the interface holding `ip`
  // (carrier.cc), and the device is not dead. Changed only through
  // SetLink / SetCarrier / KillDevice.
  std::atomic<bool> link_up{true};
  std::atomic<bool> carrier{true};
  // IBV_EVENT_DEVICE_FATAL was raised and a context open then is still
  // open (the "hardware" needs those closed before it works again).
  std::atomic<bool> fatal{false};
  ferry::Mutex link_mu;  // Serializes port state changes.
  bool LinkUp() const {
    return link_up.load(std::memory_order_relaxed) &&
           carrier.load(std::memory_order_relaxed) &&
           !fatal.load(std::memory_order_relaxed);
  }
  // The GID table's one entry is valid while the device's address is
  // assigned to a local interface (re-read on address changes and on an
  // injected IBV_EVENT_GID_CHANGE); an invalid entry reads as zeros.
  std::atomic<bool> gid_valid{true};
  std::atomic<uint32_t> delay_us{0};
  // ACK timeouts that resent (go back N) or failed a request (as the
  // local_ack_timeout_err counter of mlx5 NICs), for tests and benchmarks;
  // not those that found the frame still queued in its connection.
  std::atomic<uint64_t> ack_timeouts{0};

  ferry::Mutex mu;
  // Listener and timer threads running.
  bool started ABSL_GUARDED_BY(mu) = false;
  bool timer_running ABSL_GUARDED_BY(mu) = false;
  // Listener port, host order; set once, before `started`.
  std::atomic<uint16_t> port{0};
  // InfiniBand profile: the port's LID, set once with `port` (0: none).
  std::atomic<uint16_t> lid{0};
  // Open contexts, for async events.
  std::vector<Context*> contexts ABSL_GUARDED_BY(mu);

  // QPs with retransmission work pending, and the timer's wake-up.
  ferry::Mutex timer_mu;
  ferry::CondVar timer_cv;
  std::vector<std::weak_ptr<Qp>> timer_qps ABSL_GUARDED_BY(timer_mu);

  // The GID the emulation routes by: IPv4-mapped, the listener port in
  // bytes 8..9. Zeros while the device's address is gone.
  void GidFor(ibv_gid* gid) const;
  // Entry `index` of the GID table (Profile::gid_table_len entries) and
  // whether it is RoCE v1.
  void GidAt(int index, ibv_gid* gid, bool* roce_v1) const;
};

// All configured devices; created on first use.
std::vector<Device*>& Devices();
Device* FindDeviceByAddress(in_addr ip, uint16_t port);
Device* FindDeviceByName(const char* name);
// Starts the device's listener and timer threads (idempotent).
int StartDevice(Device* dev);

// Port state. Each sets one of the two conditions; when the port's state
// changes, connections are cut (going down) and IBV_EVENT_PORT_ERR /
// IBV_EVENT_PORT_ACTIVE is raised on every context of the device.
void SetLink(Device* dev, bool up);
void SetCarrier(Device* dev, bool up);
// Starts following the interfaces' carrier and addresses (carrier.cc;
// idempotent).
void StartCarrierMonitor();
// Re-reads the device's GID table from the interfaces' addresses
// (carrier.cc); true if the table changed.
bool RereadGidTable(Device* dev);

// IBV_EVENT_DEVICE_FATAL, as hardware raises it: every context open now
// turns dead (its verbs fail with EIO until it is closed), the port goes
// down, connections are cut, every QP of the device moves to ERR with its
// work requests flushed, and the event is delivered on every context. The
// device works again once all of those contexts are closed.
void KillDevice(Device* dev);

// At most this many async events wait in a context; beyond, the oldest is
// dropped (an application that never reads them must not grow memory).
constexpr size_t kMaxAsyncEvents = 4096;

struct Context {
  ibv_context ctx;  // Must be first.
  Device* dev = nullptr;
  int async_write_fd = -1;
  // Opened before an IBV_EVENT_DEVICE_FATAL of its device: verbs on it
  // fail with EIO, except destroying objects, polling CQs and reading
  // events.
  std::atomic<bool> dead{false};
  ferry::Mutex mu;
  std::deque<ibv_async_event> async_events ABSL_GUARDED_BY(mu);
};

// Whether verbs on `context` must fail with EIO (see Context::dead).
inline bool Dead(const ibv_context* context) {
  return reinterpret_cast<const Context*>(context)->dead.load(
      std::memory_order_relaxed);
}

void PostAsyncEvent(Device* dev, const ibv_async_event& event);
void PostAsyncEvent(Context* ctx, const ibv_async_event& event);

struct Pd {
  ibv_pd pd;                  // Must be first.
  std::atomic<int> users{0};  // MRs and QPs created on it.
};

// A registered memory region. lkey == rkey == (slot << 8) | generation: a
// slot reused after dereg gets a new generation, so a peer holding the old
// rkey is refused, not aliased. Mr objects live in the key table's slots
// and are never freed, so the data path finds them without a lock.
struct Mr {
  ibv_mr mr;  // Must be first.
  Pd* pd = nullptr;
  int access = 0;
  uintptr_t start = 0;  // Host address of the first byte.
  uint64_t iova = 0;    // Address peers and SGEs use for that byte.
  size_t length = 0;
  // Strict page identity (registered while strict mode was on): the
  // physical frame of each page the MR covers, from the page holding
  // `start` on; every access checks the frames of the pages it touches.
  bool strict = false;
  uint64_t* frames = nullptr;
  // Bytes charged to the process's locked-memory budget (whole pages).
  uint64_t pinned = 0;
  // A dma-buf MR (ibv_reg_dmabuf_mr): softrnic's own mapping of the
  // exporter's memory, which `start` points into; unmapped at dereg.
  void* dmabuf_map = nullptr;
  size_t dmabuf_map_length = 0;
  // The key while registered, 0 once deregistered. The fields above are
  // written before it is published and stay fixed until dereg has seen
  // `inflight` drop to zero.
  std::atomic<uint32_t> live_key{0};
  // Accesses in progress (DMA); dereg waits for zero.
  std::atomic<int> inflight{0};
};

// Strict page identity (mr_pages.cc): whether the pages [host, host+len) of
// strict MR `mr` are still the ones registered. False (counted, and
// reported on stderr the first few times) if one was replaced, as after
// munmap and a new mapping at the same address.
bool FramesUnchanged(const Mr* mr, uintptr_t host, uint64_t len);

// Looks up an MR by key and checks that [addr, addr+len) lies inside it,
// that it belongs to `pd` and grants `access` (IBV_ACCESS_* bits; 0 for a
// local read). On success the MR's inflight count is raised: call
// ReleaseMr when done.
Mr* AcquireMr(uint32_t key, Pd* pd, uint64_t addr, uint64_t len, int access);
void ReleaseMr(Mr* mr);

// The MRs a batch of work requests touches, each acquired once for the
// whole batch rather than once per request (the acquire is an atomic
// read-modify-write). Released on destruction. Not thread-safe.
class HeldMrs {
 public:
  HeldMrs() = default;
  HeldMrs(const HeldMrs&) = delete;
  HeldMrs& operator=(const HeldMrs&) = delete;
  ~HeldMrs() { ReleaseAll(); }
  // As AcquireMr; the MR stays held until ReleaseAll or destruction.
  Mr* Get(uint32_t key, Pd* pd, uint64_t addr, uint64_t len, int access);
  // Call between requests: makes room for the next request's MRs (at most
  // kMaxSge + 1) by releasing everything if needed.
  void MakeRoom() {
    if (n_ > kSlots - (kMaxSge + 1)) ReleaseAll();
  }
  void ReleaseAll();

 private:
  static constexpr int kSlots = 2 * (kMaxSge + 1);
  Mr* mrs_[kSlots];
  int n_ = 0;
};

// Marks softrnic's copies to and from MR memory, which stand for a NIC's
// DMA (common/dma_annotations.h): hidden from ThreadSanitizer, as DMA is on
// hardware; softrnic's own state is not.
using DmaScope = ::ferry::ScopedDmaAccess;

// Host pointer for `addr` (in the MR's iova space).
inline uint8_t* HostAddr(const Mr* mr, uint64_t addr) {
  return reinterpret_cast<uint8_t*>(mr->start + (addr - mr->iova));
}

struct CompChannel {
  ibv_comp_channel ch;  // Must be first.
  int write_fd = -1;
};

struct Cq {
  ibv_cq cq;  // Must be first.
  ferry::Mutex mu;
  std::vector<ibv_wc> ring ABSL_GUARDED_BY(mu);
  size_t head ABSL_GUARDED_BY(mu) = 0;
  size_t count ABSL_GUARDED_BY(mu) = 0;
  bool armed ABSL_GUARDED_BY(mu) = false;
  bool solicited_only ABSL_GUARDED_BY(mu) = false;
  bool overrun ABSL_GUARDED_BY(mu) = false;
};

// Adds a completion; reports overrun (IBV_EVENT_CQ_ERR) if the CQ is full,
// and signals the completion channel if armed.
void PushCompletion(Cq* cq, const ibv_wc& wc, bool solicited = false);
// Adds `n` completions at once (one lock, at most one event).
void PushCompletions(Cq* cq, const ibv_wc* wcs, int n, bool solicited = false);

int PollCq(ibv_cq* cq, int n, ibv_wc* wc);
int ReqNotifyCq(ibv_cq* cq, int solicited_only);

// A scatter/gather element after validation.
struct Sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

// A posted send WQE. Its SGEs and inline bytes live in the owning
// SendQueue's pools (as a real NIC's WQE size follows the QP's caps), so
// posting allocates nothing.
struct SendWqe {
  uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  bool signaled = false;
  bool solicited = false;
  bool local_error = false;  // An SGE's lkey was bad at post time.
  uint32_t msn = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t imm = 0;  // Big-endian, passed through.
  uint32_t length = 0;
  uint32_t num_sge = 0;
  Sge* sges = nullptr;
  // IBV_SEND_INLINE: `length` bytes copied at post time.
  bool is_inline = false;
  uint8_t* inline_data = nullptr;
  Clock::time_point deadline{};  // Ack timeout of the last transmission.
  // Where the last transmission ends in its connection's byte stream
  // (Connection::bytes_written() once it is written) and which connection
  // that was (Connection::id(); 0: none, as on the same-process path).
  uint64_t wire_end = 0;
  uint64_t wire_conn = 0;
};

// The send queue: a ring of max_send_wr WQE slots with per-slot room for
// max_send_sge SGEs and max_inline_data bytes. Guarded by Qp::mu.
class SendQueue {
 public:
  void Init(uint32_t depth, uint32_t max_sge, uint32_t max_inline);
  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  SendWqe& front() { return ring_[head_]; }
  SendWqe& operator[](size_t i) { return ring_[(head_ + i) % ring_.size()]; }
  // Appends a cleared WQE whose sges/inline_data point at its slot's room.
  // Requires size() < depth.
  SendWqe& push_back();
  void pop_front();
  void clear();
  // Bumped by clear(): a transmitter that dropped Qp::mu can tell that the
  // WQEs it copied were flushed meanwhile.
  uint64_t epoch() const { return epoch_; }

 private:
  std::vector<SendWqe> ring_;
  std::vector<Sge> sge_pool_;
  std::vector<uint8_t> inline_pool_;  // Allocated on first inline post.
  uint32_t max_sge_ = 0, max_inline_ = 0;
  size_t head_ = 0, count_ = 0;
  uint64_t epoch_ = 0;
};

struct RecvWqe {
  uint64_t wr_id = 0;
  uint32_t length = 0;  // Sum of SGE lengths.
  std::vector<Sge> sges;
};

class Connection;

// A queue pair. Shared-owned: the process QP table, the connection
// threads and the timer hold references while they work on it.
struct Qp {
  ibv_qp qp;  // Must be first (so no base classes).
  std::weak_ptr<Qp> self;
  Device* dev = nullptr;
  Pd* pd = nullptr;
  Cq* send_cq = nullptr;
  Cq* recv_cq = nullptr;
  ibv_qp_cap cap{};
  bool sq_sig_all = false;

  ferry::Mutex mu;
  // Current attributes (state in attr.qp_state).
  ibv_qp_attr attr ABSL_GUARDED_BY(mu){};
  // Posted, not yet completed, in order.
  SendQueue sq ABSL_GUARDED_BY(mu);
  // sq[0, send_index) have been transmitted.
  size_t send_index ABSL_GUARDED_BY(mu) = 0;
  std::deque<RecvWqe> rq ABSL_GUARDED_BY(mu);
  uint32_t next_msn ABSL_GUARDED_BY(mu) = 0;
  int retries_left ABSL_GUARDED_BY(mu) = 0;
  int rnr_retries_left ABSL_GUARDED_BY(mu) = 0;
  // No (re)transmission before this.
  Clock::time_point rnr_until ABSL_GUARDED_BY(mu){};
  bool retransmit_pending ABSL_GUARDED_BY(mu) = false;
  // The bytes of `conn` its peer's TCP had acknowledged and the bytes read
  // from it when the timer last looked, and which connection that was (see
  // requester_timer.cc).
  uint64_t timer_acked ABSL_GUARDED_BY(mu) = 0;
  uint64_t timer_read ABSL_GUARDED_BY(mu) = 0;
  uint64_t timer_conn ABSL_GUARDED_BY(mu) = 0;
  // Outgoing (requester) connection.
  std::shared_ptr<Connection> conn ABSL_GUARDED_BY(mu);
  // The connection the listener accepted for this QP (responder side); a
  // newer HELLO for the QP replaces it.
  std::shared_ptr<Connection> accepted ABSL_GUARDED_BY(mu);
  // The peer QP lives in this process.
  bool loopback ABSL_GUARDED_BY(mu) = false;
  // The same-process peer, found when the QP is connected (so the data
  // path needs no table lookup); unset if it did not exist then.
  std::weak_ptr<Qp> loop_peer ABSL_GUARDED_BY(mu);
  bool has_loop_peer ABSL_GUARDED_BY(mu) = false;
  in_addr peer_ip ABSL_GUARDED_BY(mu){};
  uint16_t peer_port ABSL_GUARDED_BY(mu) = 0;
  // Its source GID (at RTR) is RoCE v1: it talks only to v1 QPs. Atomic:
  // the same-process path reads the peer QP's without the peer's lock.
  std::atomic<bool> sgid_v1{false};
  // Unsignaled WQEs that completed: their SQ slots are retired only when a
  // later signaled WQE completes, as on hardware.
  uint32_t done_unsignaled ABSL_GUARDED_BY(mu) = 0;
  // Registered with the device timer.
  bool in_timer ABSL_GUARDED_BY(dev->timer_mu) = false;
  bool destroyed ABSL_GUARDED_BY(mu) = false;
  // Responder state (requests from the peer).
  uint32_t expected_msn ABSL_GUARDED_BY(mu) = 0;
  bool rnr_nak_outstanding ABSL_GUARDED_BY(mu) = false;
  bool seq_nak_outstanding ABSL_GUARDED_BY(mu) = false;

  // Serializes transmissions so frames leave in MSN order.
  ferry::Mutex send_mu;
};

// The owning reference of a QP handle; null once the QP is destroyed
// and its last user let go (cannot happen while the caller holds it).
inline std::shared_ptr<Qp> SharedQp(ibv_qp* qp) {
  return reinterpret_cast<Qp*>(qp)->self.lock();
}

// Process-wide QP table, by QP number.
std::shared_ptr<Qp> FindQp(uint32_t qpn);
// Every QP of `dev`.
std::vector<std::shared_ptr<Qp>> QpsOf(const Device* dev);

// Moves the QP to ERR (if not already), flushes both queues with
// IBV_WC_WR_FLUSH_ERR, and optionally raises an async event. Locks qp->mu.
void EnterError(const std::shared_ptr<Qp>& qp, int async_event /* -1: none */)
    ABSL_LOCKS_EXCLUDED(qp->mu);
// The same for a caller holding qp->mu that has just pushed the error
// completion causing it, and releases qp->mu: in one hold of the lock, so
// that whoever polls that completion and then queries the QP finds it in
// ERR, as on a NIC.
void EnterErrorAndUnlock(const std::shared_ptr<Qp>& qp)
    ABSL_UNLOCK_FUNCTION(qp->mu);

// Data path (the requester*.cc files, responder.cc, listener.cc).
int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
// Called on the RTR transition: opens the outgoing connection.
void ConnectQp(const std::shared_ptr<Qp>& qp);
// Called when a QP leaves RTS/RTR or is destroyed: closes its outgoing
// connection and, if `also_accepted` (RESET, destroy), the one its peer
// opened to it. A QP in ERR keeps that one: it still NAKs through it.
void DisconnectQp(const std::shared_ptr<Qp>& qp, bool also_accepted);
// Retransmits / times out. Called by the device timer thread.
Clock::time_point TimerWork(const std::shared_ptr<Qp>& qp,
                            Clock::time_point now);
void ScheduleTimer(const std::shared_ptr<Qp>& qp);
void TimerLoop(Device* dev);
// Runs the device's listener (listener.cc): accepts on `listen_fd`,
// reads HELLOs through `epoll_fd`, and hands identified connections to
// threads of their own.
void AcceptLoop(Device* dev, int listen_fd, int epoll_fd);
// Closes every connection of `dev` (link down, fault injection).
void CutDeviceConnections(Device* dev);

// IB's local ACK timeout: 4.096 us * 2^timeout (0: infinite).
Clock::duration AckTimeout(uint8_t timeout);
// IB's RNR NAK timer encoding (5 bits) in microseconds.
uint32_t RnrTimerMicros(uint8_t code);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_SOFTRNIC_H_
