// RdmaTransport: options, NICs, wiring of the parts, stats and shutdown.
#include "transport/rdma/rdma_transport.h"

#include <errno.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "gpu/cuda_driver.h"
#include "transport/rdma/local_mr.h"
#include "transport/rdma/verbs_compat.h"
#include "transport/softrnic/softrnic_control.h"

namespace ferry::rdma {

RdmaTransport::RdmaTransport(const TransportOptions& options)
    : ctx_(options),
      gpu_staging_(std::make_unique<GpuStaging>(
          &staging_path_, "RDMA", "rdma.staging_buffers",
          std::max(options.rdma.staging_buffers, 1),
          options.rdma.slice_bytes)) {}

RdmaTransport::~RdmaTransport() {
  Shutdown();
  gpu_staging_.reset();  // Frees its pinned buffers, deregistered already.
}

absl::Status RdmaTransport::ValidateOptions() const {
  const RdmaOptions& o = ctx_.options.rdma;
  if (o.slice_bytes < 4096 || o.slice_bytes > (64u << 20)) {
    return absl::InvalidArgumentError("rdma.slice_bytes must be 4 KiB..64 MiB");
  }
  if (o.stripe_bytes > (size_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rdma.stripe_bytes must be 0..1 GiB (", o.stripe_bytes, ")"));
  }
  if (o.qps_per_endpoint < 1 || o.qps_per_endpoint > 16) {
    return absl::InvalidArgumentError("rdma.qps_per_endpoint must be 1..16");
  }
  if (o.signal_every < 1 || o.signal_every > static_cast<int>(kMaxChain)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rdma.signal_every must be 1..", kMaxChain, " (", o.signal_every,
        "): the last WR of every chain of at most ", kMaxChain,
        " is signaled anyway"));
  }
  if (o.inline_bytes < 0 || o.inline_bytes > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rdma.inline_bytes must be 0..1024 (", o.inline_bytes, ")"));
  }
  if (o.worker_threads < 0 || o.worker_threads > 64) {
    return absl::InvalidArgumentError("rdma.worker_threads must be 0..64");
  }
  if (o.staging_buffers < 1 || o.staging_buffers > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rdma.staging_buffers must be 1..4096 (", o.staging_buffers, ")"));
  }
  if (o.max_endpoints < 1 || o.max_peers < 1) {
    return absl::InvalidArgumentError(
        "rdma.max_endpoints and rdma.max_peers must be >= 1");
  }
  if (o.keepalive_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rdma.keepalive_interval must be >= 0");
  }
  if (o.max_attempts < 1 || o.pause_after_errors < 1 || o.spin_polls < 0 ||
      o.pause_duration < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "rdma.max_attempts and rdma.pause_after_errors must be >= 1, "
        "rdma.spin_polls and rdma.pause_duration >= 0");
  }
  if (o.qp_timeout < 1 || o.qp_timeout > 31 || o.qp_retry_count < 0 ||
      o.qp_retry_count > 7) {
    return absl::InvalidArgumentError(
        "rdma.qp_timeout must be 1..31 and rdma.qp_retry_count 0..7");
  }
  if (o.traffic_class < 0 || o.traffic_class > 255 || o.service_level < 0 ||
      o.service_level > 15 || o.hop_limit < 1 || o.hop_limit > 255 ||
      o.flow_label > 0xfffff) {
    return absl::InvalidArgumentError(
        absl::StrCat("rdma.traffic_class must be 0..255 (", o.traffic_class,
                     "), rdma.service_level 0..15 (", o.service_level,
                     "), rdma.hop_limit 1..255 (", o.hop_limit,
                     ") and rdma.flow_label below 2^20 (", o.flow_label, ")"));
  }
  for (int cpu : o.worker_cpus) {
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
      return absl::InvalidArgumentError(
          absl::StrCat("rdma.worker_cpus: bad CPU ", cpu));
    }
  }
  return absl::OkStatus();
}

absl::Status RdmaTransport::Install(const TransportEnv& env,
                                    descriptor::TransportEndpoint* endpoint) {
  FERRY_RETURN_IF_ERROR(ValidateOptions());
  ctx_.env = env;
  ctx_.clock = ClockOrReal(env.clock);
  queue_.SetClock(ctx_.clock);
  gpu_staging_->SetClock(ctx_.clock);
  ctx_.incarnation = env.incarnation;
  if (ctx_.incarnation == 0) {
    // Stand-alone use (tests): any run-unique value will do.
    std::random_device rd;
    ctx_.incarnation = (static_cast<uint64_t>(rd()) << 32) | rd() | 1;
  }
  if (!env.auth_token.empty() &&
      softrnic::SetClusterToken(env.auth_token.c_str()) != 0 &&
      errno == EEXIST) {
    // softrnic (the emulated NIC) proves the token on its own connections
    // and takes it from the environment or the first engine; a real NIC
    // (ENOSYS) has no such thing.
    FERRY_LOG(kWarn, "rdma",
              "softrnic already holds another cluster token (from the "
              "environment or an earlier engine in this process); its "
              "connections prove that one, not this engine's auth_token");
  }
  ctx_.timers.timeout = static_cast<uint8_t>(ctx_.options.rdma.qp_timeout);
  ctx_.timers.retry_count =
      static_cast<uint8_t>(ctx_.options.rdma.qp_retry_count);
  ctx_.timers.traffic_class =
      static_cast<uint8_t>(ctx_.options.rdma.traffic_class);
  ctx_.timers.service_level =
      static_cast<uint8_t>(ctx_.options.rdma.service_level);
  ctx_.timers.hop_limit = static_cast<uint8_t>(ctx_.options.rdma.hop_limit);
  ctx_.timers.flow_label = ctx_.options.rdma.flow_label;
  if (ctx_.options.rdma.fork_safe) {
    if (int rc = ibv_fork_init(); rc != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rdma.fork_safe: ibv_fork_init failed (", std::strerror(rc),
          "): it must run before any memory is registered in this process"));
    }
  }
  FERRY_RETURN_IF_ERROR(OpenNics(endpoint));
  ctx_.env.peer_channel->SetHandler(
      "rdma", [this](const std::string& from, const std::string& payload) {
        return rails_.OnExchange(from, payload);
      });
  FERRY_RETURN_IF_ERROR(completions_.Start());
  return control_.Start(
      ctx_.clock, [this](const ControlJob& job) { rails_.RunJob(job); },
      [this](int64_t now_ns) { return rails_.Housekeep(now_ns); });
}

absl::Status RdmaTransport::OpenNics(descriptor::TransportEndpoint* endpoint) {
  auto devices = ListDevices(ctx_.options.rdma.devices);
  if (!devices.ok()) return devices.status();
  std::vector<std::string> skipped;
  // A bad GID pin (past the table, or an empty entry) is a configuration
  // error, not an outage: said as such when it leaves no NIC.
  absl::StatusCode code = absl::StatusCode::kUnavailable;
  for (ibv_device* dev : *devices) {
    auto nic = Nic::Open(dev, EffectiveGidIndex(ctx_.options.rdma));
    if (!nic.ok()) {
      skipped.emplace_back(nic.status().message());
      const absl::StatusCode c = nic.status().code();
      if (code == absl::StatusCode::kUnavailable &&
          (c == absl::StatusCode::kInvalidArgument ||
           c == absl::StatusCode::kFailedPrecondition)) {
        code = c;
      }
      continue;  // Only ACTIVE ports are used.
    }
    ctx_.nics.push_back(std::move(*nic));
  }
  if (ctx_.nics.empty()) {
    return absl::Status(code, absl::StrCat("no usable RDMA NIC: ",
                                           absl::StrJoin(skipped, "; ")));
  }
  for (const std::string& why : skipped) {
    // Said once here: such a NIC stays out of use for this run, even if
    // its port comes up later.
    FERRY_LOG(kWarn, "rdma", "not using a NIC: ", why,
              "; it is not used until the engine restarts");
  }
  std::vector<std::string> names;
  for (const auto& nic : ctx_.nics) names.push_back(nic->name());
  if (!ctx_.options.rdma.topology_json.empty()) {
    auto topo = Topology::FromJson(ctx_.options.rdma.topology_json, names);
    if (!topo.ok()) return topo.status();
    topology_ = std::move(*topo);
  } else {
    // CUDA numbers GPUs its own way (fastest first by default): where the
    // application has loaded the driver, cuda:N is the GPU at the address
    // the driver gives for N, not the N-th in PCI order.
    std::vector<std::string> gpu_ids;
    if (const gpu::CudaDriver* d = gpu::CudaDriver::IfLoaded()) {
      for (int g = 0; g < d->device_count(); ++g) {
        absl::StatusOr<std::string> id = d->PciBusId(g);
        gpu_ids.push_back(id.ok() ? *id : "");
      }
    }
    topology_ =
        Topology::FromSysfs(ctx_.options.rdma.sysfs_root, names, gpu_ids);
    if (!gpu_ids.empty()) {
      FERRY_LOG(kInfo, "rdma",
                "GPUs by CUDA ordinal: ", absl::StrJoin(gpu_ids, ", "),
                " (PCI addresses from the driver)");
    }
  }
  for (size_t i = 0; i < ctx_.nics.size(); ++i) {
    descriptor::Device* d = endpoint->add_devices();
    d->set_name(ctx_.nics[i]->name());
    const ibv_gid gid = ctx_.nics[i]->gid();
    d->set_gid(std::string(reinterpret_cast<const char*>(gid.raw), 16));
    d->set_lid(ctx_.nics[i]->lid());
    const bool roce = ctx_.nics[i]->link_layer() == IBV_LINK_LAYER_ETHERNET;
    const std::string address = GidAddress(gid);
    FERRY_LOG(
        kInfo, "rdma", ctx_.nics[i]->name(), ": ",
        roce ? "RoCE" : absl::StrCat("InfiniBand, LID ", ctx_.nics[i]->lid()),
        ", active MTU ", MtuBytes(ctx_.nics[i]->active_mtu()), ", GID index ",
        ctx_.nics[i]->gid_index(), " (", ctx_.nics[i]->gid_reason(), ")",
        address.empty() ? "" : absl::StrCat(", address ", address));
    // Not fatal: the probe page only serves the doctor.
    if (absl::Status s = ctx_.nics[i]->RegisterProbePage(); s.ok()) {
      d->set_probe_addr(ctx_.nics[i]->probe_addr());
      d->set_probe_rkey(ctx_.nics[i]->probe_rkey());
    } else {
      FERRY_LOG(kWarn, "rdma", s.message(),
                "; tools/doctor cannot probe this NIC");
    }
    completions_.AddNic(ctx_.nics[i].get());
  }
  return absl::OkStatus();
}

absl::StatusOr<MemoryHandle> RdmaTransport::RegisterMemory(
    const MemoryRegion& region, descriptor::Buffer* published) {
  return mrs_.Register(region, published);
}

absl::StatusOr<MemoryHandle> RdmaTransport::StagedPath::RegisterStagingBuffer(
    uint8_t* buffer, size_t bytes) {
  MemoryRegion r;
  r.addr = reinterpret_cast<uintptr_t>(buffer);
  r.length = bytes;
  descriptor::Buffer unpublished;
  return transport->RegisterMemory(r, &unpublished);
}

void RdmaTransport::StagedPath::UnregisterStagingBuffer(uint8_t* buffer) {
  // NotFound after Shutdown, which deregistered every MR.
  transport->UnregisterMemory(reinterpret_cast<uintptr_t>(buffer))
      .IgnoreError();
}

absl::Status RdmaTransport::UnregisterMemory(uintptr_t addr) {
  return mrs_.Unregister(addr);
}

void RdmaTransport::Submit(absl::Span<Slice* const> slices) {
  if (ctx_.stopping.load(std::memory_order_acquire)) {
    for (Slice* s : slices) {
      s->Complete(absl::CancelledError("RDMA transport is shut down"));
    }
    return;
  }
  if (mrs_.any_staged()) {
    return SubmitSomeStaged(slices);
  }
  const absl::Time now = ctx_.clock->Now();
  size_t i = 0;
  while (i < slices.size()) {
    size_t j = i + 1;
    while (j < slices.size() && slices[j]->target == slices[i]->target) ++j;
    path_.RouteRun(slices.subspan(i, j - i), now, 0);
    i = j;
  }
  control_.WakeIfIdle();
}

void RdmaTransport::SubmitSomeStaged(absl::Span<Slice* const> slices) {
  // GPU memory no NIC could register goes through host buffers; the rest
  // is routed as usual, in runs to one target.
  auto staged = [](const Slice* s) {
    const auto* mr = static_cast<const LocalMr*>(s->local_handle);
    return mr != nullptr && mr->staged ? mr->device : -1;
  };
  const absl::Time now = ctx_.clock->Now();
  size_t i = 0;
  while (i < slices.size()) {
    if (const int device = staged(slices[i]); device >= 0) {
      gpu_staging_->Submit(slices[i++], device);
      continue;
    }
    size_t j = i + 1;
    while (j < slices.size() && slices[j]->target == slices[i]->target &&
           staged(slices[j]) < 0) {
      ++j;
    }
    path_.RouteRun(slices.subspan(i, j - i), now, 0);
    i = j;
  }
  control_.WakeIfIdle();
}

TransportStats RdmaTransport::Stats() const {
  TransportStats st;
  st.transport = "rdma";
  for (const auto& nic : ctx_.nics) {
    NicStats& n = st.nics.emplace_back();
    n.name = nic->name();
    n.port_active = nic->port_active();
    n.slices = nic->slices.load(std::memory_order_relaxed);
    n.bytes = nic->bytes.load(std::memory_order_relaxed);
    n.errors = nic->errors.load(std::memory_order_relaxed);
    n.work_requests = nic->work_requests.load(std::memory_order_relaxed);
    n.completions = nic->completions.load(std::memory_order_relaxed);
    n.outstanding_wrs = nic->posted_wrs.load(std::memory_order_relaxed);
    n.fatal = nic->fatal();
  }
  st.endpoints = rails_.endpoints();
  st.peers = rails_.peers();
  st.threads =
      static_cast<uint64_t>(completions_.threads() + control_.threads());
  st.fast_failures = ctx_.counters.fast_failures.load();
  st.connects_started = ctx_.counters.connects_started.load();
  st.connects_accepted = ctx_.counters.connects_accepted.load();
  st.qps_created = ctx_.counters.qps_created.load();
  st.connect_failures = ctx_.counters.connect_failures.load();
  st.connect_races = ctx_.counters.connect_races.load();
  st.evictions = ctx_.counters.evictions.load();
  st.retries = ctx_.counters.retries.load();
  gpu_staging_->AddStats(&st);
  return st;
}

void RdmaTransport::Shutdown() {
  if (ctx_.stopping.exchange(true)) return;
  completions_.BeginStop();
  // Only notices go out from here on (ones a peer request in progress
  // still queues too); their deadline is set once no peer request can
  // queue more (below).
  control_.BeginFarewell(absl::InfiniteFuture());
  // Cancels the staged slices waiting for a buffer and runs the callbacks
  // of the copies in flight (whose slices Submit now cancels).
  if (gpu_staging_ != nullptr) gpu_staging_->Stop();
  // No peer request may run into what is torn down below: stop routing
  // them here and wait for those in progress.
  if (ctx_.env.peer_channel != nullptr) {
    ctx_.env.peer_channel->RemoveHandler(std::string(name()));
  }
  control_.BeginFarewell(ctx_.clock->Now() + kFarewell);
  control_.Stop();
  completions_.Stop();
  // Every endpoint, wherever it is referenced.
  std::vector<std::shared_ptr<Endpoint>> eps = rails_.TakeAll();
  for (auto& ep : queue_.TakeEndpoints()) {
    eps.push_back(std::move(ep));
  }
  for (auto& ep : completions_.TakeAll()) eps.push_back(std::move(ep));
  std::sort(eps.begin(), eps.end());
  eps.erase(std::unique(eps.begin(), eps.end()), eps.end());
  const absl::Status cancelled =
      absl::CancelledError("RDMA transport shut down");
  for (auto& ep : eps) {
    SliceQueue gone;
    {
      MutexLock lock(&ep->mu);
      ep->SetStateLocked(Endpoint::State::kFailed);
      gone.Append(&ep->waiting);
      // With the QPs destroyed no completion can come: the posted slices
      // are over too.
      for (QueuePair& q : ep->qps) {
        if (q.qp != nullptr) ibv_destroy_qp(q.qp);
        q.qp = nullptr;
      }
      ep->ReclaimPostedLocked(&gone);
    }
    while (Slice* s = gone.pop_front()) s->Complete(cancelled);
  }
  eps.clear();
  mrs_.DeregisterAll();
  completions_.Close();
  ctx_.nics.clear();
}

}  // namespace ferry::rdma
