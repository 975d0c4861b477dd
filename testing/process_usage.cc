#include "testing/process_usage.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ferry::testing {

absl::StatusOr<ProcessUsage> ReadProcessUsage(pid_t pid) {
  ProcessUsage u;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  if (!status) {
    return absl::NotFoundError(absl::StrCat("no process ", pid));
  }
  std::string line;
  bool seen_threads = false;
  while (std::getline(status, line)) {
    std::vector<std::string> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() < 2) continue;
    if (f[0] == "Threads:") seen_threads = absl::SimpleAtoi(f[1], &u.threads);
    if (f[0] == "VmRSS:") (void)absl::SimpleAtoi(f[1], &u.rss_kb);
    if (f[0] == "VmHWM:") (void)absl::SimpleAtoi(f[1], &u.hwm_kb);
  }
  if (!seen_threads) {
    return absl::NotFoundError(absl::StrCat("process ", pid, " is gone"));
  }
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) {
    return absl::NotFoundError(absl::StrCat("no fd table for ", pid));
  }
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++u.open_fds;
  }
  closedir(dir);
  return u;
}

namespace {

std::string Histogram(const std::map<std::string, int>& counts) {
  std::vector<std::pair<int, std::string>> v;
  for (const auto& [k, n] : counts) v.push_back({n, k});
  std::sort(v.begin(), v.end(), std::greater<>());
  std::string out;
  for (const auto& [n, k] : v) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", k, " x", n);
  }
  return out;
}

std::vector<std::string> DirEntries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') out.push_back(e->d_name);
  }
  closedir(d);
  return out;
}

}  // namespace

std::string DescribeThreads(pid_t pid) {
  std::map<std::string, int> counts;
  const std::string task = absl::StrCat("/proc/", pid, "/task/");
  for (const std::string& tid : DirEntries(task)) {
    std::ifstream comm(absl::StrCat(task, tid, "/comm"));
    std::string name;
    std::getline(comm, name);
    ++counts[name.empty() ? "?" : name];
  }
  return Histogram(counts);
}

std::string DescribeFds(pid_t pid) {
  std::map<std::string, int> counts;
  const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd/");
  for (const std::string& fd : DirEntries(fd_dir)) {
    char target[256];
    ssize_t n = readlink((fd_dir + fd).c_str(), target, sizeof(target) - 1);
    if (n < 0) continue;
    std::string t(target, static_cast<size_t>(n));
    // "socket:[123]" -> "socket"; "anon_inode:[eventfd]" kept whole.
    if (absl::StartsWith(t, "socket:") || absl::StartsWith(t, "pipe:")) {
      t = t.substr(0, t.find(':'));
    } else if (!absl::StartsWith(t, "anon_inode:")) {
      t = "file";
    }
    ++counts[t];
  }
  return Histogram(counts);
}

int ThreadCount() {
  auto u = ReadProcessUsage(getpid());
  return u.ok() ? u->threads : -1;
}

int OpenFds() {
  auto u = ReadProcessUsage(getpid());
  return u.ok() ? u->open_fds - 1 : -1;  // Minus the fd table's DIR.
}

}  // namespace ferry::testing
