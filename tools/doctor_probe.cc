#include "tools/doctor_probe.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/pattern.h"
#include "common/status_macros.h"

namespace ferry::doctor {
namespace {

constexpr absl::Duration kCompletionTimeout = absl::Seconds(3);
constexpr int kLatencySamples = 50;
// A probe's RC ACK timeout (4.096 us x 2^timeout) and retries. A real NIC
// acknowledges in microseconds whatever the host's load, so a peer silent
// for 4 x 16.8 ms = 67 ms is not reachable. softrnic acknowledges from a
// thread of the peer's process, which a loaded host may not run for that
// long (a stress run at load 10 saw both rails of a healthy pair fail):
// there, 4 x 537 ms = 2.1 s, inside the 3 s the doctor waits.
constexpr uint8_t kProbeTimeout = 12;
constexpr uint8_t kEmulatedProbeTimeout = 17;
constexpr uint8_t kProbeRetries = 3;

bool EmulatedNics() {
  return dlsym(RTLD_DEFAULT, "softrnic_version") != nullptr;
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

}  // namespace

Probe::~Probe() {
  if (qp != nullptr) ibv_destroy_qp(qp);
  if (mr != nullptr) ibv_dereg_mr(mr);
}

absl::StatusOr<std::unique_ptr<Probe>> NewProbe(ibv_device* dev) {
  auto p = std::make_unique<Probe>();
  auto nic = rdma::Nic::Open(dev, rdma::EffectiveGidIndex(RdmaOptions()));
  if (!nic.ok()) return nic.status();
  p->nic = std::move(*nic);
  rdma::QpCaps caps;
  auto qp = rdma::CreateQp(p->nic.get(), rdma::QpPosting{}, &caps);
  if (!qp.ok()) return qp.status();
  p->qp = *qp;
  p->buf.reset(new uint8_t[kProbeBufferBytes]());
  p->mr = ibv_reg_mr(p->nic->pd(), p->buf.get(), kProbeBufferBytes,
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
  t.timeout = EmulatedNics() ? kEmulatedProbeTimeout : kProbeTimeout;
  t.retry_count = kProbeRetries;
  return t;
}

absl::Status WriteReadVerify(Probe* p, uint32_t len, uint64_t remote,
                             uint32_t rkey, uint32_t seed) {
  if (len > kProbeBufferBytes / 2) {
    return absl::InvalidArgumentError("probe longer than its buffer");
  }
  uint8_t* buf = p->buf.get();
  FillPattern(buf, len, 0, seed);
  std::memset(buf + kProbeBufferBytes / 2, 0, len);
  const uint64_t base = reinterpret_cast<uint64_t>(buf);
  absl::Status s = RunOne(p, IBV_WR_RDMA_WRITE, base, len, remote, rkey);
  if (s.ok()) {
    s = RunOne(p, IBV_WR_RDMA_READ, base + kProbeBufferBytes / 2, len, remote,
               rkey);
  }
  if (s.ok() &&
      CheckPattern(buf + kProbeBufferBytes / 2, len, 0, seed) != len) {
    s = absl::DataLossError("the READ returned other bytes than were written");
  }
  return s;
}

absl::StatusOr<double> WriteLatencyUs(Probe* p, uint64_t remote,
                                      uint32_t rkey) {
  std::vector<double> us;
  const uint64_t base = reinterpret_cast<uint64_t>(p->buf.get());
  for (int i = 0; i < kLatencySamples; ++i) {
    const absl::Time t0 = absl::Now();
    FERRY_RETURN_IF_ERROR(RunOne(p, IBV_WR_RDMA_WRITE, base, 8, remote, rkey));
    us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

Check PairVerdict(const std::string& name, const Probe& p, uint32_t remote_mtu,
                  uint32_t bytes, double p50_us) {
  const ibv_mtu local_mtu = p.nic->active_mtu();
  const bool mismatch =
      remote_mtu != 0 && remote_mtu != static_cast<uint32_t>(local_mtu);
  const std::string detail = absl::StrCat(
      "WRITE and READ of ", bytes, " B verified; 8 B WRITE p50 ",
      absl::StrFormat("%.1f", p50_us), " us; MTU ", 128 << local_mtu, " here, ",
      remote_mtu ? 128 << remote_mtu : 0, " there");
  return {name, mismatch ? Level::kFail : Level::kOk, detail,
          mismatch ? "MTU mismatch: the path runs at the smaller one; give "
                     "both hosts' netdevs and the switch ports the same "
                     "(jumbo) MTU"
                   : ""};
}

Check UnreachableVerdict(const std::string& name, const absl::Status& s) {
  return {name, Level::kFail, std::string(s.message()),
          "no answer from the peer NIC on this rail: check that the two "
          "addresses route to each other (ping from this NIC's address), "
          "the VLAN and PFC/ECN settings, and that both use RoCE v2"};
}

std::map<std::string, ibv_device*> Devices(
    const std::vector<std::string>& filter) {
  std::map<std::string, ibv_device*> out;
  auto list = rdma::ListDevices(filter);
  if (!list.ok()) return out;
  for (ibv_device* d : *list) out[ibv_get_device_name(d)] = d;
  return out;
}

}  // namespace ferry::doctor
