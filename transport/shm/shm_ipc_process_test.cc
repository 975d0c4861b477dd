// The shm transport's GPU path with the target in another process: a
// fork()ed child (forked before this process starts any thread, so this
// binary holds this one test) that registers softgpu memory. What only a
// second process shows: a descriptor whose allocation base lies cannot
// steer a copy outside the mapping the initiator opened, and a target that
// withdrew its buffer and exited is not kept alive by that mapping.
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status_testing.h"
#include "gpu/softgpu_testing.h"
#include "gtest/gtest.h"
#include "transport/shm/shm_transport.h"

namespace ferry::shm {
namespace {

constexpr size_t kBytes = 1 << 20;

class Sink final : public SliceSink {
 public:
  void OnSliceDone(Slice*, const absl::Status& status) override {
    MutexLock lock(&mu_);
    statuses_.push_back(status);
    cv_.SignalAll();
  }
  absl::Status WaitOne() {
    MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (statuses_.empty() && !cv_.WaitWithDeadline(&mu_, deadline)) {
    }
    if (statuses_.empty()) return absl::DeadlineExceededError("no completion");
    absl::Status s = statuses_.back();
    statuses_.clear();
    return s;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

// Length-prefixed messages over a pipe.
bool Send(int fd, const std::string& s) {
  const uint32_t n = s.size();
  return write(fd, &n, 4) == 4 &&
         write(fd, s.data(), n) == static_cast<ssize_t>(n);
}
std::string Receive(int fd) {
  uint32_t n = 0;
  if (read(fd, &n, 4) != 4) return "";
  std::string s(n, '\0');
  for (size_t got = 0; got < n;) {
    const ssize_t r = read(fd, &s[got], n - got);
    if (r <= 0) return "";
    got += static_cast<size_t>(r);
  }
  return s;
}

// softgpu allocations this process holds open (its own and imported).
int SoftgpuMemfds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = readdir(d)) {
    char path[300], target[300];
    std::snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    const ssize_t k = readlink(path, target, sizeof(target) - 1);
    if (k > 0) {
      target[k] = '\0';
      if (std::strstr(target, "memfd:softgpu-") != nullptr) ++n;
    }
  }
  closedir(d);
  return n;
}

// The target: registers kBytes of GPU memory with shm, sends its endpoint
// and buffer, then on "free" unregisters and frees it, and on "exit"
// exits.
[[noreturn]] void Target(int in, int out) {
  const gpu::CudaDriver& d = gpu::SoftgpuDriver(1);
  CUdeviceptr p = 0;
  if (!d.UseDevice(0).ok() || d.api().cuMemAlloc(&p, kBytes) != CUDA_SUCCESS) {
    _exit(2);
  }
  ShmTransport t{TransportOptions{}};
  descriptor::TransportEndpoint ep;
  ep.set_transport("shm");
  if (!t.Install(TransportEnv{}, &ep).ok()) _exit(3);
  MemoryRegion r;
  r.addr = p;
  r.length = kBytes;
  r.location = "cuda:0";
  r.remote_accessible = true;
  r.cuda_device = 0;
  descriptor::Buffer b;
  b.set_addr(p);
  b.set_length(kBytes);
  b.set_location("cuda:0");
  if (!t.RegisterMemory(r, &b).ok()) _exit(4);
  if (!Send(out, ep.SerializeAsString()) || !Send(out, b.SerializeAsString())) {
    _exit(5);
  }
  Receive(in);  // "free"
  if (!t.UnregisterMemory(p).ok()) _exit(6);
  d.api().cuMemFree(p);
  Send(out, "freed");
  Receive(in);  // "exit"
  _exit(0);
}

TEST(ShmIpcProcessTest, LyingBaseAndWithdrawnMemory) {
  int down[2], up[2];
  ASSERT_EQ(pipe(down), 0);
  ASSERT_EQ(pipe(up), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) Target(down[0], up[1]);

  const gpu::CudaDriver& d = gpu::SoftgpuDriver(1);
  const auto& api = d.api();
  ASSERT_OK(d.UseDevice(0));
  // GPU memory of the initiator's own, which no copy may touch.
  CUdeviceptr own = 0;
  ASSERT_EQ(api.cuMemAlloc(&own, kBytes), CUDA_SUCCESS);
  std::vector<uint8_t> pattern(kBytes, 0xaa);
  ASSERT_OK(d.CopyToDevice(own, pattern.data(), kBytes));
  ShmTransport init{TransportOptions{}};
  descriptor::TransportEndpoint unused;
  unused.set_transport("shm");
  ASSERT_OK(init.Install(TransportEnv{}, &unused));
  descriptor::TransportEndpoint ep;
  descriptor::Buffer b;
  ASSERT_TRUE(ep.ParseFromString(Receive(up[0])));
  ASSERT_TRUE(b.ParseFromString(Receive(up[0])));
  ASSERT_TRUE(b.has_cuda_ipc());
  auto view_of = [&](const descriptor::Buffer& buffer) {
    descriptor::SegmentDescriptor sd;
    sd.set_name("target");
    sd.set_incarnation(1);
    *sd.add_transports() = ep;
    *sd.add_buffers() = buffer;
    auto v = SegmentView::Create(sd);
    EXPECT_OK(v.status());
    return v.ok() ? *v : nullptr;
  };
  Sink sink;
  std::vector<uint8_t> host(4096, 0x11);
  auto write = [&](const SegmentView& v) {
    Slice s;
    s.op = OpCode::kWrite;
    s.local = host.data();
    s.remote = b.addr();
    s.length = host.size();
    s.target = &v;
    s.remote_buffer = 0;
    s.sink = &sink;
    Slice* p = &s;
    init.Submit(absl::MakeConstSpan(&p, 1));
    return sink.WaitOne();
  };
  auto honest = view_of(b);
  ASSERT_NE(honest, nullptr);
  ASSERT_OK(write(*honest));  // Opens the mapping.

  // The same buffer and live key, but a base that puts b.addr() at the
  // initiator's own memory, with a size that passes validation.
  CUipcMemHandle h;
  std::memcpy(h.reserved, b.cuda_ipc().handle().data(), sizeof(h.reserved));
  CUdeviceptr opened = 0;
  ASSERT_EQ(api.cuIpcOpenMemHandle(&opened, h, 1), CUDA_SUCCESS);
  ASSERT_EQ(api.cuIpcCloseMemHandle(opened), CUDA_SUCCESS);
  const int64_t shift =
      static_cast<int64_t>(own) - static_cast<int64_t>(opened);
  if (shift > 0 && static_cast<uint64_t>(shift) < b.addr()) {
    descriptor::Buffer lying = b;
    lying.mutable_cuda_ipc()->set_base(b.addr() - shift);
    lying.mutable_cuda_ipc()->set_size(b.cuda_ipc().size() + shift);
    auto hostile = view_of(lying);
    ASSERT_NE(hostile, nullptr);
    absl::Status st = write(*hostile);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    std::vector<uint8_t> back(4096);
    ASSERT_OK(d.CopyFromDevice(back.data(), own, back.size()));
    EXPECT_EQ(back[0], 0xaa) << "the initiator's own GPU memory was written";
  } else {
    ADD_FAILURE() << "layout: own memory at 0x" << std::hex << own
                  << " is not above the mapping at 0x" << opened;
  }

  // The target withdraws and frees its buffer, and exits: within a few
  // housekeeping rounds this process no longer holds its memory.
  const int before = SoftgpuMemfds();
  ASSERT_TRUE(Send(down[1], "free"));
  ASSERT_EQ(Receive(up[0]), "freed");
  ASSERT_TRUE(Send(down[1], "exit"));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (SoftgpuMemfds() >= before && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(SoftgpuMemfds(), before - 1)
      << "the exited target's GPU memory is still mapped here";
  init.Shutdown();
  ASSERT_EQ(api.cuMemFree(own), CUDA_SUCCESS);
}

}  // namespace
}  // namespace ferry::shm
