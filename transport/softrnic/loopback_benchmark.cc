// softrnic's cost per work request with both QPs in one process (the
// same-process path: no socket, the responder's work is a memcpy on the
// posting thread), against a plain memcpy of the same sizes measured in the
// same run. Run on softrnic:
//   tools/softrnic-run bazel-bin/transport/softrnic/loopback_benchmark
// Each iteration posts one chain of `chain` RDMA WRITEs (every 16th and the
// last signaled, as Ferry's RDMA transport posts) and polls until the
// chain's completions are in; the counter `wr/s` is work requests per
// second.
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "transport/softrnic/verbs_test_util.h"

namespace softrnic {
namespace {

constexpr size_t kBytes = 16 << 20;
constexpr uint32_t kSignalEvery = 16;

struct Loopback {
  ibv_context* ctx = nullptr;
  std::unique_ptr<softrnic_test::Endpoint> a, b;
  softrnic_test::Buffer* src = nullptr;
  softrnic_test::Buffer* dst = nullptr;

  Loopback() {
    std::string error;
    ctx = softrnic_test::OpenDeviceByName("softrnic0", &error);
    if (ctx == nullptr) Die(error);
    softrnic_test::EndpointOptions o;
    o.cqe = 4096;
    o.max_send_wr = 1024;
    o.max_send_sge = 1;
    a = softrnic_test::Endpoint::Create(ctx, o, &error);
    b = a != nullptr ? softrnic_test::Endpoint::Create(ctx, o, &error)
                     : nullptr;
    if (b == nullptr) Die(error);
    softrnic_test::ConnectOptions c;
    if (softrnic_test::ConnectQp(a->qp(), b->qpn(), b->gid(), c, &error) != 0 ||
        softrnic_test::ConnectQp(b->qp(), a->qpn(), a->gid(), c, &error) != 0) {
      Die(error);
    }
    src = a->Reg(kBytes);
    dst = b->Reg(kBytes);
    if (src == nullptr || dst == nullptr) Die("ibv_reg_mr failed");
  }

  [[noreturn]] static void Die(const std::string& what) {
    std::fprintf(stderr,
                 "loopback_benchmark: %s (run it with "
                 "tools/softrnic-run)\n",
                 what.c_str());
    std::exit(1);
  }
};

Loopback& Shared() {
  static Loopback* l = new Loopback();
  return *l;
}

void BM_RdmaWriteChain(benchmark::State& state) {
  Loopback& l = Shared();
  const uint32_t size = static_cast<uint32_t>(state.range(0));
  const int chain = static_cast<int>(state.range(1));
  const bool inline_data = state.range(2) != 0;
  std::vector<ibv_send_wr> wrs(chain);
  std::vector<ibv_sge> sges(chain);
  int signaled = 0;
  for (int i = 0; i < chain; ++i) {
    const size_t off = (static_cast<size_t>(i) * size) % (kBytes - size);
    sges[i] = l.src->Sge(off, size);
    ibv_send_wr& wr = wrs[i];
    wr = {};
    wr.wr_id = i;
    wr.sg_list = &sges[i];
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = l.dst->addr(off);
    wr.wr.rdma.rkey = l.dst->rkey();
    if (inline_data) wr.send_flags |= IBV_SEND_INLINE;
    if ((i + 1) % kSignalEvery == 0 || i == chain - 1) {
      wr.send_flags |= IBV_SEND_SIGNALED;
      ++signaled;
    }
    wr.next = i + 1 < chain ? &wrs[i + 1] : nullptr;
  }
  ibv_wc wcs[64];
  for (auto _ : state) {
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(l.a->qp(), wrs.data(), &bad) != 0) {
      state.SkipWithError("ibv_post_send failed");
      break;
    }
    int got = 0;
    while (got < signaled) {
      int n = ibv_poll_cq(l.a->cq(), 64, wcs);
      if (n < 0 || (n > 0 && wcs[n - 1].status != IBV_WC_SUCCESS)) {
        state.SkipWithError("completion failed");
        return;
      }
      got += n;
    }
  }
  state.counters["wr/s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * chain),
                         benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * chain *
                          size);
}
BENCHMARK(BM_RdmaWriteChain)
    ->ArgNames({"size", "chain", "inline"})
    ->Args({64, 32, 0})
    ->Args({64, 32, 1})
    ->Args({64, 1, 0})
    ->Args({65536, 32, 0})
    ->Args({4096, 1, 0})  // Against BM_RdmaWriteRegisterEach.
    ->Args({1 << 20, 1, 0});

// The reference: the same bytes copied with memcpy, same access pattern.
void BM_Memcpy(benchmark::State& state) {
  Loopback& l = Shared();
  const uint32_t size = static_cast<uint32_t>(state.range(0));
  const int chain = static_cast<int>(state.range(1));
  for (auto _ : state) {
    for (int i = 0; i < chain; ++i) {
      const size_t off = (static_cast<size_t>(i) * size) % (kBytes - size);
      std::memcpy(l.dst->data() + off, l.src->data() + off, size);
    }
    benchmark::ClobberMemory();
  }
  state.counters["wr/s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * chain),
                         benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * chain *
                          size);
}
BENCHMARK(BM_Memcpy)
    ->ArgNames({"size", "chain"})
    ->Args({64, 32})
    ->Args({65536, 32});

// Lines of /proc/self/maps in all: the size of what softrnic's
// registration reads on kernels without PROCMAP_QUERY.
double MapsLines() {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return 0;
  double n = 0;
  for (int c; (c = std::fgetc(f)) != EOF;) n += c == '\n';
  std::fclose(f);
  return n;
}

// Lines of /proc/self/maps up to and including the one that holds `addr`:
// what softrnic's registration of memory there reads where the kernel has
// no PROCMAP_QUERY (before 6.11, or FERRY_SOFTRNIC_MAPS_QUERY=0; the file
// is in address order, and the read stops once the range is covered). A small
// mapping often lands in a gap high among the libraries; a large one
// below them all, so its line comes early.
double MapsLinesRead(const void* addr) {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return 0;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  double n = 0;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strchr(line, '\n') == nullptr) continue;  // Rest of a long one.
    ++n;
    unsigned long lo = 0, hi = 0;  // NOLINT: sscanf's types
    if (std::sscanf(line, "%lx-%lx", &lo, &hi) == 2 && a >= lo && a < hi) {
      break;
    }
  }
  std::fclose(f);
  return n;
}

// An anonymous mapping of `size` bytes, faulted in once (registration
// then never waits for the page allocator); unmapped on destruction.
struct Mapping {
  explicit Mapping(size_t size) : size(size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) Loopback::Die("mmap failed");
    addr = static_cast<uint8_t*>(p);
    std::memset(addr, 1, size);
  }
  ~Mapping() { ::munmap(addr, size); }
  uint8_t* addr = nullptr;
  size_t size = 0;
};

// ibv_reg_mr (LOCAL_WRITE) + ibv_dereg_mr of `size` bytes of a mapping
// faulted in once, on softrnic0's PD: what one registration costs here.
// A hardware NIC pins and maps every page; softrnic only records the
// range (and, with FERRY_SOFTRNIC_STRICT_PAGES=1, each page's identity).
void BM_RegDereg(benchmark::State& state) {
  Loopback& l = Shared();
  const size_t size = static_cast<size_t>(state.range(0));
  Mapping m(size);
  for (auto _ : state) {
    ibv_mr* mr = ibv_reg_mr(l.a->pd(), m.addr, size, IBV_ACCESS_LOCAL_WRITE);
    if (mr == nullptr) {
      state.SkipWithError("ibv_reg_mr failed");
      return;
    }
    if (ibv_dereg_mr(mr) != 0) {
      state.SkipWithError("ibv_dereg_mr failed");
      return;
    }
  }
  state.counters["maps_lines"] = MapsLines();
  state.counters["maps_lines_read"] = MapsLinesRead(m.addr);
}
BENCHMARK(BM_RegDereg)
    ->ArgName("size")
    ->Arg(4096)
    ->Arg(65536)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->Arg(256 << 20);

// Registering the source for every transfer, as a program without an MR
// cache does: ibv_reg_mr, one signaled RDMA WRITE of `size` into the
// registered destination, its completion, ibv_dereg_mr. Compare
// BM_RdmaWriteChain/size/chain:1 (the source registered once).
void BM_RdmaWriteRegisterEach(benchmark::State& state) {
  Loopback& l = Shared();
  const uint32_t size = static_cast<uint32_t>(state.range(0));
  Mapping m(size);
  ibv_wc wc;
  for (auto _ : state) {
    ibv_mr* mr = ibv_reg_mr(l.a->pd(), m.addr, size, IBV_ACCESS_LOCAL_WRITE);
    if (mr == nullptr) {
      state.SkipWithError("ibv_reg_mr failed");
      return;
    }
    ibv_sge sge{reinterpret_cast<uint64_t>(m.addr), size, mr->lkey};
    ibv_send_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = l.dst->addr(0);
    wr.wr.rdma.rkey = l.dst->rkey();
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(l.a->qp(), &wr, &bad) != 0) {
      state.SkipWithError("ibv_post_send failed");
      return;
    }
    int n;
    while ((n = ibv_poll_cq(l.a->cq(), 1, &wc)) == 0) {
    }
    if (n < 0 || wc.status != IBV_WC_SUCCESS) {
      state.SkipWithError("completion failed");
      return;
    }
    if (ibv_dereg_mr(mr) != 0) {
      state.SkipWithError("ibv_dereg_mr failed");
      return;
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * size);
  state.counters["maps_lines"] = MapsLines();
  state.counters["maps_lines_read"] = MapsLinesRead(m.addr);
}
BENCHMARK(BM_RdmaWriteRegisterEach)->ArgName("size")->Arg(4096)->Arg(1 << 20);

}  // namespace
}  // namespace softrnic

BENCHMARK_MAIN();
