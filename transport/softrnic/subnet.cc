// The emulated InfiniBand subnet: the LID table a subnet manager keeps.
//
// On a real InfiniBand fabric the subnet manager gives every port a LID
// and switches forward by it. softrnic has no switch: a QP finds its peer's
// listener from the LID through this table, a directory shared by every
// process of the "fabric" (FERRY_SOFTRNIC_SUBNET; default
// $TMPDIR/softrnic-subnet, /tmp if TMPDIR is unset), one file per LID holding
// "<ip> <port> <pid>". A port claims the first free LID from a hash of its
// address, under an exclusive flock of the directory, and takes over entries
// whose process is gone (a subnet manager sweeping dead ports). A network
// namespace shares the directory, so namespaced hosts form one subnet, as hosts
// on one switch do.
#include <arpa/inet.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transport/softrnic/softrnic.h"

namespace softrnic {
namespace {

// Unicast LIDs are 0x0001..0xbfff (0xc000 and up are multicast).
constexpr uint32_t kMaxUnicastLid = 0xbfff;

const std::string& SubnetDir() {
  static const std::string* dir = [] {
    const char* env = std::getenv("FERRY_SOFTRNIC_SUBNET");
    if (env != nullptr && *env != '\0') return new std::string(env);
    const char* tmp = std::getenv("TMPDIR");
    return new std::string(
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
        "/softrnic-subnet");
  }();
  return *dir;
}

std::string EntryPath(uint32_t lid) {
  return SubnetDir() + "/" + std::to_string(lid);
}

struct Entry {
  in_addr ip{};
  uint16_t port = 0;
  pid_t pid = 0;
};

// Reads entry `lid`; false if there is none or it does not parse.
bool ReadEntry(uint32_t lid, Entry* e) {
  const int fd = ::open(EntryPath(lid).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[96] = {};
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  char ip[INET_ADDRSTRLEN] = {};
  unsigned port = 0;
  long pid = 0;
  if (std::sscanf(buf, "%15s %u %ld", ip, &port, &pid) != 3 || port == 0 ||
      port > 0xffff || pid <= 0 || inet_pton(AF_INET, ip, &e->ip) != 1) {
    return false;
  }
  e->port = static_cast<uint16_t>(port);
  e->pid = static_cast<pid_t>(pid);
  return true;
}

// Whether the port behind an entry is gone: its process exited (a process
// of another user, which kill may not signal, counts as alive).
bool Stale(const Entry& e) { return ::kill(e.pid, 0) != 0 && errno == ESRCH; }

bool WriteEntry(uint32_t lid, in_addr ip, uint16_t port) {
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &ip, text, sizeof(text));
  char line[96];
  const int len =
      std::snprintf(line, sizeof(line), "%s %u %ld\n", text,
                    static_cast<unsigned>(port), static_cast<long>(::getpid()));
  // Written whole under a temporary name, then renamed: a reader sees the
  // old entry or the new one, never half of one.
  const std::string tmp = SubnetDir() + "/.tmp." + std::to_string(::getpid()) +
                          "." + std::to_string(lid);
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const bool ok = ::write(fd, line, len) == len;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), EntryPath(lid).c_str()) != 0) {
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace

uint16_t AssignLid(in_addr ip, uint16_t port) {
  const std::string& dir = SubnetDir();
  if (::mkdir(dir.c_str(), 01777) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "softrnic: no subnet table at %s: %s\n", dir.c_str(),
                 std::strerror(errno));
    return 0;
  }
  const int lock = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (lock < 0 || ::flock(lock, LOCK_EX) != 0) {
    std::fprintf(stderr, "softrnic: cannot lock the subnet table %s: %s\n",
                 dir.c_str(), std::strerror(errno));
    if (lock >= 0) ::close(lock);
    return 0;
  }
  uint32_t h = ntohl(ip.s_addr) * 2654435761u ^ port;
  uint16_t lid = 0;
  constexpr uint32_t kFirst = kSubnetManagerLid + 1;
  constexpr uint32_t kCount = kMaxUnicastLid - kFirst + 1;
  for (uint32_t i = 0; i < kCount && lid == 0; ++i) {
    const uint32_t candidate = kFirst + (h + i) % kCount;
    Entry e;
    const bool taken = ReadEntry(candidate, &e);
    if (taken && !Stale(e) && !(e.ip.s_addr == ip.s_addr && e.port == port)) {
      continue;
    }
    if (WriteEntry(candidate, ip, port))
      lid = static_cast<uint16_t>(candidate);
    else
      break;
  }
  ::flock(lock, LOCK_UN);
  ::close(lock);
  if (lid == 0) {
    std::fprintf(stderr, "softrnic: no LID assigned in %s\n", dir.c_str());
  }
  return lid;
}

bool ResolveLid(uint16_t lid, in_addr* ip, uint16_t* port) {
  if (lid == 0 || lid > kMaxUnicastLid) return false;
  Entry e;
  if (!ReadEntry(lid, &e) || Stale(e)) return false;
  *ip = e.ip;
  *port = e.port;
  return true;
}

}  // namespace softrnic
