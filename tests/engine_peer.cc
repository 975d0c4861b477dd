// engine_peer: the remote side of cross-process tests. Starts an engine,
// registers one remote-accessible buffer filled with a known pattern, prints
// "READY <addr> <length> <metadata address>", then answers commands on stdin,
// one line each:
//   check <offset> <length> <seed>   -> "OK" or "BAD <first bad index>"
//   fill <offset> <length> <seed>    -> "OK"
//   zero                             -> "OK"
//   unregister                       -> "OK" or "ERR <status>"
// Exits when stdin closes.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "common/pattern.h"
#include "ferry/transfer_engine.h"
#include "gpu/cuda_driver.h"

ABSL_FLAG(std::string, name, "peer", "segment name");
ABSL_FLAG(std::string, metadata, "embedded", "metadata endpoint");
ABSL_FLAG(uint64_t, buffer_size, 64 << 20, "registered bytes");
ABSL_FLAG(uint64_t, seed, 1, "pattern seed of the initial contents");
ABSL_FLAG(std::string, transport, "tcp",
          "transports to install, in order: tcp | rdma | shm, comma-separated");
ABSL_FLAG(int64_t, lease_ms, 10000,
          "metadata lease of the segment: a killed peer's name is free again "
          "this long after its last renewal");
ABSL_FLAG(int, gpu, -1,
          "register device memory of this GPU (the process's CUDA driver: "
          "FERRY_CUDA_LIBRARY) instead of host memory; -1: host memory");
ABSL_FLAG(int64_t, keepalive_ms, -1,
          "rdma.keepalive_interval in ms (0: no probes; -1: the default)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  ferry::EngineOptions o;
  o.local_segment_name = absl::GetFlag(FLAGS_name);
  o.metadata_endpoint = absl::GetFlag(FLAGS_metadata);
  o.transports =
      absl::StrSplit(absl::GetFlag(FLAGS_transport), ',', absl::SkipEmpty());
  o.metadata_lease_ttl = absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms));
  if (const int64_t ms = absl::GetFlag(FLAGS_keepalive_ms); ms >= 0) {
    o.rdma.keepalive_interval = absl::Milliseconds(ms);
  }
  ferry::TransferEngine engine;
  if (absl::Status s = engine.Init(o); !s.ok()) {
    std::printf("ERR %s\n", s.ToString().c_str());
    return 1;
  }
  const size_t size = absl::GetFlag(FLAGS_buffer_size);
  const int gpu = absl::GetFlag(FLAGS_gpu);
  // The bytes as the commands see them: host memory, or device memory
  // reached through a host copy.
  const ferry::gpu::CudaDriver* driver = nullptr;
  uint8_t* buf = nullptr;
  std::vector<uint8_t> shadow;
  if (gpu >= 0) {
    auto d = ferry::gpu::CudaDriver::Get();
    CUdeviceptr p = 0;
    if (!d.ok() || !(*d)->UseDevice(gpu).ok() ||
        (*d)->api().cuMemAlloc(&p, size) != CUDA_SUCCESS) {
      std::printf("ERR no GPU memory: %s\n", d.status().ToString().c_str());
      return 1;
    }
    driver = *d;
    buf = reinterpret_cast<uint8_t*>(p);
    shadow.resize(size);
  } else {
    buf = static_cast<uint8_t*>(std::malloc(size));
  }
  auto fill = [&](size_t off, size_t len, uint64_t seed) {
    if (driver == nullptr) return ferry::FillPattern(buf + off, len, off, seed);
    ferry::FillPattern(shadow.data(), len, off, seed);
    (void)driver->CopyToDevice(reinterpret_cast<CUdeviceptr>(buf + off),
                               shadow.data(), len);
  };
  auto check = [&](size_t off, size_t len, uint64_t seed) {
    if (driver == nullptr)
      return ferry::CheckPattern(buf + off, len, off, seed);
    if (!driver
             ->CopyFromDevice(shadow.data(),
                              reinterpret_cast<CUdeviceptr>(buf + off), len)
             .ok()) {
      return size_t{0};
    }
    return ferry::CheckPattern(shadow.data(), len, off, seed);
  };
  fill(0, size, absl::GetFlag(FLAGS_seed));
  const std::string location =
      gpu >= 0 ? "cuda:" + std::to_string(gpu) : std::string("cpu:0");
  if (absl::Status s = engine.RegisterLocalMemory(buf, size, location, true);
      !s.ok()) {
    std::printf("ERR %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("READY %llu %zu %s\n",
              static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(buf)),
              size, engine.metadata_address().c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    uint64_t off = 0, len = 0, seed = 0;
    in >> cmd >> off >> len >> seed;
    if ((cmd == "check" || cmd == "fill") && (off > size || len > size - off)) {
      std::printf("ERR range\n");
    } else if (cmd == "check") {
      size_t bad = check(off, len, seed);
      if (bad == len) {
        std::printf("OK\n");
      } else {
        std::printf("BAD %zu\n", bad);
      }
    } else if (cmd == "fill") {
      fill(off, len, seed);
      std::printf("OK\n");
    } else if (cmd == "zero" && driver == nullptr) {
      std::memset(buf, 0, size);
      std::printf("OK\n");
    } else if (cmd == "unregister") {
      absl::Status s = engine.UnregisterLocalMemory(buf);
      std::printf(s.ok() ? "OK\n" : "ERR %s\n", s.ToString().c_str());
    } else {
      std::printf("ERR unknown command\n");
    }
    std::fflush(stdout);
  }
  engine.Shutdown();
  if (driver == nullptr) std::free(buf);
  return 0;
}
