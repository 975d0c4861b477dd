// The emulated InfiniBand subnet: the LID table a subnet manager keeps.
//
// On a real InfiniBand fabric the subnet manager gives every port a LID
// and switches forward by it. softrnic has no switch: a QP finds its peer's
// listener from the LID through this table, a directory shared by every
// process of the "fabric" (FERRY_SOFTRNIC_SUBNET; default
// $TMPDIR/softrnic-subnet, /tmp if TMPDIR is unset), one file per LID
// holding "<ip> <port>". A port claims the first free LID from a hash of
// its address, under an exclusive flock of the directory, and holds an
// exclusive flock on its entry for as long as its process lives: an entry
// nobody holds locked is stale (its process is gone, whatever host or PID
// namespace it ran in) and is taken over, as a subnet manager sweeps dead
// ports. A network namespace shares the directory, so namespaced hosts
// form one subnet, as hosts on one switch do.
#include <arpa/inet.h>
#include <fcntl.h>
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

// Opens entry `lid` without following a symbolic link; -1 if absent.
int OpenEntry(uint32_t lid, int flags) {
  return ::open(EntryPath(lid).c_str(), flags | O_NOFOLLOW | O_CLOEXEC, 0644);
}

// Whether the port that wrote the entry open as `fd` still lives: it holds
// the entry locked.
bool Held(int fd) {
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);
    return false;
  }
  return errno == EWOULDBLOCK;
}

bool ParseEntry(int fd, in_addr* ip, uint16_t* port) {
  char buf[64] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return false;
  char text[INET_ADDRSTRLEN] = {};
  unsigned p = 0;
  if (std::sscanf(buf, "%15s %u", text, &p) != 2 || p == 0 || p > 0xffff ||
      inet_pton(AF_INET, text, ip) != 1) {
    return false;
  }
  *port = static_cast<uint16_t>(p);
  return true;
}

// The table's directory, made if needed (world-writable and sticky, like
// /tmp, so that every user's ports share one subnet); false if it is not a
// directory of ours or root's.
bool PrepareDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) == 0) {
    ::chmod(dir.c_str(), 01777);  // Not subject to the umask.
  } else if (errno != EEXIST) {
    std::fprintf(stderr, "softrnic: cannot make the subnet table %s: %s\n",
                 dir.c_str(), std::strerror(errno));
    return false;
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
      (st.st_uid != 0 && st.st_uid != ::geteuid())) {
    std::fprintf(stderr,
                 "softrnic: the subnet table %s is not a directory owned by "
                 "root or this user; not used\n",
                 dir.c_str());
    return false;
  }
  return true;
}

// The entries this process holds, locked for its lifetime (never closed:
// the lock is the port's liveness).
bool Claim(uint32_t lid, in_addr ip, uint16_t port, bool* full) {
  *full = false;
  int fd = OpenEntry(lid, O_RDWR | O_CREAT | O_EXCL);
  if (fd < 0 && errno == EEXIST) {
    fd = OpenEntry(lid, O_RDWR);
    if (fd < 0) return false;  // Another user's, or a link: skip it.
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {  // A live port's.
      ::close(fd);
      return false;
    }
  } else if (fd < 0) {
    // The directory refuses new entries: no LID anywhere.
    *full = errno != EEXIST;
    return false;
  } else if (::flock(fd, LOCK_EX) != 0) {
    ::close(fd);
    return false;
  }
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &ip, text, sizeof(text));
  char line[64];
  const int len = std::snprintf(line, sizeof(line), "%s %u\n", text,
                                static_cast<unsigned>(port));
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, line, len, 0) != len) {
    ::close(fd);
    return false;
  }
  return true;  // `fd` stays open, locked.
}

}  // namespace

uint16_t AssignLid(in_addr ip, uint16_t port) {
  const std::string& dir = SubnetDir();
  if (!PrepareDir(dir)) return 0;
  const int lock = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (lock < 0 || ::flock(lock, LOCK_EX) != 0) {
    std::fprintf(stderr, "softrnic: cannot lock the subnet table %s: %s\n",
                 dir.c_str(), std::strerror(errno));
    if (lock >= 0) ::close(lock);
    return 0;
  }
  const uint32_t h = ntohl(ip.s_addr) * 2654435761u ^ port;
  uint16_t lid = 0;
  constexpr uint32_t kFirst = kSubnetManagerLid + 1;
  constexpr uint32_t kCount = kMaxUnicastLid - kFirst + 1;
  bool full = false;
  for (uint32_t i = 0; i < kCount && lid == 0 && !full; ++i) {
    const uint32_t candidate = kFirst + (h + i) % kCount;
    if (Claim(candidate, ip, port, &full)) {
      lid = static_cast<uint16_t>(candidate);
    }
  }
  ::flock(lock, LOCK_UN);
  ::close(lock);
  if (lid == 0) {
    std::fprintf(stderr,
                 "softrnic: no LID assigned: the subnet table %s is full or "
                 "not writable (%s)\n",
                 dir.c_str(), std::strerror(errno));
  }
  return lid;
}

bool ResolveLid(uint16_t lid, in_addr* ip, uint16_t* port) {
  if (lid == 0 || lid > kMaxUnicastLid) return false;
  const int fd = OpenEntry(lid, O_RDONLY);
  if (fd < 0) return false;
  const bool ok = Held(fd) && ParseEntry(fd, ip, port);
  ::close(fd);
  return ok;
}

}  // namespace softrnic
