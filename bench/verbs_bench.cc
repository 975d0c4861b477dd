// verbs_bench: raw libibverbs RDMA_WRITE benchmark between two processes,
// for measuring softrnic (or a real NIC) without the engine on top.
//   server: verbs_bench --role=server --port=18800
//   client: verbs_bench --role=client --host=127.0.0.1 --port=18800
//               --mode=bw --size=1048576
// Run on softrnic with tools/softrnic-run. QP information is exchanged over
// a TCP socket, as ibv_rc_pingpong does. Completions are awaited on a
// completion channel, never by spinning (a spinning poller starves the
// emulator on small machines). The last line is one JSON object.
//   --mode=wake (no verbs, no peer): the reference for lat -- two threads
// hand one byte back and forth through two pipes; a round trip is two
// thread wake-ups, where softrnic's is four (poster, responder, the
// requester's response thread, the application on its channel).
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "transport/softrnic/softrnic_control.h"

ABSL_FLAG(std::string, role, "server", "server | client");
ABSL_FLAG(std::string, host, "127.0.0.1", "bootstrap address");
ABSL_FLAG(int, port, 18800, "bootstrap TCP port");
ABSL_FLAG(std::string, device, "softrnic0", "verbs device name");
ABSL_FLAG(int, gid_index, 0, "GID index");
ABSL_FLAG(std::string, mode, "bw",
          "bw (throughput) | lat (round trip) | wake (two threads' pipe "
          "round trip, the reference for lat)");
ABSL_FLAG(uint64_t, size, 1 << 20, "bytes per RDMA_WRITE");
ABSL_FLAG(int, window, 8, "WRITEs in flight (bw mode)");
ABSL_FLAG(double, duration, 4, "seconds to measure");
ABSL_FLAG(double, warmup, 1, "seconds before measuring");

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "verbs_bench: %s: %s\n", what, std::strerror(errno));
  std::exit(1);
}

struct PeerInfo {
  uint32_t qpn;
  uint64_t addr;
  uint32_t rkey;
  uint8_t gid[16];
};

void ReadAll(int fd, void* p, size_t n) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::read(fd, b, n);
    if (r <= 0) Die("bootstrap read");
    b += r;
    n -= static_cast<size_t>(r);
  }
}

int Bootstrap(bool server) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(absl::GetFlag(FLAGS_port)));
  inet_pton(AF_INET, absl::GetFlag(FLAGS_host).c_str(), &sa.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (server) {
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
        ::listen(fd, 1) != 0) {
      Die("bootstrap listen");
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 30000) != 1) Die("no client within 30 s");
    int c = ::accept(fd, nullptr, nullptr);
    ::close(fd);
    return c;
  }
  for (int i = 0; i < 100; ++i) {  // The server may still be starting.
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) {
      return fd;
    }
    ::usleep(50000);
  }
  Die("bootstrap connect");
}

void WaitCompletions(ibv_comp_channel* ch, ibv_cq* cq, int want,
                     std::vector<ibv_wc>* out) {
  out->clear();
  ibv_wc wc[32];
  while (static_cast<int>(out->size()) < want) {
    int n = ibv_poll_cq(cq, 32, wc);
    if (n < 0) Die("poll_cq");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "verbs_bench: completion error: %s\n",
                     ibv_wc_status_str(wc[i].status));
        std::exit(1);
      }
      out->push_back(wc[i]);
    }
    if (n > 0) continue;
    // Arm, re-poll to close the race, then sleep on the channel.
    if (ibv_req_notify_cq(cq, 0) != 0) Die("req_notify_cq");
    n = ibv_poll_cq(cq, 32, wc);
    if (n > 0) {
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) Die("completion error");
        out->push_back(wc[i]);
      }
      continue;
    }
    ibv_cq* ev_cq;
    void* ev_ctx;
    if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) != 0) Die("get_cq_event");
    ibv_ack_cq_events(ev_cq, 1);
  }
}

}  // namespace

// From the end of --warmup to the end of --duration after it.
std::pair<Clock::time_point, Clock::time_point> MeasuredWindow() {
  auto secs = [](double s) {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(s));
  };
  const Clock::time_point start =
      Clock::now() + secs(absl::GetFlag(FLAGS_warmup));
  return {start, start + secs(absl::GetFlag(FLAGS_duration))};
}

// The JSON line of a latency mode: `fields`, then samples, p50 and p99.
void PrintRoundTrips(const char* fields, std::vector<double>* rtt_us) {
  std::sort(rtt_us->begin(), rtt_us->end());
  auto pct = [&](double p) {
    return rtt_us->empty()
               ? 0.0
               : (*rtt_us)[static_cast<size_t>(p * (rtt_us->size() - 1))];
  };
  std::printf("{%s,\"samples\":%zu,\"p50_us\":%.1f,\"p99_us\":%.1f}\n", fields,
              rtt_us->size(), pct(0.5), pct(0.99));
}

// --mode=wake: p50/p99 of a pipe round trip between two threads.
int WakeReference() {
  int ping[2], pong[2];
  if (::pipe(ping) != 0 || ::pipe(pong) != 0) Die("pipe");
  std::thread echo([&] {
    char c;
    while (::read(ping[0], &c, 1) == 1 && c != 'q') {
      if (::write(pong[1], &c, 1) != 1) Die("pipe write");
    }
  });
  const auto [start, end] = MeasuredWindow();
  std::vector<double> rtt_us;
  char c = 'p';
  while (Clock::now() < end) {
    const auto t0 = Clock::now();
    if (::write(ping[1], &c, 1) != 1 || ::read(pong[0], &c, 1) != 1) {
      Die("pipe round trip");
    }
    if (t0 >= start) {
      rtt_us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  c = 'q';
  if (::write(ping[1], &c, 1) != 1) Die("pipe write");
  echo.join();
  PrintRoundTrips("\"mode\":\"wake\"", &rtt_us);
  return 0;
}

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_mode) == "wake") return WakeReference();
  const bool server = absl::GetFlag(FLAGS_role) == "server";
  const bool lat = absl::GetFlag(FLAGS_mode) == "lat";
  const size_t size = lat ? 8 : absl::GetFlag(FLAGS_size);
  const int window = lat ? 1 : std::max(1, absl::GetFlag(FLAGS_window));

  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) Die("ibv_get_device_list");
  ibv_device* dev = nullptr;
  for (int i = 0; i < num; ++i) {
    if (absl::GetFlag(FLAGS_device) == ibv_get_device_name(list[i])) {
      dev = list[i];
    }
  }
  if (dev == nullptr) {
    errno = ENODEV;
    Die("device not found");
  }
  ibv_context* ctx = ibv_open_device(dev);
  ibv_free_device_list(list);
  if (ctx == nullptr) Die("ibv_open_device");
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 2 * window + 16, nullptr, ch, 0);
  if (pd == nullptr || ch == nullptr || cq == nullptr) Die("pd/channel/cq");
  const size_t buf_size = size * static_cast<size_t>(window);
  auto* buf = static_cast<uint8_t*>(
      aligned_alloc(4096, (buf_size + 4095) / 4096 * 4096));
  std::memset(buf, 0x5a, buf_size);
  ibv_mr* mr = ibv_reg_mr(pd, buf, buf_size,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (mr == nullptr) Die("ibv_reg_mr");
  ibv_qp_init_attr init{};
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = static_cast<uint32_t>(window) + 4;
  init.cap.max_recv_wr = 4;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(pd, &init);
  if (qp == nullptr) Die("ibv_create_qp");

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                        IBV_QP_ACCESS_FLAGS)) {
    Die("modify INIT");
  }
  PeerInfo mine{}, peer{};
  mine.qpn = qp->qp_num;
  mine.addr = reinterpret_cast<uint64_t>(buf);
  mine.rkey = mr->rkey;
  ibv_gid gid;
  if (ibv_query_gid(ctx, 1, absl::GetFlag(FLAGS_gid_index), &gid)) {
    Die("query_gid");
  }
  std::memcpy(mine.gid, gid.raw, 16);
  int boot = Bootstrap(server);
  if (::write(boot, &mine, sizeof(mine)) != sizeof(mine)) Die("bootstrap");
  ReadAll(boot, &peer, sizeof(peer));

  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer.qpn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.port_num = 1;
  std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
  a.ah_attr.grh.sgid_index =
      static_cast<uint8_t>(absl::GetFlag(FLAGS_gid_index));
  a.ah_attr.grh.hop_limit = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                        IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
    Die("modify RTR");
  }
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                        IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC)) {
    Die("modify RTS");
  }
  char go = 'g';
  if (::write(boot, &go, 1) != 1) Die("bootstrap");
  ReadAll(boot, &go, 1);  // Both sides are in RTS.

  if (server) {
    ReadAll(boot, &go, 1);  // The client says when it is done.
    std::printf("{\"role\":\"server\",\"ok\":true}\n");
    return 0;
  }

  auto post = [&](int slot) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf) + size * slot,
                static_cast<uint32_t>(size), mr->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = static_cast<uint64_t>(slot);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED | (size <= 64 ? IBV_SEND_INLINE : 0);
    wr.wr.rdma.remote_addr = peer.addr + size * slot;
    wr.wr.rdma.rkey = peer.rkey;
    if (ibv_post_send(qp, &wr, &bad)) Die("post_send");
  };
  const auto [start, end] = MeasuredWindow();
  std::vector<ibv_wc> done;
  std::vector<double> rtt_us;
  uint64_t bytes = 0;
  if (lat) {
    while (Clock::now() < end) {
      auto t0 = Clock::now();
      post(0);
      WaitCompletions(ch, cq, 1, &done);
      auto t1 = Clock::now();
      if (t0 >= start) {
        rtt_us.push_back(
            std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
    }
  } else {
    for (int s = 0; s < window; ++s) post(s);
    auto measured_from = Clock::now();
    bool measuring = false;
    while (true) {
      WaitCompletions(ch, cq, 1, &done);
      auto now = Clock::now();
      if (!measuring && now >= start) {
        measuring = true;
        measured_from = now;
        bytes = 0;
      }
      bytes += size * done.size();
      if (now >= end) break;
      for (const ibv_wc& wc : done) post(static_cast<int>(wc.wr_id));
    }
    double secs =
        std::chrono::duration<double>(Clock::now() - measured_from).count();
    // On softrnic, how often its ACK timer fired (go-back-N resends): on
    // a link slower than the timeout allows for, the cost behind a low
    // figure. -1 on other libibverbs.
    uint64_t timeouts = 0;
    const long long ack_timeouts =
        softrnic::AckTimeouts(absl::GetFlag(FLAGS_device).c_str(), &timeouts) ==
                0
            ? static_cast<long long>(timeouts)
            : -1;
    std::printf(
        "{\"mode\":\"bw\",\"size\":%zu,\"window\":%d,\"seconds\":%.3f,"
        "\"throughput_gbps\":%.4f,\"ack_timeouts\":%lld}\n",
        size, window, secs, static_cast<double>(bytes) / secs / 1e9,
        ack_timeouts);
  }
  if (lat) {
    PrintRoundTrips("\"mode\":\"lat\",\"size\":8", &rtt_us);
  }
  if (::write(boot, &go, 1) != 1) Die("bootstrap");
  // Let outstanding WRITEs drain before tearing down.
  std::fflush(stdout);
  return 0;
}
