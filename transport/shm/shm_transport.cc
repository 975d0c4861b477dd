#include "transport/shm/shm_transport.h"

#include <errno.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <system_error>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/host_info.h"
#include "common/log.h"
#include "common/secure_random.h"
#include "common/status_macros.h"
#include "transport/shm/shm_peer.h"

namespace ferry::shm {
namespace {

// process_vm_readv/writev take at most this many iovecs per side.
constexpr size_t kMaxIov = 1024;
// A target that could not be attached is not tried again for this long
// (its run; a restart is tried at once).
constexpr absl::Duration kAttachRetry = absl::Seconds(1);
// How often an idle copy thread drops peers that exited and closes the GPU
// mappings of withdrawn buffers (each keeps the target's memory alive).
constexpr absl::Duration kHousekeepInterval = absl::Seconds(1);

absl::Status ValidateOptions(const ShmOptions& o) {
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("shm.", what));
  };
  if (o.slice_bytes < 4096 || o.slice_bytes > (size_t{1} << 30)) {
    return bad(
        absl::StrCat("slice_bytes must be 4 KiB..1 GiB (", o.slice_bytes, ")"));
  }
  if (o.copy_threads < 1 || o.copy_threads > 64) {
    return bad(
        absl::StrCat("copy_threads must be 1..64 (", o.copy_threads, ")"));
  }
  if (o.max_peers < 1 || o.max_peers > 65536) {
    return bad(absl::StrCat("max_peers must be 1..65536 (", o.max_peers, ")"));
  }
  if (o.staging_buffers < 1 || o.staging_buffers > 1024) {
    return bad(absl::StrCat("staging_buffers must be 1..1024 (",
                            o.staging_buffers, ")"));
  }
  if (o.unregister_wait < absl::ZeroDuration() ||
      o.unregister_wait > absl::Hours(1)) {
    return bad("unregister_wait must be 0..1 h");
  }
  // max_buffers and max_lanes: ShmTable::Create checks them.
  if (o.max_buffers < 1 || o.max_lanes < 1) {
    return bad("max_buffers and max_lanes must be positive");
  }
  return absl::OkStatus();
}

int PidfdOpen(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

// Yama's ptrace_scope: 0 classic, 1 descendants only (unless the target
// names a tracer), 2 admin only, 3 none; -1 where Yama is absent.
int YamaScope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  int scope = -1;
  if (!(in >> scope)) return -1;
  return scope;
}

// PR_SET_PTRACER is the process's, and engines come and go: it stays set
// while some installed shm transport wants it, and is withdrawn with the
// last.
Mutex ptracer_mu;
int ptracer_users ABSL_GUARDED_BY(ptracer_mu) = 0;

absl::Status RetainPtracerAny() {
  MutexLock lock(&ptracer_mu);
  if (ptracer_users == 0 &&
      ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) {
    return absl::InternalError(
        absl::StrCat("prctl(PR_SET_PTRACER_ANY): ", std::strerror(errno)));
  }
  ++ptracer_users;
  return absl::OkStatus();
}

void ReleasePtracerAny() {
  MutexLock lock(&ptracer_mu);
  if (--ptracer_users == 0) ::prctl(PR_SET_PTRACER, 0, 0, 0, 0);
}

absl::Status CopyError(int err, const Slice& s, pid_t pid) {
  const std::string what =
      absl::StrCat(s.op == OpCode::kWrite ? "shm write" : "shm read", " of ",
                   s.length, " bytes at 0x", absl::Hex(s.remote),
                   " of segment '", s.target->name(), "' (pid ", pid, "): ");
  switch (err) {
    case ESRCH:
      return absl::UnavailableError(
          absl::StrCat(what, "the target process exited"));
    case EPERM:
    case EACCES:
      return absl::PermissionDeniedError(
          absl::StrCat(what, std::strerror(err),
                       " (ptrace permission over the target withdrawn)"));
    case EFAULT:
      return absl::FailedPreconditionError(absl::StrCat(
          what,
          "the memory is not mapped (the target freed a buffer it still "
          "had registered, or the local buffer went)"));
    default:
      return absl::InternalError(absl::StrCat(what, std::strerror(err)));
  }
}

}  // namespace

const std::string& LocalShmHost() {
  static const std::string* host =
      new std::string(absl::StrCat(BootId(), "/pid:", NamespaceInode("pid")));
  return *host;
}

ShmTransport::Peer::~Peer() {
  for (uint32_t l : lanes) table->ReleaseLane(l, owner);
  if (pidfd >= 0) ::close(pidfd);
  MutexLock lock(&ipc_mu);
  if (!opened.empty()) transport->CloseLater(opened);
}

ShmTransport::ShmTransport(const TransportOptions& options)
    : options_(options),
      gpu_staging_(&staging_path_, "shm", "shm.staging_buffers",
                   options_.shm.staging_buffers, options_.shm.slice_bytes) {}

ShmTransport::~ShmTransport() { Shutdown(); }

absl::Status ShmTransport::Install(const TransportEnv& env,
                                   descriptor::TransportEndpoint* endpoint) {
  FERRY_RETURN_IF_ERROR(ValidateOptions(options_.shm));
  clock_ = ClockOrReal(env.clock);
  gpu_staging_.SetClock(clock_);
  auto table = ShmTable::Create(static_cast<uint32_t>(options_.shm.max_buffers),
                                static_cast<uint32_t>(options_.shm.max_lanes));
  if (!table.ok()) {
    return absl::Status(
        table.status().code(),
        absl::StrCat("shm transport: ", table.status().message()));
  }
  table_ = std::move(*table);
  owner_ = uint64_t{static_cast<uint32_t>(::getpid())} << 32 |
           std::max<uint64_t>(1, SecureRandomNonZero64() & 0xffffffffu);
  const int scope = YamaScope();
  if (scope == 1) {
    // The descendants-only rule would keep same-user peers out; letting
    // them in is what installing shm asks for (shm_transport.h).
    if (absl::Status s = RetainPtracerAny(); !s.ok()) {
      FERRY_LOG(kWarn, "shm", s.message(),
                "; peers on this host may fall back");
    } else {
      ptracer_set_ = true;
    }
  } else if (scope >= 2) {
    FERRY_LOG(kWarn, "shm", "kernel.yama.ptrace_scope is ", scope,
              ": only privileged peers can copy to this engine directly; "
              "others use their next transport");
  }
  descriptor::ShmEndpoint* m = endpoint->mutable_shm();
  m->set_host(LocalShmHost());
  m->set_pid(static_cast<uint32_t>(::getpid()));
  m->set_table_fd(table_->fd());
  m->set_token_addr(table_->token_address());
  m->set_token(table_->token());
  {
    MutexLock lock(&queue_mu_);
    stopping_ = false;
  }
  streams_.assign(options_.shm.copy_threads, {});
  for (int i = 0; i < options_.shm.copy_threads; ++i) {
    try {
      workers_.emplace_back([this, i] { WorkerLoop(i); });
    } catch (const std::system_error& e) {
      Shutdown();
      return absl::ResourceExhaustedError(
          absl::StrCat("shm transport: cannot start a thread: ", e.what()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<MemoryHandle> ShmTransport::RegisterMemory(
    const MemoryRegion& region, descriptor::Buffer* published) {
  MemoryHandle handle = nullptr;
  if (region.cuda_device >= 0) {
    // As a source or destination here, GPU memory moves through pinned
    // host buffers to a peer's host memory (a copy system call cannot
    // touch device memory), and with the GPU to a peer's GPU memory.
    FERRY_ASSIGN_OR_RETURN(handle,
                           gpu_staging_.PrepareHandle(region.cuda_device));
    if (!region.remote_accessible || table_ == nullptr) return handle;
    // Peers reach it through the driver's IPC handle; where the driver
    // cannot make one, through their next transport (no shm key).
    if (absl::Status s = PublishIpc(region, published); !s.ok()) {
      FERRY_LOG(kInfo, "shm", "GPU buffer 0x", absl::Hex(region.addr),
                " is not served over shm: ", s.message());
      return handle;
    }
  } else if (!region.remote_accessible || table_ == nullptr) {
    return nullptr;
  }
  MutexLock lock(&mu_);
  if (keys_.contains(region.addr)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "a buffer at 0x", absl::Hex(region.addr), " is already registered"));
  }
  FERRY_ASSIGN_OR_RETURN(const uint64_t key, table_->AddBuffer());
  keys_[region.addr] = key;
  published->set_shm_key(key);
  return handle;
}

absl::Status ShmTransport::UnregisterMemory(uintptr_t addr) {
  uint64_t key;
  {
    MutexLock lock(&mu_);
    auto it = keys_.find(addr);
    if (it == keys_.end()) return absl::OkStatus();  // Local or GPU only.
    key = it->second;
    keys_.erase(it);
  }
  return table_->RemoveBuffer(key, options_.shm.unregister_wait, clock_);
}

bool ShmTransport::CanReach(const SegmentView& target) {
  absl::Status why;
  return FindPeer(target, &why) != nullptr;
}

std::shared_ptr<ShmTransport::Peer> ShmTransport::FindPeer(
    const SegmentView& target, absl::Status* why) {
  const descriptor::TransportEndpoint* ep = target.FindTransport("shm");
  if (ep == nullptr || table_ == nullptr) {
    *why = absl::FailedPreconditionError(
        absl::StrCat("segment '", target.name(), "' serves no shm endpoint"));
    return nullptr;
  }
  if (ep->shm().host() != LocalShmHost()) {
    *why = absl::FailedPreconditionError(absl::StrCat(
        "segment '", target.name(), "' is on another host or PID namespace (",
        ep->shm().host(), "; this process: ", LocalShmHost(), ")"));
    return nullptr;
  }
  {
    MutexLock lock(&mu_);
    auto it = peers_.find(target.name());
    if (it != peers_.end()) {
      if (it->second->incarnation == target.incarnation() &&
          !it->second->gone.load(std::memory_order_relaxed)) {
        return it->second;
      }
      peers_.erase(it);  // Restarted or exited: attach the new run.
    }
    auto failed = failures_.find(target.name());
    if (failed != failures_.end() &&
        failed->second.incarnation == target.incarnation() &&
        clock_->Now() < failed->second.retry_at) {
      *why = failed->second.status;
      return nullptr;
    }
    if (peers_.size() >= static_cast<size_t>(options_.shm.max_peers)) {
      // Peers whose process exited stay until looked up again: drop them
      // before refusing a new one.
      absl::erase_if(peers_, [](const auto& p) {
        return p.second->gone.load(std::memory_order_relaxed) ||
               p.second->Exited();
      });
    }
    if (peers_.size() >= static_cast<size_t>(options_.shm.max_peers)) {
      *why = absl::ResourceExhaustedError(
          absl::StrCat("shm.max_peers (", options_.shm.max_peers,
                       ") peers are attached already"));
      return nullptr;
    }
    // One attach per target at a time, outside the lock (it makes system
    // calls against the target); meanwhile its requests take the next
    // transport.
    if (!attaching_.insert(target.name()).second) {
      *why = absl::UnavailableError("being attached by another thread");
      return nullptr;
    }
  }
  attaches_.fetch_add(1, std::memory_order_relaxed);
  auto peer = Attach(target);
  MutexLock lock(&mu_);
  attaching_.erase(target.name());
  if (!peer.ok()) {
    attach_failures_.fetch_add(1, std::memory_order_relaxed);
    FERRY_LOG_EVERY(kWarn, "shm", absl::Seconds(10), "cannot attach segment '",
                    target.name(), "' on this host; using the next transport: ",
                    peer.status().ToString());
    failures_[target.name()] = {target.incarnation(),
                                clock_->Now() + kAttachRetry, peer.status()};
    *why = peer.status();
    return nullptr;
  }
  failures_.erase(target.name());
  FERRY_LOG(kDebug, "shm", "attached segment '", target.name(), "' (pid ",
            (*peer)->pid, ")");
  peers_[target.name()] = *peer;
  return *peer;
}

absl::StatusOr<std::shared_ptr<ShmTransport::Peer>> ShmTransport::Attach(
    const SegmentView& target) {
  const descriptor::ShmEndpoint& m = target.FindTransport("shm")->shm();
  auto peer = std::make_shared<Peer>();
  peer->transport = this;
  peer->name = target.name();
  peer->incarnation = target.incarnation();
  peer->pid = static_cast<pid_t>(m.pid());
  peer->owner = owner_;
  peer->same_process = peer->pid == ::getpid();
  // The pidfd first: if the pid names the engine when the checks below
  // pass, the pidfd names it too, and tells when it exits (a pid may be
  // reused after that; the pidfd cannot).
  peer->pidfd = PidfdOpen(peer->pid);
  if (peer->pidfd < 0) {
    // Without a pidfd, an exited target's pid could be reused by another
    // process, which would then receive the copies.
    const int e = errno;
    if (e == ESRCH) {
      return absl::UnavailableError(
          absl::StrCat("process ", peer->pid, " has exited"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("pidfd_open(", peer->pid, "): ", std::strerror(e),
                     " (shm needs Linux 5.3 or later)"));
  }
  FERRY_ASSIGN_OR_RETURN(peer->table,
                         ShmTable::Attach(peer->pid, m.table_fd(), m.token()));
  // The copy permission (stricter than opening the table): read the
  // token back from the target's memory.
  char token[kTokenBytes];
  iovec local{token, sizeof(token)};
  iovec remote{reinterpret_cast<void*>(m.token_addr()), sizeof(token)};
  const ssize_t n = ::process_vm_readv(peer->pid, &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(sizeof(token))) {
    const int e = n < 0 ? errno : EFAULT;
    const std::string what = absl::StrCat("process_vm_readv of process ",
                                          peer->pid, ": ", std::strerror(e));
    if (e == EPERM || e == EACCES) {
      return absl::PermissionDeniedError(absl::StrCat(
          what,
          " (ptrace permission: same user, and kernel.yama.ptrace_scope <= "
          "1)"));
    }
    if (e == ESRCH) return absl::UnavailableError(what);
    return absl::FailedPreconditionError(
        absl::StrCat(what,
                     " (the descriptor's token address is not mapped "
                     "there)"));
  }
  if (std::memcmp(token, m.token().data(), sizeof(token)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "process ", peer->pid, " does not hold the descriptor's token"));
  }
  for (int i = 0; i <= options_.shm.copy_threads; ++i) {
    FERRY_ASSIGN_OR_RETURN(uint32_t lane, peer->table->ClaimLane(owner_));
    peer->lanes.push_back(lane);
  }
  return peer;
}

void ShmTransport::Submit(absl::Span<Slice* const> slices) {
  size_t i = 0;
  while (i < slices.size()) {
    Slice* s = slices[i];
    if (s->target->buffer(s->remote_buffer).has_cuda_ipc()) {
      // The target's GPU memory: copied by the GPU, on a copy thread (a
      // submitting thread may be one that must not call CUDA).
      absl::Status why;
      std::shared_ptr<Peer> peer = FindPeer(*s->target, &why);
      if (peer == nullptr) {
        FailAll(absl::MakeConstSpan(&s, 1),
                absl::UnavailableError(absl::StrCat(
                    "shm: cannot reach segment '", s->target->name(),
                    "' directly: ", why.message())));
      } else {
        Queue(peer, absl::MakeConstSpan(&s, 1), /*gpu=*/true);
      }
      ++i;
      continue;
    }
    if (const int gpu = GpuStaging::DeviceOf(s->local_handle); gpu >= 0) {
      gpu_staging_.Submit(s, gpu);
      ++i;
      continue;
    }
    // A run of host slices to one target (usually the whole span).
    size_t j = i + 1;
    while (j < slices.size() && slices[j]->target == s->target &&
           slices[j]->local_handle == nullptr &&
           !s->target->buffer(slices[j]->remote_buffer).has_cuda_ipc()) {
      ++j;
    }
    absl::Status why;
    std::shared_ptr<Peer> peer = FindPeer(*s->target, &why);
    if (peer == nullptr) {
      FailAll(slices.subspan(i, j - i),
              absl::UnavailableError(
                  absl::StrCat("shm: cannot reach segment '", s->target->name(),
                               "' directly: ", why.message())));
    } else {
      SubmitHost(peer, slices.subspan(i, j - i));
    }
    i = j;
  }
}

void ShmTransport::HostPath::SubmitStaged(Slice* slice) {
  absl::Status why;
  std::shared_ptr<Peer> peer = transport->FindPeer(*slice->target, &why);
  if (peer == nullptr) {
    slice->Complete(absl::UnavailableError(
        absl::StrCat("shm: cannot reach segment '", slice->target->name(),
                     "' directly: ", why.message())));
    return;
  }
  transport->SubmitHost(peer, absl::MakeConstSpan(&slice, 1));
}

void ShmTransport::SubmitHost(const std::shared_ptr<Peer>& peer,
                              absl::Span<Slice* const> slices) {
  if (closed_.load(std::memory_order_acquire)) {
    FailAll(slices, absl::CancelledError("shm transport shut down"));
    return;
  }
  size_t bytes = 0;
  for (const Slice* s : slices) bytes += s->length;
  if (bytes <= options_.shm.inline_bytes && peer->inline_mu.TryLock()) {
    // Small: cheaper to copy than to hand to a thread and back.
    CopyRun(*peer, peer->lanes[0], slices);
    peer->inline_mu.Unlock();
    return;
  }
  Queue(peer, slices, /*gpu=*/false);
}

void ShmTransport::Queue(const std::shared_ptr<Peer>& peer,
                         absl::Span<Slice* const> slices, bool gpu) {
  {
    MutexLock lock(&queue_mu_);
    if (!stopping_) {
      for (Slice* s : slices) queue_.push_back(Job{peer, s, gpu});
      queue_cv_.SignalAll();
      return;
    }
  }
  FailAll(slices, absl::CancelledError("shm transport shut down"));
}

void ShmTransport::WorkerLoop(int index) {
  std::vector<Job> jobs;
  std::vector<Slice*> run;
  std::vector<OpenedGpuMemory> closing;
  for (;;) {
    jobs.clear();
    closing.clear();
    bool housekeep = false;
    {
      MutexLock lock(&queue_mu_);
      while (queue_.empty() && to_close_.empty() && !stopping_) {
        // The first copy thread also looks after peers now and then.
        if (index == 0 &&
            queue_cv_.WaitWithTimeout(&queue_mu_, kHousekeepInterval)) {
          housekeep = true;
          break;
        }
        if (index != 0) queue_cv_.Wait(&queue_mu_);
      }
      closing.swap(to_close_);
      if (!housekeep && queue_.empty() && closing.empty()) return;
      // This thread's share of what is queued (so that the copy threads
      // split one large batch between them), at most one copy's worth.
      const size_t threads = static_cast<size_t>(options_.shm.copy_threads);
      const size_t share = std::min(
          kMaxIov,
          std::max<size_t>(1, (queue_.size() + threads - 1) / threads));
      if (queue_.size() > share) queue_cv_.Signal();  // For the rest.
      while (!queue_.empty() && jobs.size() < share) {
        jobs.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    CloseIpc(closing);
    if (housekeep) {
      Housekeep();
      continue;
    }
    size_t i = 0;
    while (i < jobs.size()) {
      run.clear();
      Peer* peer = jobs[i].peer.get();
      const bool gpu = jobs[i].gpu;
      while (i < jobs.size() && jobs[i].peer.get() == peer &&
             jobs[i].gpu == gpu) {
        run.push_back(jobs[i].slice);
        ++i;
      }
      if (gpu) {
        CopyRunGpu(*peer, peer->lanes[1 + index], index, run);
      } else {
        CopyRun(*peer, peer->lanes[1 + index], run);
      }
    }
  }
}

void ShmTransport::CopyRun(Peer& peer, uint32_t lane,
                           absl::Span<Slice* const> slices) {
  // Status per slice, OK until found otherwise.
  std::vector<absl::Status> status(slices.size());
  if (peer.gone.load(std::memory_order_relaxed) || peer.Exited()) {
    peer.gone.store(true, std::memory_order_relaxed);
    FailAll(slices, absl::UnavailableError(
                        absl::StrCat("shm: the process of segment '", peer.name,
                                     "' (pid ", peer.pid, ") exited")));
    return;
  }
  const absl::Time now = clock_->Now();
  std::vector<iovec> local;
  std::vector<iovec> remote;
  std::vector<size_t> in_call;  // Indices of the slices in the current call.
  local.reserve(std::min(slices.size(), kMaxIov));
  remote.reserve(std::min(slices.size(), kMaxIov));
  // Issues the gathered slices as one system call; a short count is
  // redone slice by slice so that each failure gets its own errno.
  auto flush = [&](OpCode op) {
    if (in_call.empty()) return;
    auto call = [&](const iovec* l, const iovec* r, size_t n) {
      return op == OpCode::kWrite ? ::process_vm_writev(peer.pid, l, n, r, n, 0)
                                  : ::process_vm_readv(peer.pid, l, n, r, n, 0);
    };
    size_t total = 0;
    for (const iovec& v : local) total += v.iov_len;
    copies_.fetch_add(1, std::memory_order_relaxed);
    const ssize_t n = call(local.data(), remote.data(), local.size());
    if (n != static_cast<ssize_t>(total)) {
      for (size_t k = 0; k < in_call.size(); ++k) {
        copies_.fetch_add(1, std::memory_order_relaxed);
        const ssize_t one = call(&local[k], &remote[k], 1);
        if (one != static_cast<ssize_t>(local[k].iov_len)) {
          const int e = one < 0 ? errno : EFAULT;
          status[in_call[k]] = CopyError(e, *slices[in_call[k]], peer.pid);
          if (e == ESRCH) peer.gone.store(true, std::memory_order_relaxed);
        }
      }
    }
    local.clear();
    remote.clear();
    in_call.clear();
  };
  peer.table->Enter(lane);
  OpCode op = slices[0]->op;
  for (size_t k = 0; k < slices.size(); ++k) {
    Slice* s = slices[k];
    if (now >= s->deadline) {
      status[k] = absl::DeadlineExceededError(
          "shm: the slice's deadline passed before its copy");
      continue;
    }
    const uint64_t key = s->target->buffer(s->remote_buffer).shm_key();
    if (key == 0) {
      // The engine sends it here only when no transport reaches it.
      status[k] = absl::FailedPreconditionError(absl::StrCat(
          "shm: buffer 0x",
          absl::Hex(s->target->buffer(s->remote_buffer).addr()),
          " of segment '", s->target->name(),
          "' is not served over shm (GPU memory); list tcp or rdma after "
          "shm"));
      continue;
    }
    if (!peer.table->Live(key)) {
      status[k] = absl::FailedPreconditionError(absl::StrCat(
          "shm: buffer 0x",
          absl::Hex(s->target->buffer(s->remote_buffer).addr()),
          " of segment '", s->target->name(),
          "' was unregistered (the descriptor is stale); nothing copied"));
      continue;
    }
    if (s->op != op || local.size() == kMaxIov) {
      flush(op);
      op = s->op;
    }
    local.push_back(iovec{s->local, s->length});
    remote.push_back(iovec{reinterpret_cast<void*>(s->remote), s->length});
    in_call.push_back(k);
  }
  flush(op);
  peer.table->Exit(lane);
  // Completions after the lane is left: a sink may take long.
  Complete(slices, status);
}

void ShmTransport::Complete(absl::Span<Slice* const> slices,
                            const std::vector<absl::Status>& status) {
  uint64_t bytes = 0;
  uint64_t errors = 0;
  for (size_t k = 0; k < slices.size(); ++k) {
    if (status[k].ok()) {
      bytes += slices[k]->length;
    } else {
      ++errors;
    }
  }
  slices_.fetch_add(slices.size(), std::memory_order_relaxed);
  bytes_.fetch_add(bytes, std::memory_order_relaxed);
  if (errors != 0) errors_.fetch_add(errors, std::memory_order_relaxed);
  // OK runs to one sink complete as a group (the engine's sink counts
  // them cheaper); staging's shadow slices each have their own.
  size_t k = 0;
  while (k < slices.size()) {
    if (!status[k].ok()) {
      slices[k]->Complete(status[k]);
      ++k;
      continue;
    }
    size_t e = k + 1;
    while (e < slices.size() && status[e].ok() &&
           slices[e]->sink == slices[k]->sink) {
      ++e;
    }
    slices[k]->sink->OnSlicesDone(&slices[k], e - k);
    k = e;
  }
}

void ShmTransport::Housekeep() {
  std::vector<std::shared_ptr<Peer>> dropped;
  std::vector<OpenedGpuMemory> closing;
  {
    MutexLock lock(&mu_);
    for (auto it = peers_.begin(); it != peers_.end();) {
      Peer& p = *it->second;
      if (p.gone.load(std::memory_order_relaxed) || p.Exited()) {
        // Its mappings keep its GPU memory alive: they go with it.
        dropped.push_back(std::move(it->second));
        peers_.erase(it++);
        continue;
      }
      MutexLock ipc(&p.ipc_mu);
      for (auto o = p.opened.begin(); o != p.opened.end();) {
        if (!o->second.withdrawn && !p.table->Live(o->first)) {
          o->second.withdrawn = true;
        }
        if (o->second.withdrawn && o->second.users == 0) {
          closing.push_back(o->second);
          p.opened.erase(o++);
        } else {
          ++o;
        }
      }
      ++it;
    }
  }
  dropped.clear();  // Outside mu_: their mappings go to to_close_.
  CloseIpc(closing);
}

void ShmTransport::FailAll(absl::Span<Slice* const> slices,
                           const absl::Status& status) {
  errors_.fetch_add(slices.size(), std::memory_order_relaxed);
  for (Slice* s : slices) s->Complete(status);
}

void ShmTransport::ClosePeer(const SegmentView& segment) {
  // Copies in progress hold the peer; it is released after them.
  MutexLock lock(&mu_);
  peers_.erase(segment.name());
  failures_.erase(segment.name());
}

TransportStats ShmTransport::Stats() const {
  TransportStats st;
  st.transport = "shm";
  NicStats nic;
  nic.name = "shm";
  nic.port_active = table_ != nullptr;
  nic.slices = slices_.load(std::memory_order_relaxed);
  nic.bytes = bytes_.load(std::memory_order_relaxed);
  nic.errors = errors_.load(std::memory_order_relaxed);
  // One system call moves a run of slices: the analogue of a work request.
  nic.work_requests = copies_.load(std::memory_order_relaxed);
  st.nics.push_back(nic);
  st.connects_started = attaches_.load(std::memory_order_relaxed);
  st.connect_failures = attach_failures_.load(std::memory_order_relaxed);
  {
    MutexLock lock(&mu_);
    st.peers = peers_.size();
    st.endpoints = peers_.size();
  }
  st.threads = workers_.size();
  gpu_staging_.AddStats(&st);
  return st;
}

void ShmTransport::Shutdown() {
  // First: what staging hands on from here is cancelled, not copied.
  closed_.store(true, std::memory_order_release);
  {
    MutexLock lock(&queue_mu_);
    stopping_ = true;
  }
  gpu_staging_.Stop();
  std::deque<Job> left;
  {
    MutexLock lock(&queue_mu_);
    left.swap(queue_);
    queue_cv_.SignalAll();
  }
  for (Job& j : left) {
    errors_.fetch_add(1, std::memory_order_relaxed);
    j.slice->Complete(absl::CancelledError("shm transport shut down"));
  }
  left.clear();  // Their peers, before the last of them goes below.
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
  workers_.clear();
  {
    MutexLock lock(&mu_);
    peers_.clear();  // Their GPU mappings go to to_close_.
  }
  std::vector<OpenedGpuMemory> closing;
  {
    MutexLock lock(&queue_mu_);
    closing.swap(to_close_);
  }
  CloseIpc(closing);
  DestroyStreams();
  std::vector<uint64_t> keys;
  {
    MutexLock lock(&mu_);
    peers_.clear();
    failures_.clear();
    for (const auto& [addr, key] : keys_) keys.push_back(key);
    keys_.clear();
  }
  // The engine drops its registrations without unregistering them one by
  // one, and peers keep the table: withdraw every buffer from them (and
  // wait out their copies) before the application may free it.
  for (uint64_t key : keys) {
    absl::Status s =
        table_->RemoveBuffer(key, options_.shm.unregister_wait, clock_);
    if (!s.ok()) FERRY_LOG(kError, "shm", "at shutdown: ", s.ToString());
  }
  if (ptracer_set_) {
    ptracer_set_ = false;
    ReleasePtracerAny();
  }
}

}  // namespace ferry::shm
