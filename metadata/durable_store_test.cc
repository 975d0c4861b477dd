#include "metadata/durable_store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "metadata/record_file.h"
#include "metadata/store_testing.h"

namespace ferry::metadata {
namespace {

std::string FreshDir() {
  static std::atomic<int> n{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/durable-", getpid(), "-",
                      n.fetch_add(1));
}

descriptor::SegmentDescriptor Seg(const std::string& name,
                                  uint64_t incarnation) {
  descriptor::SegmentDescriptor s;
  s.set_name(name);
  s.set_incarnation(incarnation);
  s.set_rpc_address("127.0.0.1:1");
  descriptor::Buffer* b = s.add_buffers();
  b->set_addr(0x1000);
  b->set_length(0x1000);
  b->set_location("cpu:0");
  return s;
}

UpdateBuffersRequest Add(const std::string& name, uint64_t owner,
                         uint64_t addr) {
  UpdateBuffersRequest r;
  r.set_name(name);
  r.set_owner_key(TestOwnerKey(owner));
  descriptor::Buffer* b = r.add_add();
  b->set_addr(addr);
  b->set_length(0x100);
  b->set_location("cpu:0");
  return r;
}

uint64_t FileSize(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  return f ? static_cast<uint64_t>(f.tellg()) : 0;
}

// Everything acknowledged survives a restart: segments, buffers, versions,
// removals, ownership.
TEST(DurableStoreTest, ARestartKeepsEverythingAcknowledged) {
  const std::string dir = FreshDir();
  uint64_t last_version = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
    EXPECT_FALSE(store->recovery().had_snapshot);
    ASSERT_OK(store->Put(PutOf(Seg("a", 1), absl::Seconds(30))));
    ASSERT_OK(store->Put(PutOf(Seg("b", 2))));
    ASSERT_OK(store->Put(PutOf(Seg("c", 3))));
    ASSERT_OK(store->UpdateBuffers(Add("a", 1, 0x8000)));
    ASSERT_OK_AND_ASSIGN(last_version,
                         store->UpdateBuffers(Add("a", 1, 0x9000)));
    ASSERT_OK(store->Remove(RemoveOf("c", 3)));
    // Refused changes are not logged.
    EXPECT_FALSE(store->Put(PutOf(Seg("b", 9))).ok());
  }
  ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
  EXPECT_EQ(store->recovery().segments, 2u);
  EXPECT_EQ(store->recovery().log_records, 6u);
  EXPECT_EQ(store->recovery().torn_bytes, 0u);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor a, store->Get("a"));
  EXPECT_EQ(a.buffers_size(), 3);
  EXPECT_EQ(a.version(), last_version);
  EXPECT_STATUS(store->Get("c"), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor b, store->Get("b"));
  EXPECT_EQ(b.incarnation(), 2u);
  // Ownership came back with the data.
  EXPECT_STATUS(store->Put(PutOf(Seg("a", 5), absl::Seconds(30))),
                absl::StatusCode::kAlreadyExists);
  EXPECT_OK(store->KeepAlive(KeepAliveOf("a", 1)));
  // Versions go on growing, past the one a change seen but not yet logged
  // at a crash may have had: a reader that saw it never sees it again on
  // another change.
  ASSERT_OK_AND_ASSIGN(uint64_t v, store->UpdateBuffers(Add("a", 1, 0xa000)));
  EXPECT_GT(v, last_version + 1);
}

// A change is on disk before anyone can see it: one whose record cannot be
// written (here: a file size limit, as a full disk) is seen by no reader
// and heard of by no watcher, and what was seen survives a restart.
TEST(DurableStoreTest, NobodySeesAChangeThatIsNotOnDisk) {
  const std::string dir = FreshDir();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Checks in the child: its file size limit must not reach the parent.
    auto store = DurableStore::Open(dir);
    if (!store.ok()) _exit(2);
    if (!(*store)->Put(PutOf(Seg("a", 1))).ok()) _exit(3);
    std::atomic<int> heard{0};
    SegmentStore* mem = (*store)->watchable();
    mem->Subscribe("b", [&heard] { heard.fetch_add(1); });
    mem->Subscribe("a", [&heard] { heard.fetch_add(1); });
    signal(SIGXFSZ, SIG_IGN);  // EFBIG instead.
    rlimit limit{FileSize(dir + "/log"), RLIM_INFINITY};
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(4);
    if ((*store)->Put(PutOf(Seg("b", 2))).ok()) _exit(5);
    if ((*store)->Get("b").status().code() != absl::StatusCode::kNotFound) {
      _exit(6);
    }
    if ((*store)->UpdateBuffers(Add("a", 1, 0x8000)).ok()) _exit(7);
    auto a = (*store)->Get("a");
    if (!a.ok() || a->buffers_size() != 1) _exit(8);
    if (heard.load() != 0) _exit(9);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "2-4: setup; 5: the put was accepted; 6: the unlogged segment was "
         "readable; 7: the update was accepted; 8: the unlogged buffer was "
         "readable; 9: a watcher heard of an unlogged change";
  ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
  EXPECT_OK(store->Get("a"));
  EXPECT_STATUS(store->Get("b"), absl::StatusCode::kNotFound);
}

// A crash in mid-append leaves part of a record: it is cut off, and what
// came before it is intact. So is a record whose bytes were damaged.
TEST(DurableStoreTest, ATornOrCorruptTailIsDropped) {
  const std::string dir = FreshDir();
  {
    ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
    ASSERT_OK(store->Put(PutOf(Seg("a", 1))));
    ASSERT_OK(store->UpdateBuffers(Add("a", 1, 0x8000)));
  }
  const std::string log = dir + "/log";
  const uint64_t whole = FileSize(log);
  // Half of a third record.
  {
    std::string rec = FrameRecord(std::string(100, 'z'));
    std::ofstream f(log, std::ios::binary | std::ios::app);
    f.write(rec.data(), 60);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
    EXPECT_EQ(store->recovery().torn_bytes, 60u);
    EXPECT_EQ(store->recovery().log_records, 2u);
    ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor a, store->Get("a"));
    EXPECT_EQ(a.buffers_size(), 2);
    EXPECT_EQ(FileSize(log), whole) << "the torn tail is cut off the file";
    // New changes append after the good records.
    ASSERT_OK(store->UpdateBuffers(Add("a", 1, 0x9000)));
  }
  // Flip one byte inside the last record's payload.
  const uint64_t size = FileSize(log);
  {
    int fd = open(log.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char c;
    ASSERT_EQ(pread(fd, &c, 1, static_cast<off_t>(size - 3)), 1);
    c ^= 0x40;
    ASSERT_EQ(pwrite(fd, &c, 1, static_cast<off_t>(size - 3)), 1);
    close(fd);
  }
  ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
  EXPECT_EQ(store->recovery().torn_bytes, size - whole);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor a, store->Get("a"));
  EXPECT_EQ(a.buffers_size(), 2) << "the damaged record is not applied";
}

// Past kMinCompactBytes the log is folded into a snapshot; a restart from
// snapshot plus log gives the same table.
TEST(DurableStoreTest, CompactionKeepsTheTable) {
  const std::string dir = FreshDir();
  constexpr int kSegments = 40;
  std::map<std::string, uint64_t> versions;
  {
    ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
    // ~25 KiB a Put: 40 segments, each put 6 times, pass 4 MiB.
    for (int round = 0; round < 6; ++round) {
      for (int i = 0; i < kSegments; ++i) {
        descriptor::SegmentDescriptor s = Seg(absl::StrCat("s", i), 1);
        s.clear_buffers();
        for (int k = 0; k < 1000; ++k) {
          descriptor::Buffer* b = s.add_buffers();
          b->set_addr(0x100000 * (k + 1));
          b->set_length(0x1000 + round);
          b->set_location("cpu:0");
        }
        ASSERT_OK(store->Put(PutOf(s, absl::ZeroDuration(), 1)));
      }
    }
    ASSERT_OK(store->Remove(RemoveOf("s0", 1)));
    EXPECT_GE(store->compactions(), 1u);
    for (int i = 1; i < kSegments; ++i) {
      const std::string n = absl::StrCat("s", i);
      versions[n] = store->Get(n)->version();
    }
  }
  ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
  EXPECT_TRUE(store->recovery().had_snapshot);
  EXPECT_EQ(store->recovery().segments, uint64_t{kSegments - 1});
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor s, store->Get("s7"));
  ASSERT_EQ(s.buffers_size(), 1000);
  EXPECT_EQ(s.buffers(999).length(), 0x1005u) << "the last round's";
  EXPECT_STATUS(store->Get("s0"), absl::StatusCode::kNotFound);
  // Every version exactly as before, whatever order the snapshot holds.
  for (const auto& [n, v] : versions)
    EXPECT_EQ(store->Get(n)->version(), v) << n;
}

TEST(DurableStoreTest, ACorruptSnapshotFailsOpenSayingSo) {
  const std::string dir = FreshDir();
  { ASSERT_OK(DurableStore::Open(dir)); }
  {
    std::ofstream f(dir + "/snapshot", std::ios::binary);
    f << "not a snapshot at all";
  }
  auto store = DurableStore::Open(dir);
  EXPECT_STATUS(store, absl::StatusCode::kDataLoss);
  EXPECT_NE(store.status().message().find("snapshot"), std::string::npos);
}

TEST(DurableStoreTest, OneProcessPerDirectory) {
  const std::string dir = FreshDir();
  ASSERT_OK_AND_ASSIGN(auto first, DurableStore::Open(dir));
  auto second = DurableStore::Open(dir);
  EXPECT_STATUS(second, absl::StatusCode::kFailedPrecondition);
  first.reset();
  EXPECT_OK(DurableStore::Open(dir));
}

// A recovered lease starts over: live engines have a whole TTL to renew,
// and a dead engine's segment still expires.
TEST(DurableStoreTest, RecoveredLeasesStartAfresh) {
  const std::string dir = FreshDir();
  SimulatedClock clock;
  {
    ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir, &clock));
    ASSERT_OK(store->Put(PutOf(Seg("a", 1), absl::Seconds(10))));
  }
  clock.Advance(absl::Seconds(60));  // Down for longer than the lease.
  ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir, &clock));
  EXPECT_OK(store->Get("a"));
  clock.Advance(absl::Seconds(9));
  EXPECT_OK(store->KeepAlive(KeepAliveOf("a", 1)));
  clock.Advance(absl::Seconds(10));
  EXPECT_STATUS(store->Get("a"), absl::StatusCode::kNotFound);
}

// A segment recovered from the log or the snapshot is charged to the
// client that put it, as before the restart: the quota of a client that
// filled it still binds after a metadata_server restart (it counted
// against the total only, so a restart gave every client a fresh quota).
TEST(DurableStoreTest, RecoveredSegmentsCountAgainstTheirClient) {
  SegmentStore::Limits limits;
  limits.max_client_segments = 2;
  for (bool compact : {false, true}) {
    const std::string dir = FreshDir();
    {
      ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
      store->SetLimits(limits);
      ASSERT_OK(store->PutFrom(PutOf(Seg("a", 1)), "ipv4:10.0.0.66"));
      ASSERT_OK(store->PutFrom(PutOf(Seg("b", 2)), "ipv4:10.0.0.66"));
      EXPECT_STATUS(store->PutFrom(PutOf(Seg("c", 3)), "ipv4:10.0.0.66"),
                    absl::StatusCode::kResourceExhausted);
      if (compact) {
        // Enough log for a snapshot: the clients must survive it too.
        for (int i = 0; i < 250; ++i) {
          descriptor::SegmentDescriptor big = Seg("bulk", 9);
          for (int k = 0; k < 1000; ++k) {
            descriptor::Buffer* buf = big.add_buffers();
            buf->set_addr(0x10000000ull * (k + 2));
            buf->set_length(0x1000 + i);
            buf->set_location("cpu:0");
          }
          ASSERT_OK(store->Put(PutOf(big, absl::ZeroDuration(), 9)));
        }
        ASSERT_GE(store->compactions(), 1u);
      }
    }
    ASSERT_OK_AND_ASSIGN(auto store, DurableStore::Open(dir));
    store->SetLimits(limits);
    EXPECT_STATUS(store->PutFrom(PutOf(Seg("c", 3)), "ipv4:10.0.0.66"),
                  absl::StatusCode::kResourceExhausted)
        << (compact ? "from the snapshot" : "from the log");
    EXPECT_OK(store->PutFrom(PutOf(Seg("d", 4)), "ipv4:10.0.0.77"));
    ASSERT_OK(store->Remove(RemoveOf("a", 1)));
    EXPECT_OK(store->PutFrom(PutOf(Seg("c", 3)), "ipv4:10.0.0.66"));
  }
}

}  // namespace
}  // namespace ferry::metadata
