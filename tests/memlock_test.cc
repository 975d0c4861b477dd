// Registered memory is pinned, and the kernel charges it to RLIMIT_MEMLOCK
// unless the process has CAP_IPC_LOCK: past the limit ibv_reg_mr fails
// with ENOMEM. softrnic keeps the same account. This binary runs one test
// (it changes its own process's capabilities and limits): with the
// capability dropped and a 4 MiB limit, a registration that fits works and
// one that does not fails with ResourceExhausted saying what the limit is
// and how to raise it; it works again once the first is unregistered.
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

// Drops CAP_IPC_LOCK from the effective set (root keeps the rest).
bool DropIpcLock() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  return syscall(SYS_capset, &hdr, data) == 0;
}

TEST(MemlockTest, OverTheLimitIsAClearErrorThatSaysHowToRaiseIt) {
  ASSERT_TRUE(DropIpcLock()) << "capset";
  constexpr rlim_t kLimit = 4 << 20;
  rlimit rl{kLimit, kLimit};
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &rl), 0);

  EngineOptions o;
  o.local_segment_name = "pinned";
  o.listen_host = "127.0.0.1";
  o.transports = {"rdma"};
  o.rdma.devices = {"softrnic0"};  // One NIC: one pinned copy each.
  TransferEngine engine;
  ASSERT_OK(engine.Init(o));
  constexpr size_t kSmall = 1 << 20, kBig = 8 << 20;
  std::unique_ptr<char[]> small(new char[kSmall]), big(new char[kBig]);
  ASSERT_OK(engine.RegisterLocalMemory(small.get(), kSmall));
  absl::Status s = engine.RegisterLocalMemory(big.get(), kBig);
  EXPECT_STATUS(s, absl::StatusCode::kResourceExhausted);
  for (const char* want : {"RLIMIT_MEMLOCK", "4194304", "ulimit -l",
                           "LimitMEMLOCK", "memlock=-1"}) {
    EXPECT_NE(s.message().find(want), std::string::npos) << want << ": " << s;
  }
  // Nothing half-registered stayed behind: the budget is as before.
  ASSERT_OK(engine.UnregisterLocalMemory(small.get()));
  std::unique_ptr<char[]> fits(new char[3 << 20]);
  EXPECT_OK(engine.RegisterLocalMemory(fits.get(), 3 << 20));
  EXPECT_OK(engine.UnregisterLocalMemory(fits.get()));
  engine.Shutdown();
}

}  // namespace
}  // namespace ferry
