// tcp_test_peer: the target side of tcp_fault_test, in its own process so a
// test can starve it of fds, SIGSTOP it or kill it. Runs a TcpTransport on
// 127.0.0.1 with one remote-accessible buffer filled with a known pattern,
// prints "READY <port> <buffer address> <buffer length> <buffer key>
// <incarnation>" (what a descriptor of it holds), then answers
// commands on stdin, one line each:
//   stats                          -> "threads <n> fds <n> cpu_ms <n>"
// If Install fails it prints "ERR <status>" and exits with 1.
//   check <offset> <length> <seed> -> "OK" or "BAD <first bad index>"
// Exits when stdin closes.
#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/pattern.h"
#include "transport/tcp/tcp_transport.h"

ABSL_FLAG(uint64_t, buffer_size, 16 << 20, "registered bytes");
ABSL_FLAG(uint64_t, seed, 1, "pattern seed of the initial contents");
ABSL_FLAG(int, fd_limit, 0, "RLIMIT_NOFILE soft limit to run with (0: keep)");
ABSL_FLAG(bool, fd_limit_after_install, false,
          "apply --fd_limit once the transport is installed (its connection "
          "cap then follows the higher limit, and accept can run out of "
          "descriptors, as when other parts of a process use them)");
ABSL_FLAG(int, nproc_limit, 0,
          "run as a user of its own with this RLIMIT_NPROC (threads of that "
          "user; 0: keep the user and limit)");

namespace {

// Both read /proc through descriptors opened at start-up: the point of
// some tests is a process without a free fd.
int Threads() {
  static const int fd = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  char buf[8192];
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return -1;
  buf[n] = 0;
  const char* p = std::strstr(buf, "Threads:");
  return p == nullptr ? -1 : std::atoi(p + 8);
}

int OpenFds() {
  static DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  ::rewinddir(dir);
  int n = 0;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  return n;
}

// The first byte of buf[0..len) that differs from the pattern, or len.
// Peers wrote these bytes through the transport's loop thread; what orders
// that write before this read runs through the initiator process (its
// WRITE completed, then it sent "check"), which ThreadSanitizer cannot
// see, hence no instrumentation here.
__attribute__((no_sanitize("thread"))) size_t FirstMismatch(const uint8_t* buf,
                                                            size_t len,
                                                            uint64_t off,
                                                            uint64_t seed) {
  for (size_t i = 0; i < len; ++i) {
    if (buf[i] != ferry::PatternByte(off + i, seed)) return i;
  }
  return len;
}

long CpuMillis() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000L +
         (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1000L;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  Threads();  // Opens what they read while fds are free.
  OpenFds();
  auto limit_fds = [] {
    const int limit = absl::GetFlag(FLAGS_fd_limit);
    if (limit <= 0) return true;
    rlimit rl{};
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = static_cast<rlim_t>(limit);
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      std::printf("ERR setrlimit: %s\n", std::strerror(errno));
      return false;
    }
    return true;
  };
  if (!absl::GetFlag(FLAGS_fd_limit_after_install) && !limit_fds()) return 1;
  if (int limit = absl::GetFlag(FLAGS_nproc_limit); limit > 0) {
    // RLIMIT_NPROC binds only a user that is not root: what a container's
    // pids limit does to a process. It counts every thread of the user on
    // the machine, so each run takes a uid of its own (no passwd entry
    // needed): runs in parallel (--runs_per_test) must not share a count,
    // as they did as user nobody.
    const uid_t uid = 200000 + static_cast<uid_t>(getpid() % 100000);
    rlimit rl{static_cast<rlim_t>(limit), static_cast<rlim_t>(limit)};
    if (setgid(uid) != 0 || setuid(uid) != 0 ||
        setrlimit(RLIMIT_NPROC, &rl) != 0) {
      std::printf("ERR cannot drop to uid %u: %s\n", uid, std::strerror(errno));
      return 1;
    }
  }
  ferry::TransportOptions options;
  ferry::tcp::TcpTransport transport(options);
  ferry::TransportEnv env;
  env.local_segment = "peer";
  env.incarnation = 0x7e57000000000000ull + static_cast<uint64_t>(getpid());
  env.listen_host = "127.0.0.1";
  ferry::descriptor::TransportEndpoint endpoint;
  if (absl::Status s = transport.Install(env, &endpoint); !s.ok()) {
    std::printf("ERR %s\n", s.ToString().c_str());
    std::fflush(stdout);
    // No atexit handlers: a sanitizer's leak check would need a thread,
    // which the thread limit of some tests forbids.
    std::_Exit(1);
  }
  if (absl::GetFlag(FLAGS_fd_limit_after_install) && !limit_fds()) return 1;
  const size_t size = absl::GetFlag(FLAGS_buffer_size);
  auto* buf = static_cast<uint8_t*>(std::malloc(size));
  ferry::FillPattern(buf, size, 0, absl::GetFlag(FLAGS_seed));
  ferry::MemoryRegion region;
  region.addr = reinterpret_cast<uintptr_t>(buf);
  region.length = size;
  region.remote_accessible = true;
  ferry::descriptor::Buffer published;
  if (auto h = transport.RegisterMemory(region, &published); !h.ok()) {
    std::printf("ERR %s\n", h.status().ToString().c_str());
    return 1;
  }
  const std::string address = endpoint.address();
  std::printf("READY %s %llu %zu %llu %llu\n",
              address.substr(address.rfind(':') + 1).c_str(),
              static_cast<unsigned long long>(region.addr), size,
              static_cast<unsigned long long>(published.tcp_key()),
              static_cast<unsigned long long>(env.incarnation));
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    uint64_t off = 0, len = 0, seed = 0;
    in >> cmd >> off >> len >> seed;
    if (cmd == "stats") {
      std::printf("threads %d fds %d cpu_ms %ld\n", Threads(), OpenFds(),
                  CpuMillis());
    } else if (cmd == "check" && off <= size && len <= size - off) {
      size_t bad = FirstMismatch(buf + off, len, off, seed);
      if (bad == len) {
        std::printf("OK\n");
      } else {
        std::printf("BAD %zu\n", bad);
      }
    } else {
      std::printf("ERR bad command\n");
    }
    std::fflush(stdout);
  }
  transport.Shutdown();
  std::free(buf);
  return 0;
}
