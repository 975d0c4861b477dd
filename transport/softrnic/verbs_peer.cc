// verbs_peer: the remote side of softrnic's two-process tests. It runs on
// softrnic because it inherits LD_LIBRARY_PATH (and FERRY_SOFTRNIC_DEVICES)
// from the test that starts it. It prints "ready <pid>" (or "err <why>"),
// then answers one command per line on stdin with one line, "ok ..." or
// "err <why>":
//   devices                        -> ok <name>=<gid hex> ...
//   open <dev> <bufsize>           -> ok <qpn> <gid hex> <buf addr> <rkey>
//       (one PD, CQ, RC QP in RESET and a fully accessible buffer)
//   connect <qpn> <gid hex> <timeout> <retry_cnt> <rnr_retry> <min_rnr>
//                                  -> ok          (RESET -> RTS)
//   fill <off> <len> <seed>        -> ok          (FillPattern)
//   sum <off> <len>                -> ok <fnv1a hex>
//   recv <wr_id> <off> <len>       -> ok          (posts a receive)
//   write|read <wr_id> <off> <len> <raddr> <rkey>  -> ok (signaled)
//   send <wr_id> <off> <len> <imm hex|->           -> ok (signaled)
//   poll <timeout_ms>              -> ok <wr_id> <status> <opcode>
//                                     <byte_len> <imm hex|->, or err timeout
//   state                          -> ok <qp state number>
//   close                          -> ok          (destroys all; open again)
//   exit_on_recv <wr_id> <off> <len> -> ok; then, once the receive has
//       completed, "ok <wr_id> <status>" and the process exits at once, as
//       an application that got its last message would
//   run <shell command>            -> ok, or err <exit status> (e.g. ip
//                                     commands in the peer's namespace)
//   gid                            -> ok <gid hex> (of the open device)
//   await_event <type> <timeout_ms> -> ok once async event <type> arrived
//                                     (others are skipped), or err timeout
//   no_event <ms>                  -> ok if no async event arrives within
//                                     <ms>, else err <event type>
//   strict <0|1>                   -> ok, or err <errno> (SetStrictPages)
//   remap <off> <len> <seed>       -> ok: maps new memory (FillPattern seed)
//                                     over buffer pages [off, off+len), as a
//                                     free() and reuse would
//   violations                     -> ok <StrictPageViolations()>
//   quit                           -> ok, then exits 0 (as on stdin EOF)
// Flags --setenv=NAME=VALUE and --unsetenv=NAME change the environment and
// re-execute the peer before any verb runs, so that softrnic reads its
// device configuration from the changed environment.
#include <arpa/inet.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "transport/softrnic/softrnic_control.h"
#include "transport/softrnic/verbs_test_util.h"

namespace softrnic_test {
namespace {

class Peer {
 public:
  ~Peer() {
    endpoint_.reset();
    if (ctx_ != nullptr) ibv_close_device(ctx_);
  }

  // Runs one command line; returns the answer line.
  std::string Handle(const std::string& line) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "devices") return Devices();
    if (cmd == "open") {
      std::string dev;
      size_t size = 0;
      if (!(in >> dev >> size)) return "err usage";
      return Open(dev, size);
    }
    if (cmd == "run") {
      std::string rest;
      std::getline(in, rest);
      const int rc = std::system(rest.c_str());
      return rc == 0 ? "ok" : "err " + std::to_string(rc);
    }
    if (cmd == "strict") {
      int on = 0;
      if (!(in >> on)) return "err usage";
      if (softrnic::SetStrictPages(on != 0) != 0) {
        return "err " + std::to_string(errno);
      }
      return "ok";
    }
    if (cmd == "violations") {
      return "ok " + std::to_string(softrnic::StrictPageViolations());
    }
    if (endpoint_ == nullptr) return "err not open";
    if (cmd == "remap") {
      size_t off, len;
      uint32_t seed;
      if (!(in >> off >> len >> seed)) return "err usage";
      if (off % 4096 != 0 || len % 4096 != 0 || off + len > buf_->size()) {
        return "err bad range";
      }
      void* p = mmap(buf_->data() + off, len, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (p == MAP_FAILED) return "err mmap";
      FillPattern(static_cast<uint8_t*>(p), len, seed);
      return "ok";
    }
    if (cmd == "gid") {
      ibv_gid gid = {};
      if (ibv_query_gid(ctx_, 1, 0, &gid) != 0) return "err query_gid";
      return "ok " + GidToHex(gid);
    }
    if (cmd == "await_event") {
      int type = 0, timeout_ms = 0;
      if (!(in >> type >> timeout_ms)) return "err usage";
      ibv_async_event ev = {};
      std::vector<ibv_event_type> skipped;
      if (!WaitAsyncEvent(ctx_, static_cast<ibv_event_type>(type), &ev,
                          timeout_ms, &skipped)) {
        std::string seen;
        for (ibv_event_type t : skipped) seen += " " + std::to_string(t);
        return "err timeout; saw" + seen;
      }
      return "ok";
    }
    if (cmd == "no_event") {
      int ms = 0;
      if (!(in >> ms)) return "err usage";
      ibv_async_event ev = {};
      if (NextAsyncEvent(ctx_, &ev, ms)) {
        return "err " + std::to_string(ev.event_type);
      }
      return "ok";
    }
    if (cmd == "close") {
      endpoint_.reset();
      buf_ = nullptr;
      ibv_close_device(ctx_);
      ctx_ = nullptr;
      return "ok";
    }
    if (cmd == "connect") {
      uint32_t qpn;
      std::string gid_hex;
      int timeout, retry, rnr_retry, min_rnr;
      if (!(in >> qpn >> gid_hex >> timeout >> retry >> rnr_retry >> min_rnr))
        return "err usage";
      ibv_gid gid;
      if (!HexToGid(gid_hex, &gid)) return "err bad gid";
      ConnectOptions o;
      o.timeout = static_cast<uint8_t>(timeout);
      o.retry_cnt = static_cast<uint8_t>(retry);
      o.rnr_retry = static_cast<uint8_t>(rnr_retry);
      o.min_rnr_timer = static_cast<uint8_t>(min_rnr);
      std::string err;
      if (ConnectQp(endpoint_->qp(), qpn, gid, o, &err) != 0)
        return "err " + err;
      return "ok";
    }
    if (cmd == "fill" || cmd == "sum") {
      size_t off, len;
      uint32_t seed = 0;
      if (!(in >> off >> len)) return "err usage";
      if (off + len > buf_->size()) return "err out of range";
      if (cmd == "sum") {
        char hex[32];
        std::snprintf(
            hex, sizeof(hex), "%016llx",
            static_cast<unsigned long long>(Fnv1a(buf_->data() + off, len)));
        return std::string("ok ") + hex;
      }
      if (!(in >> seed)) return "err usage";
      FillPattern(buf_->data() + off, len, seed);
      return "ok";
    }
    if (cmd == "recv") {
      uint64_t wr_id;
      size_t off, len;
      if (!(in >> wr_id >> off >> len)) return "err usage";
      int rc = PostRecvBuf(endpoint_->qp(), wr_id, buf_, off,
                           static_cast<uint32_t>(len));
      return rc == 0 ? "ok" : "err post_recv " + std::to_string(rc);
    }
    if (cmd == "exit_on_recv") {
      uint64_t wr_id;
      size_t off, len;
      if (!(in >> wr_id >> off >> len)) return "err usage";
      int rc = PostRecvBuf(endpoint_->qp(), wr_id, buf_, off,
                           static_cast<uint32_t>(len));
      if (rc != 0) return "err post_recv " + std::to_string(rc);
      std::printf("ok\n");
      std::fflush(stdout);
      ibv_wc wc = {};
      if (!PollOne(endpoint_->cq(), &wc)) return "err timeout";
      std::printf("ok %llu %d\n", static_cast<unsigned long long>(wc.wr_id),
                  wc.status);
      std::fflush(stdout);
      _exit(0);
    }
    if (cmd == "write" || cmd == "read") {
      uint64_t wr_id, raddr;
      size_t off, len;
      uint32_t rkey;
      if (!(in >> wr_id >> off >> len >> raddr >> rkey)) return "err usage";
      int rc =
          PostRdma(endpoint_->qp(),
                   cmd == "write" ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ, wr_id,
                   buf_, off, static_cast<uint32_t>(len), raddr, rkey);
      return rc == 0 ? "ok" : "err post_send " + std::to_string(rc);
    }
    if (cmd == "send") {
      uint64_t wr_id;
      size_t off, len;
      std::string imm;
      if (!(in >> wr_id >> off >> len >> imm)) return "err usage";
      bool with_imm = imm != "-";
      uint32_t imm_value =
          with_imm ? static_cast<uint32_t>(std::stoul(imm, nullptr, 16)) : 0;
      int rc = PostSendMsg(endpoint_->qp(), wr_id, buf_, off,
                           static_cast<uint32_t>(len), with_imm, imm_value);
      return rc == 0 ? "ok" : "err post_send " + std::to_string(rc);
    }
    if (cmd == "poll") {
      int timeout_ms = 0;
      if (!(in >> timeout_ms)) return "err usage";
      ibv_wc wc = {};
      if (!PollOne(endpoint_->cq(), &wc, timeout_ms)) return "err timeout";
      char imm[16] = "-";
      if (wc.wc_flags & IBV_WC_WITH_IMM) {
        std::snprintf(imm, sizeof(imm), "%08x", ntohl(wc.imm_data));
      }
      std::ostringstream out;
      out << "ok " << wc.wr_id << " " << wc.status << " " << wc.opcode << " "
          << wc.byte_len << " " << imm;
      return out.str();
    }
    if (cmd == "state") return "ok " + std::to_string(QpState(endpoint_->qp()));
    return "err unknown command " + cmd;
  }

 private:
  std::string Devices() {
    int num = 0;
    ibv_device** list = ibv_get_device_list(&num);
    if (list == nullptr) return "err no device list";
    std::string out = "ok";
    for (int i = 0; i < num; ++i) {
      ibv_context* c = ibv_open_device(list[i]);
      ibv_gid gid = {};
      if (c == nullptr || ibv_query_gid(c, 1, 0, &gid) != 0) {
        out = std::string("err cannot query ") + ibv_get_device_name(list[i]);
        if (c != nullptr) ibv_close_device(c);
        break;
      }
      out +=
          std::string(" ") + ibv_get_device_name(list[i]) + "=" + GidToHex(gid);
      ibv_close_device(c);
    }
    ibv_free_device_list(list);
    return out;
  }

  std::string Open(const std::string& dev, size_t size) {
    if (endpoint_ != nullptr) return "err already open";
    std::string err;
    ctx_ = OpenDeviceByName(dev, &err);
    if (ctx_ == nullptr) return "err " + err;
    endpoint_ = Endpoint::Create(ctx_, EndpointOptions(), &err);
    if (endpoint_ == nullptr) return "err " + err;
    buf_ = endpoint_->Reg(size, kFullAccess, &err);
    if (buf_ == nullptr) return "err " + err;
    std::ostringstream out;
    out << "ok " << endpoint_->qpn() << " " << GidToHex(endpoint_->gid()) << " "
        << buf_->addr() << " " << buf_->rkey();
    return out.str();
  }

  ibv_context* ctx_ = nullptr;
  std::unique_ptr<Endpoint> endpoint_;
  Buffer* buf_ = nullptr;
};

// Applies --setenv/--unsetenv and re-executes without them; returns only
// if there were none.
void ApplyEnvFlagsAndReexec(int argc, char** argv) {
  std::vector<char*> rest = {argv[0]};
  bool changed = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--setenv=", 0) == 0) {
      std::string kv = a.substr(9);
      size_t eq = kv.find('=');
      if (eq == std::string::npos) continue;
      setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
      changed = true;
    } else if (a.rfind("--unsetenv=", 0) == 0) {
      unsetenv(a.substr(11).c_str());
      changed = true;
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (!changed) return;
  rest.push_back(nullptr);
  execv("/proc/self/exe", rest.data());
  std::printf("err execv failed\n");
  std::fflush(stdout);
  _exit(1);
}

}  // namespace
}  // namespace softrnic_test

int main(int argc, char** argv) {
  softrnic_test::ApplyEnvFlagsAndReexec(argc, argv);
  if (softrnic::LoadedVersion() == nullptr) {
    // The test would otherwise silently talk to rdma-core's library.
    std::printf("err not running on softrnic (LD_LIBRARY_PATH=%s)\n",
                getenv("LD_LIBRARY_PATH") ? getenv("LD_LIBRARY_PATH") : "");
    std::fflush(stdout);
    return 1;
  }
  std::printf("ready %d\n", static_cast<int>(getpid()));
  std::fflush(stdout);
  softrnic_test::Peer peer;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "quit") {
      std::printf("ok\n");
      std::fflush(stdout);
      break;
    }
    std::string answer = peer.Handle(line);
    std::printf("%s\n", answer.c_str());
    std::fflush(stdout);
  }
  return 0;
}
