// main() for tests that must run on softrnic: re-executes the test binary
// with LD_LIBRARY_PATH pointing at softrnic's libibverbs.so.1 (from the
// test's runfiles), so that the binary, linked against rdma-core's
// libibverbs, loads softrnic instead; then checks it did and runs gtest.
// FERRY_SOFTRNIC_DEVICES defaults to two devices on 127.0.0.1 and
// 127.0.0.2 unless the test environment sets it, FERRY_SOFTRNIC_SUBNET to
// a directory in the test's TEST_TMPDIR. --softrnic_profile=NAME
// (e.g. as a test target's args) sets FERRY_SOFTRNIC_PROFILE: the same
// test against another kind of hardware.
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "transport/softrnic/softrnic_control.h"

namespace {

std::string LibraryDir() {
  const char* srcdir = getenv("TEST_SRCDIR");
  const char* ws = getenv("TEST_WORKSPACE");
  std::string base = srcdir != nullptr
                         ? std::string(srcdir) + "/" + (ws ? ws : "ferry")
                         : std::string(".");
  return base + "/transport/softrnic";
}

}  // namespace

int main(int argc, char** argv) {
  if (getenv("FERRY_SOFTRNIC_REEXEC") == nullptr) {
    std::string dir = LibraryDir();
    const char* old = getenv("LD_LIBRARY_PATH");
    std::string path = old != nullptr && *old ? dir + ":" + old : dir;
    setenv("LD_LIBRARY_PATH", path.c_str(), 1);
    setenv("FERRY_SOFTRNIC_REEXEC", "1", 1);
    setenv("FERRY_SOFTRNIC_DEVICES", "softrnic0=127.0.0.1,softrnic1=127.0.0.2",
           /*overwrite=*/0);
    // InfiniBand profiles: a subnet (LID table) of the test's own.
    if (const char* tmp = getenv("TEST_TMPDIR"); tmp != nullptr) {
      setenv("FERRY_SOFTRNIC_SUBNET",
             (std::string(tmp) + "/softrnic-subnet").c_str(),
             /*overwrite=*/0);
    }
    constexpr char kProfileFlag[] = "--softrnic_profile=";
    for (int i = 1; i < argc; ++i) {
      if (std::strncmp(argv[i], kProfileFlag, sizeof(kProfileFlag) - 1) == 0) {
        setenv("FERRY_SOFTRNIC_PROFILE", argv[i] + sizeof(kProfileFlag) - 1, 1);
      }
    }
    execv("/proc/self/exe", argv);
    std::perror("softrnic_test_main: execv");
    return 1;
  }
  if (softrnic::LoadedVersion() == nullptr) {
    std::fprintf(stderr,
                 "softrnic_test_main: the loaded libibverbs is not softrnic "
                 "(LD_LIBRARY_PATH=%s)\n",
                 getenv("LD_LIBRARY_PATH"));
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
