#include "tools/doctor_peer.h"

#include <infiniband/verbs.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/socket_util.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/nic.h"
#include "transport/rdma/qp.h"

namespace ferry::doctor {
namespace {

constexpr size_t kBuffer = 64 << 10;
constexpr size_t kProbeBytes = 4096;
constexpr size_t kMaxLine = 8192;
constexpr int kLatencySamples = 50;
constexpr absl::Duration kLineTimeout = absl::Seconds(10);
constexpr absl::Duration kCompletionTimeout = absl::Seconds(3);
// Short RC timers: an unreachable NIC fails the probe in about
// 4.096 us * 2^12 * 4 = 67 ms instead of Ferry's half second.
constexpr uint8_t kProbeTimeout = 12;
constexpr uint8_t kProbeRetries = 3;

void Fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i)
    p[i] = static_cast<uint8_t>(seed * 131 + i * 7);
}

absl::StatusOr<std::string> ReadLine(int fd) {
  std::string line;
  char c;
  while (line.size() < kMaxLine) {
    if (absl::Status s = ReadFull(fd, &c, 1); !s.ok()) return s;
    if (c == '\n') return line;
    line.push_back(c);
  }
  return absl::InvalidArgumentError("line too long");
}

absl::Status WriteLine(int fd, const std::string& line) {
  return WriteFull(fd, (line + "\n").data(), line.size() + 1);
}

std::map<std::string, ibv_device*> Devices(
    const std::vector<std::string>& filter) {
  std::map<std::string, ibv_device*> out;
  auto list = rdma::ListDevices(filter);
  if (!list.ok()) return out;
  for (ibv_device* d : *list) out[ibv_get_device_name(d)] = d;
  return out;
}

// One probe's verbs objects.
struct Probe {
  std::unique_ptr<rdma::Nic> nic;
  ibv_qp* qp = nullptr;
  std::unique_ptr<uint8_t[]> buf;
  ibv_mr* mr = nullptr;
  ~Probe() {
    if (qp != nullptr) ibv_destroy_qp(qp);
    if (mr != nullptr) ibv_dereg_mr(mr);
  }
};

absl::StatusOr<std::unique_ptr<Probe>> NewProbe(ibv_device* dev) {
  auto p = std::make_unique<Probe>();
  auto nic = rdma::Nic::Open(dev, rdma::EffectiveGidIndex(RdmaOptions()));
  if (!nic.ok()) return nic.status();
  p->nic = std::move(*nic);
  rdma::QpCaps caps;
  auto qp = rdma::CreateQp(p->nic.get(), &caps);
  if (!qp.ok()) return qp.status();
  p->qp = *qp;
  p->buf.reset(new uint8_t[kBuffer]());
  p->mr = ibv_reg_mr(p->nic->pd(), p->buf.get(), kBuffer,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                         IBV_ACCESS_REMOTE_READ);
  if (p->mr == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ibv_reg_mr: ", std::strerror(errno)));
  }
  return p;
}

rdma::QpTimers ProbeTimers() {
  rdma::QpTimers t;
  t.timeout = kProbeTimeout;
  t.retry_count = kProbeRetries;
  return t;
}

std::string Describe(const Probe& p) {
  rdma::QpInfo info;
  rdma::DescribeQp(p.qp, p.nic.get(), &info);
  return absl::BytesToHexString(info.SerializeAsString());
}

absl::StatusOr<rdma::QpInfo> ParseInfo(absl::string_view hex) {
  rdma::QpInfo info;
  if (!info.ParseFromString(absl::HexStringToBytes(hex))) {
    return absl::InvalidArgumentError("bad QP information");
  }
  return info;
}

// Posts one signaled WR and waits for its completion (bounded).
absl::Status RunOne(Probe* p, ibv_wr_opcode op, uint64_t local, uint32_t len,
                    uint64_t remote, uint32_t rkey) {
  ibv_sge sge{local, len, p->mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  if (int rc = ibv_post_send(p->qp, &wr, &bad); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("ibv_post_send: ", std::strerror(rc)));
  }
  const absl::Time deadline = absl::Now() + kCompletionTimeout;
  ibv_wc wc{};
  while (absl::Now() < deadline) {
    const int n = ibv_poll_cq(p->nic->cq(), 1, &wc);
    if (n < 0) return absl::UnavailableError("ibv_poll_cq failed");
    if (n == 1) {
      if (wc.status == IBV_WC_SUCCESS) return absl::OkStatus();
      return absl::UnavailableError(ibv_wc_status_str(wc.status));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return absl::DeadlineExceededError("no completion within 3 s");
}

// Serves one client's probes until it says BYE or goes away.
void ServeClient(int fd, const std::map<std::string, ibv_device*>& devices) {
  SetRecvTimeout(fd, kLineTimeout);
  std::unique_ptr<Probe> probe;
  while (true) {
    auto line = ReadLine(fd);
    if (!line.ok()) return;
    std::vector<std::string> f = absl::StrSplit(*line, ' ', absl::SkipEmpty());
    if (f.empty()) return;
    if (f[0] == "NICS") {
      std::vector<std::string> names;
      for (const auto& [name, dev] : devices) names.push_back(name);
      if (!WriteLine(fd, "NICS " + absl::StrJoin(names, " ")).ok()) return;
    } else if (f[0] == "PROBE" && f.size() == 3) {
      probe.reset();
      auto it = devices.find(f[1]);
      absl::Status s = it == devices.end()
                           ? absl::NotFoundError("no such NIC here")
                           : absl::OkStatus();
      absl::StatusOr<rdma::QpInfo> remote = ParseInfo(f[2]);
      if (s.ok()) s = remote.status();
      if (s.ok()) {
        auto p = NewProbe(it->second);
        s = p.status();
        if (s.ok()) probe = std::move(*p);
      }
      if (s.ok())
        s = rdma::ConnectQp(probe->qp, probe->nic.get(), *remote,
                            ProbeTimers());
      const std::string reply =
          s.ok() ? absl::StrCat("OK ", Describe(*probe), " ",
                                reinterpret_cast<uint64_t>(probe->buf.get()),
                                " ", probe->mr->rkey)
                 : absl::StrCat("ERR ", s.message());
      if (!WriteLine(fd, reply).ok()) return;
    } else if (f[0] == "VERIFY" && f.size() == 2 && probe != nullptr) {
      uint32_t seed = 0;
      std::vector<uint8_t> want(kProbeBytes);
      if (!absl::SimpleAtoi(f[1], &seed)) return;
      Fill(want.data(), want.size(), seed);
      const bool same =
          std::memcmp(want.data(), probe->buf.get(), kProbeBytes) == 0;
      if (!WriteLine(fd, same ? "OK" : "ERR the WRITE left other bytes").ok()) {
        return;
      }
    } else if (f[0] == "DONE") {
      probe.reset();
    } else {
      return;  // BYE or garbage.
    }
  }
}

}  // namespace

absl::Status Serve(uint16_t port, const std::vector<std::string>& filter,
                   double seconds) {
  const auto devices = Devices(filter);
  if (devices.empty()) return absl::NotFoundError("no RDMA device to offer");
  uint16_t bound = 0;
  auto listener = ListenTcp("", port, &bound);
  if (!listener.ok()) return listener.status();
  std::printf("doctor serving %zu NIC(s) on port %u\n", devices.size(), bound);
  std::fflush(stdout);
  const absl::Time end = seconds > 0 ? absl::Now() + absl::Seconds(seconds)
                                     : absl::InfiniteFuture();
  SetRecvTimeout(listener->get(), absl::Milliseconds(200));
  while (absl::Now() < end) {
    UniqueFd conn(::accept(listener->get(), nullptr, nullptr));
    if (!conn.valid()) continue;  // Timed out: check the clock again.
    ServeClient(conn.get(), devices);
  }
  return absl::OkStatus();
}

void ProbePeer(const std::string& peer, const std::vector<std::string>& filter,
               std::vector<Check>* out) {
  auto fail = [&](const std::string& name, const std::string& detail,
                  const std::string& fix) {
    out->push_back({name, Level::kFail, detail, fix});
  };
  auto hp = ParseHostPort(peer);
  if (!hp.ok()) {
    fail("peer", std::string(hp.status().message()), "--peer=host:port");
    return;
  }
  auto conn = ConnectTcp(*hp, absl::Seconds(5));
  if (!conn.ok()) {
    fail("peer",
         absl::StrCat("cannot reach ", peer, ": ", conn.status().message()),
         "start 'doctor --serve=PORT' on the peer host and open that port");
    return;
  }
  const int fd = conn->get();
  SetRecvTimeout(fd, kLineTimeout);
  std::vector<std::string> remote_nics;
  if (WriteLine(fd, "NICS").ok()) {
    if (auto line = ReadLine(fd); line.ok()) {
      remote_nics = absl::StrSplit(*line, ' ', absl::SkipEmpty());
      if (!remote_nics.empty()) remote_nics.erase(remote_nics.begin());
    }
  }
  const auto local = Devices(filter);
  if (remote_nics.empty() || local.empty()) {
    fail("peer", "no NIC pair to probe",
         "both sides need an ACTIVE RDMA NIC (see the checks above)");
    return;
  }
  uint32_t seed = 1;
  for (const auto& [lname, ldev] : local) {
    for (const std::string& rname : remote_nics) {
      const std::string name = absl::StrCat("peer ", lname, " -> ", rname);
      auto p = NewProbe(ldev);
      if (!p.ok()) {
        fail(name, std::string(p.status().message()),
             "fix the local NIC first");
        continue;
      }
      Probe& probe = **p;
      if (!WriteLine(fd, absl::StrCat("PROBE ", rname, " ", Describe(probe)))
               .ok()) {
        fail(name, "the peer went away", "is 'doctor --serve' still running?");
        return;
      }
      auto reply = ReadLine(fd);
      std::vector<std::string> f;
      if (reply.ok()) f = absl::StrSplit(*reply, absl::MaxSplits(' ', 3));
      if (!reply.ok() || f.empty() || f[0] != "OK" || f.size() != 4) {
        fail(name,
             absl::StrCat("the peer could not set up its QP: ",
                          reply.ok() ? *reply : reply.status().ToString()),
             "see the peer's own doctor checks");
        WriteLine(fd, "DONE").IgnoreError();
        continue;
      }
      auto info = ParseInfo(f[1]);
      uint64_t addr = 0;
      uint32_t rkey = 0;
      absl::Status s = info.status();
      if (s.ok() &&
          (!absl::SimpleAtoi(f[2], &addr) || !absl::SimpleAtoi(f[3], &rkey))) {
        s = absl::InvalidArgumentError("bad reply");
      }
      if (s.ok())
        s = rdma::ConnectQp(probe.qp, probe.nic.get(), *info, ProbeTimers());
      if (!s.ok()) {
        fail(name, absl::StrCat("QP set-up refused: ", s.message()),
             "the two NICs disagree on MTU or GID type; compare both "
             "doctors' MTU and GID lines");
        WriteLine(fd, "DONE").IgnoreError();
        continue;
      }
      uint8_t* buf = probe.buf.get();
      Fill(buf, kProbeBytes, seed);
      const uint64_t base = reinterpret_cast<uint64_t>(buf);
      s = RunOne(&probe, IBV_WR_RDMA_WRITE, base, kProbeBytes, addr, rkey);
      if (s.ok()) {
        s = RunOne(&probe, IBV_WR_RDMA_READ, base + kProbeBytes, kProbeBytes,
                   addr, rkey);
      }
      if (s.ok() && std::memcmp(buf, buf + kProbeBytes, kProbeBytes) != 0) {
        s = absl::DataLossError("the READ returned other bytes");
      }
      std::string verdict;
      if (s.ok() && WriteLine(fd, absl::StrCat("VERIFY ", seed)).ok()) {
        auto v = ReadLine(fd);
        if (!v.ok() || *v != "OK") {
          s = absl::DataLossError(v.ok() ? *v
                                         : std::string(v.status().message()));
        }
      }
      std::vector<double> us;
      for (int i = 0; s.ok() && i < kLatencySamples; ++i) {
        const absl::Time t0 = absl::Now();
        s = RunOne(&probe, IBV_WR_RDMA_WRITE, base, 8, addr, rkey);
        us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      }
      WriteLine(fd, "DONE").IgnoreError();
      ++seed;
      if (!s.ok()) {
        fail(name, std::string(s.message()),
             "no answer from the peer NIC on this rail: check that the two "
             "addresses route to each other (ping from this NIC's address), "
             "the VLAN and PFC/ECN settings, and that both use RoCE v2");
        continue;
      }
      std::sort(us.begin(), us.end());
      const ibv_mtu local_mtu = probe.nic->active_mtu();
      const bool mismatch =
          info->mtu() != 0 && info->mtu() != static_cast<uint32_t>(local_mtu);
      const std::string detail = absl::StrCat(
          "WRITE and READ of ", kProbeBytes, " B verified; 8 B WRITE p50 ",
          absl::StrFormat("%.1f", us[us.size() / 2]), " us; MTU ",
          128 << local_mtu, " here, ", info->mtu() ? 128 << info->mtu() : 0,
          " there");
      out->push_back(
          {name, mismatch ? Level::kFail : Level::kOk, detail,
           mismatch ? "MTU mismatch: the path runs at the smaller one; give "
                      "both hosts' netdevs and the switch ports the same "
                      "(jumbo) MTU"
                    : ""});
    }
  }
  WriteLine(fd, "BYE").IgnoreError();
}

}  // namespace ferry::doctor
