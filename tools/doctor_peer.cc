#include "tools/doctor_peer.h"

#include <infiniband/verbs.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/pattern.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "tools/doctor_probe.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/qp.h"

namespace ferry::doctor {
namespace {

constexpr size_t kProbeBytes = 4096;
constexpr size_t kMaxLine = 8192;
constexpr absl::Duration kLineTimeout = absl::Seconds(10);

absl::StatusOr<std::string> ReadLine(int fd) {
  std::string line;
  char c;
  while (line.size() < kMaxLine) {
    FERRY_RETURN_IF_ERROR(ReadFull(fd, &c, 1));
    if (c == '\n') return line;
    line.push_back(c);
  }
  return absl::InvalidArgumentError("line too long");
}

absl::Status WriteLine(int fd, const std::string& line) {
  return WriteFull(fd, (line + "\n").data(), line.size() + 1);
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
      if (!absl::SimpleAtoi(f[1], &seed)) return;
      const bool same =
          CheckPattern(probe->buf.get(), kProbeBytes, 0, seed) == kProbeBytes;
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
      s = WriteReadVerify(&probe, kProbeBytes, addr, rkey, seed);
      if (s.ok() && WriteLine(fd, absl::StrCat("VERIFY ", seed)).ok()) {
        auto v = ReadLine(fd);
        if (!v.ok() || *v != "OK") {
          s = absl::DataLossError(v.ok() ? *v
                                         : std::string(v.status().message()));
        }
      }
      const absl::StatusOr<double> p50 =
          s.ok() ? WriteLatencyUs(&probe, addr, rkey)
                 : absl::StatusOr<double>(s);
      WriteLine(fd, "DONE").IgnoreError();
      ++seed;
      if (!p50.ok()) {
        out->push_back(UnreachableVerdict(name, p50.status()));
        continue;
      }
      out->push_back(PairVerdict(name, probe, info->mtu(), kProbeBytes, *p50));
    }
  }
  WriteLine(fd, "BYE").IgnoreError();
}

}  // namespace ferry::doctor
