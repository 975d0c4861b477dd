#include "transport/rdma/rdma_transport.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/rdma/handshake.pb.h"

namespace ferry::rdma {
namespace {

constexpr int kMaxChain = 32;

int64_t NowNs() { return absl::GetCurrentTimeNanos(); }

// Reconnect backoff per peer: 50 ms doubling up to 1.6 s.
constexpr int64_t kMinBackoffNs = 50'000'000;

const metadata::NicKey* FindKey(const metadata::Buffer& b,
                                const std::string& nic) {
  for (const auto& k : b.keys()) {
    if (k.nic() == nic) return &k;
  }
  return nullptr;
}

absl::Status CompletionError(const Slice& slice, const Endpoint& ep,
                             ibv_wc_status status) {
  std::string what =
      absl::StrCat("RDMA ", slice.op == OpCode::kWrite ? "WRITE" : "READ",
                   " of 0x", absl::Hex(slice.remote), "+", slice.length,
                   " via ", ep.nic()->name(), " -> ", ep.peer_segment(), "/",
                   ep.remote_nic(), " failed: ", ibv_wc_status_str(status));
  if (status == IBV_WC_REM_ACCESS_ERR) {
    // Same meaning and code as the TCP transport's refusal.
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        " (not inside a buffer registered as remote-accessible, or a "
        "stale key)"));
  }
  return absl::UnavailableError(what);
}

}  // namespace

RdmaTransport::RdmaTransport(const TransportOptions& options)
    : options_(options),
      endpoints_(options.rdma_max_endpoints,
                 [](const std::shared_ptr<Endpoint>& ep) {
                   // Never evict an endpoint with work queued or in flight,
                   // or one still connecting.
                   std::lock_guard<std::mutex> lock(ep->mu);
                   return ep->state == Endpoint::State::kConnecting ||
                          !ep->waiting.empty() || !ep->posted.empty();
                 }) {}

RdmaTransport::~RdmaTransport() { Shutdown(); }

absl::Status RdmaTransport::Install(const TransportEnv& env,
                                    metadata::TransportEndpoint* endpoint) {
  if (options_.rdma_slice_bytes < 4096 ||
      options_.rdma_slice_bytes > (64u << 20)) {
    return absl::InvalidArgumentError("rdma_slice_bytes must be 4 KiB..64 MiB");
  }
  if (options_.rdma_max_attempts < 1 || options_.rdma_pause_after_errors < 1 ||
      options_.rdma_spin_polls < 0 ||
      options_.rdma_pause_duration < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "rdma_max_attempts and rdma_pause_after_errors must be >= 1, "
        "rdma_spin_polls and rdma_pause_duration >= 0");
  }
  for (int cpu : options_.rdma_worker_cpus) {
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
      return absl::InvalidArgumentError(
          absl::StrCat("rdma_worker_cpus: bad CPU ", cpu));
    }
  }
  env_ = env;
  std::random_device rd;
  incarnation_ = (static_cast<uint64_t>(rd()) << 32) | rd();
  auto devices = ListDevices(options_.rdma_devices);
  if (!devices.ok()) return devices.status();
  std::string skipped;
  for (ibv_device* dev : *devices) {
    auto nic = Nic::Open(dev, options_.rdma_gid_index);
    if (!nic.ok()) {
      absl::StrAppend(&skipped, " ", nic.status().message(), ";");
      continue;  // Only ACTIVE ports are used.
    }
    nics_.push_back(std::move(*nic));
  }
  if (nics_.empty()) {
    return absl::UnavailableError(absl::StrCat("no usable RDMA NIC:", skipped));
  }
  std::vector<std::string> names;
  for (const auto& nic : nics_) names.push_back(nic->name());
  if (!options_.rdma_topology_json.empty()) {
    auto topo = Topology::FromJson(options_.rdma_topology_json, names);
    if (!topo.ok()) return topo.status();
    topology_ = std::move(*topo);
  } else {
    topology_ = Topology::FromNumaNodes(names, Topology::ReadNumaNodes(names));
  }
  for (size_t i = 0; i < nics_.size(); ++i) {
    metadata::Device* d = endpoint->add_devices();
    d->set_name(nics_[i]->name());
    d->set_gid(
        std::string(reinterpret_cast<const char*>(nics_[i]->gid().raw), 16));
    d->set_lid(nics_[i]->lid());
    auto w = std::make_unique<Worker>();
    w->nic = nics_[i].get();
    w->index = static_cast<int>(i);
    w->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    workers_.push_back(std::move(w));
  }
  env_.peer_service->SetExchangeHandler(
      "rdma", [this](const std::string& from, const std::string& payload) {
        return OnConnect(from, payload);
      });
  for (auto& w : workers_) {
    Worker* raw = w.get();
    w->thread = std::thread([this, raw] { WorkerLoop(raw); });
  }
  handshake_thread_ = std::thread([this] { HandshakeLoop(); });
  return absl::OkStatus();
}

absl::Status RdmaTransport::RegisterMemory(const MemoryRegion& region,
                                           metadata::Buffer* published) {
  int access = IBV_ACCESS_LOCAL_WRITE;
  if (region.remote_accessible) {
    access |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  }
  LocalMr entry{region.length, {}, {}};
  // Tiers are resolved once here, not per slice on the data path.
  for (size_t i = 0; i < nics_.size(); ++i) {
    entry.tiers.push_back(topology_.Tier(region.location, i));
  }
  // Registration pins and maps pages: for large buffers do the NICs in
  // parallel, as their page-table builds are independent.
  entry.mrs.resize(nics_.size(), nullptr);
  auto reg = [&](size_t i) {
    entry.mrs[i] =
        ibv_reg_mr(nics_[i]->pd(), reinterpret_cast<void*>(region.addr),
                   region.length, access);
  };
  if (region.length >= (1u << 30) && nics_.size() > 1) {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < nics_.size(); ++i) threads.emplace_back(reg, i);
    for (auto& t : threads) t.join();
  } else {
    for (size_t i = 0; i < nics_.size(); ++i) reg(i);
  }
  for (size_t i = 0; i < nics_.size(); ++i) {
    if (entry.mrs[i] == nullptr) {
      int err = errno;
      for (ibv_mr* mr : entry.mrs) {
        if (mr != nullptr) ibv_dereg_mr(mr);
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "ibv_reg_mr on ", nics_[i]->name(), ": ", std::strerror(err)));
    }
  }
  if (region.remote_accessible) {
    for (size_t i = 0; i < nics_.size(); ++i) {
      metadata::NicKey* k = published->add_keys();
      k->set_nic(nics_[i]->name());
      k->set_rkey(entry.mrs[i]->rkey);
    }
  }
  std::unique_lock<std::shared_mutex> lock(mr_mu_);
  mrs_[region.addr] = std::move(entry);
  return absl::OkStatus();
}

absl::Status RdmaTransport::UnregisterMemory(uintptr_t addr) {
  LocalMr entry;
  {
    std::unique_lock<std::shared_mutex> lock(mr_mu_);
    auto it = mrs_.find(addr);
    if (it == mrs_.end()) {
      return absl::NotFoundError("buffer not registered with RDMA");
    }
    entry = std::move(it->second);
    mrs_.erase(it);
  }
  // The engine has waited for its own requests on this buffer; a peer still
  // accessing it gets a remote access error, never stale memory.
  for (ibv_mr* mr : entry.mrs) ibv_dereg_mr(mr);
  return absl::OkStatus();
}

std::optional<uint32_t> RdmaTransport::LocalKey(const Slice* slice,
                                                int nic_index,
                                                std::vector<int>* tiers) {
  // The interval index: the candidate buffer is the last one starting at
  // or below the address, O(log n).
  std::shared_lock<std::shared_mutex> lock(mr_mu_);
  const uintptr_t a = reinterpret_cast<uintptr_t>(slice->local);
  auto it = mrs_.upper_bound(a);
  if (it == mrs_.begin()) return std::nullopt;
  --it;
  if (a + slice->length > it->first + it->second.length) return std::nullopt;
  if (tiers != nullptr) *tiers = it->second.tiers;
  return it->second.mrs[nic_index]->lkey;
}

void RdmaTransport::Submit(absl::Span<Slice* const> slices) {
  for (Slice* s : slices) Route(s);
}

void RdmaTransport::Route(Slice* slice) {
  if (stopping_.load()) {
    slice->Complete(absl::CancelledError("RDMA transport is shut down"));
    return;
  }
  const SegmentView* view = slice->target;
  const metadata::TransportEndpoint* ep_desc = view->FindTransport("rdma");
  const metadata::Buffer* buf = view->FindBuffer(slice->remote, slice->length);
  if (ep_desc == nullptr || buf == nullptr) {
    slice->Complete(absl::FailedPreconditionError(
        absl::StrCat("segment '", view->name(), "' has no RDMA key for 0x",
                     absl::Hex(slice->remote))));
    return;
  }
  std::vector<int> tiers;
  if (!LocalKey(slice, 0, &tiers).has_value()) {
    slice->Complete(absl::InvalidArgumentError(
        "local memory is not registered with the RDMA transport"));
    return;
  }
  if (absl::Now() >= slice->deadline) {
    slice->Complete(absl::DeadlineExceededError(
        "RDMA transfer did not complete before its deadline"));
    return;
  }
  // Pick the least loaded healthy rail (local NIC, remote NIC). The rail
  // that just failed this slice is avoided while another exists.
  const int64_t now = NowNs();
  const uint64_t rot = rotate_.fetch_add(1, std::memory_order_relaxed);
  const size_t n_local = nics_.size();
  const int n_remote = ep_desc->devices_size();
  last_remote_count_.store(static_cast<size_t>(n_remote),
                           std::memory_order_relaxed);
  for (int tries = 0; tries < 4; ++tries) {
    int best_nic = -1;
    int best_rail = -1;
    const metadata::NicKey* best_key = nullptr;
    uint64_t best_load = ~uint64_t{0};
    {
      std::lock_guard<std::mutex> lock(ep_mu_);
      for (int pass = 0; pass < 2 && best_nic < 0; ++pass) {
        for (size_t li = 0; li < n_local; ++li) {
          const size_t i = (li + rot) % n_local;
          Nic* nic = nics_[i].get();
          if (!nic->usable(now)) continue;
          for (int rj = 0; rj < n_remote; ++rj) {
            const int j = static_cast<int>((rj + rot + i) % n_remote);
            const std::string& rname = ep_desc->devices(j).name();
            const metadata::NicKey* key = FindKey(*buf, rname);
            if (key == nullptr) continue;
            EndpointKey rail{view->name(), static_cast<int>(i), rname};
            auto h = health_.find(rail);
            if (pass == 0 && h != health_.end() &&
                h->second.paused_until_ns > now) {
              continue;  // Paused; used only if nothing else is left.
            }
            // Rails this slice already failed on are avoided while
            // another exists.
            const int rail_id = static_cast<int>(i) * n_remote + j;
            if (pass == 0 && rail_id < 64 &&
                (slice->failed_rails >> rail_id) & 1) {
              continue;
            }
            uint64_t load = nic->inflight_bytes.load(std::memory_order_relaxed);
            if (const auto* e = endpoints_.Peek(rail)) {
              load += (*e)->inflight_bytes.load();
            }
            // Prefer NIC i <-> remote NIC i (the usual rail wiring) when
            // loads are equal.
            if (static_cast<size_t>(j) != i % static_cast<size_t>(n_remote)) {
              load += options_.rdma_slice_bytes;
            }
            // Topology: a NIC one tier further from the buffer is charged
            // four slices, so near NICs win at low load and all stripe
            // under load.
            load +=
                static_cast<uint64_t>(tiers[i]) * 4 * options_.rdma_slice_bytes;
            if (load < best_load) {
              best_load = load;
              best_nic = static_cast<int>(i);
              best_key = key;
              best_rail = rail_id;
            }
          }
        }
      }
    }
    slice->rail = best_rail;
    if (best_nic < 0) {
      slice->Complete(absl::UnavailableError(
          absl::StrCat("no usable RDMA rail to segment '", view->name(), "'")));
      return;
    }
    std::shared_ptr<Endpoint> ep;
    bool created = false;
    absl::Status backoff_status;
    std::vector<std::shared_ptr<Endpoint>> evicted;
    {
      std::lock_guard<std::mutex> lock(ep_mu_);
      EndpointKey key{view->name(), best_nic, best_key->nic()};
      std::shared_ptr<Endpoint>* slot = endpoints_.Find(key);
      // A peer that restarted has new QPs and keys: replace its endpoint.
      if (slot != nullptr && (*slot)->peer_incarnation == view->incarnation()) {
        ep = *slot;
      } else if (auto b = backoff_.find(view->name());
                 b != backoff_.end() && b->second.retry_after_ns > now) {
        backoff_status = absl::UnavailableError(absl::StrCat(
            "RDMA peer '", view->name(), "' unreachable (retrying in ",
            (b->second.retry_after_ns - now) / 1000000,
            " ms): ", b->second.last_error.message()));
      } else {
        ep = std::make_shared<Endpoint>(nics_[best_nic].get(), best_nic,
                                        view->name(), best_key->nic());
        ep->peer_incarnation = view->incarnation();
        ep->peer_rpc = view->descriptor().rpc_address();
        endpoints_.Insert(key, ep, &evicted);
        created = true;
      }
    }
    for (auto& old : evicted) Retire(old);
    if (ep == nullptr) {
      slice->Complete(backoff_status);  // Fail fast while backing off.
      return;
    }
    bool connected;
    {
      std::lock_guard<std::mutex> lock(ep->mu);
      // An endpoint that failed after we looked it up takes no more work:
      // pick again.
      if (ep->state == Endpoint::State::kFailed) {
        std::lock_guard<std::mutex> elock(ep_mu_);
        EndpointKey key{view->name(), best_nic, best_key->nic()};
        const auto* cur = endpoints_.Peek(key);
        if (cur != nullptr && *cur == ep) endpoints_.Erase(key);
        continue;
      }
      nics_[best_nic]->inflight_bytes.fetch_add(slice->length);
      ep->inflight_bytes.fetch_add(slice->length);
      ep->waiting.emplace_back(slice, best_key->rkey());
      connected = ep->state == Endpoint::State::kConnected;
    }
    if (created) {
      std::lock_guard<std::mutex> lock(hs_mu_);
      hs_queue_.push_back(ep);
      hs_cv_.notify_one();
    } else if (connected) {
      Wake(workers_[best_nic].get(), ep);
    }
    return;
  }
  slice->Complete(absl::UnavailableError(absl::StrCat(
      "RDMA endpoints to segment '", view->name(), "' keep failing")));
}

void RdmaTransport::Retire(const std::shared_ptr<Endpoint>& ep) {
  // Evicted endpoints are idle (the store never evicts one with work in
  // flight): unhook it from its worker, and its QP goes with the last
  // reference.
  uint32_t qpn = 0;
  {
    std::lock_guard<std::mutex> lock(ep->mu);
    ep->state = Endpoint::State::kFailed;
    if (ep->qp != nullptr) qpn = ep->qp->qp_num;
  }
  if (qpn != 0) {
    Worker* w = workers_[ep->nic_index()].get();
    std::lock_guard<std::mutex> lock(w->mu);
    auto it = w->by_qpn.find(qpn);
    if (it != w->by_qpn.end() && it->second == ep) w->by_qpn.erase(it);
  }
  evictions_.fetch_add(1);
}

void RdmaTransport::Wake(Worker* w, const std::shared_ptr<Endpoint>& ep) {
  {
    std::lock_guard<std::mutex> lock(w->mu);
    w->ready.push_back(ep);
  }
  uint64_t one = 1;
  ssize_t n = ::write(w->wake_fd, &one, sizeof(one));
  (void)n;
}

void RdmaTransport::Retry(Slice* slice, const absl::Status& status,
                          const EndpointKey& rail) {
  {
    std::lock_guard<std::mutex> lock(ep_mu_);
    RailHealth& h = health_[rail];
    if (++h.errors >= options_.rdma_pause_after_errors) {
      h.errors = 0;
      // Paused, then probed again; a rail that keeps failing (e.g. a NIC
      // pair with no route between them) is paused exponentially longer,
      // up to 64x the base pause.
      const int64_t pause =
          absl::ToInt64Nanoseconds(options_.rdma_pause_duration)
          << std::min<uint32_t>(h.pauses, 6);
      ++h.pauses;
      h.paused_until_ns = NowNs() + pause;
    }
  }
  ++slice->attempts;
  if (slice->rail >= 0 && slice->rail < 64) {
    slice->failed_rails |= uint64_t{1} << slice->rail;
  }
  // Enough attempts to try every rail once, at least rdma_max_attempts.
  const uint32_t rails = static_cast<uint32_t>(
      nics_.size() * std::max<size_t>(1, last_remote_count_.load()));
  if (stopping_.load() ||
      slice->attempts >= std::max(options_.rdma_max_attempts, rails) ||
      absl::Now() >= slice->deadline) {
    slice->Complete(status);
    return;
  }
  Route(slice);
}

void RdmaTransport::HandshakeLoop() {
  while (true) {
    std::shared_ptr<Endpoint> ep;
    {
      std::unique_lock<std::mutex> lock(hs_mu_);
      hs_cv_.wait(lock, [&] { return stopping_.load() || !hs_queue_.empty(); });
      if (stopping_.load()) return;
      ep = hs_queue_.front();
      hs_queue_.pop_front();
    }
    Handshake(ep);
  }
}

void RdmaTransport::Handshake(const std::shared_ptr<Endpoint>& ep) {
  uint32_t max_inline = 0;
  auto qp = CreateQp(ep->nic(), &max_inline);
  if (!qp.ok()) {
    FailEndpoint(ep, qp.status());
    return;
  }
  ConnectRequest req;
  req.set_initiator_segment(env_.local_segment);
  req.set_initiator_incarnation(incarnation_);
  DescribeQp(*qp, ep->nic(), req.mutable_initiator());
  req.set_target_nic(ep->remote_nic());
  auto reply_bytes = env_.peer_client->Exchange(
      ep->peer_rpc, "rdma", env_.local_segment, req.SerializeAsString());
  ConnectReply reply;
  absl::Status s = reply_bytes.status();
  if (s.ok() && !reply.ParseFromString(*reply_bytes)) {
    s = absl::DataLossError("malformed RDMA connect reply");
  }
  if (s.ok()) s = ConnectQp(*qp, ep->nic(), reply.target());
  if (!s.ok()) {
    ibv_destroy_qp(*qp);
    FailEndpoint(
        ep, absl::Status(
                s.code(),
                absl::StrCat("RDMA handshake with '", ep->peer_segment(), "' (",
                             ep->remote_nic(), "): ", s.message())));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(ep_mu_);
    backoff_.erase(ep->peer_segment());
  }
  Worker* w = workers_[ep->nic_index()].get();
  {
    std::lock_guard<std::mutex> lock(w->mu);
    w->by_qpn[(*qp)->qp_num] = ep;
  }
  {
    std::lock_guard<std::mutex> lock(ep->mu);
    ep->qp = *qp;
    ep->max_inline = max_inline;
    ep->state = Endpoint::State::kConnected;
  }
  Wake(w, ep);
}

void RdmaTransport::FailEndpoint(const std::shared_ptr<Endpoint>& ep,
                                 const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(ep_mu_);
    EndpointKey key{ep->peer_segment(), ep->nic_index(), ep->remote_nic()};
    const auto* cur = endpoints_.Peek(key);
    if (cur != nullptr && *cur == ep) endpoints_.Erase(key);
  }
  std::deque<std::pair<Slice*, uint32_t>> waiting;
  {
    std::lock_guard<std::mutex> lock(ep->mu);
    ep->state = Endpoint::State::kFailed;
    waiting.swap(ep->waiting);
  }
  for (auto& [slice, rkey] : waiting) {
    nics_[ep->nic_index()]->inflight_bytes.fetch_sub(slice->length);
    ep->inflight_bytes.fetch_sub(slice->length);
    Retry(slice, status,
          EndpointKey{ep->peer_segment(), ep->nic_index(), ep->remote_nic()});
  }
}

absl::StatusOr<std::string> RdmaTransport::OnConnect(
    const std::string& from, const std::string& payload) {
  ConnectRequest req;
  if (!req.ParseFromString(payload) || req.initiator_segment() != from) {
    return absl::InvalidArgumentError("malformed RDMA connect request");
  }
  int index = -1;
  for (size_t i = 0; i < nics_.size(); ++i) {
    if (nics_[i]->name() == req.target_nic()) index = static_cast<int>(i);
  }
  if (index < 0) {
    return absl::NotFoundError(
        absl::StrCat("no RDMA NIC named '", req.target_nic(), "'"));
  }
  Nic* nic = nics_[index].get();
  uint32_t max_inline = 0;
  auto qp = CreateQp(nic, &max_inline);
  if (!qp.ok()) return qp.status();
  if (absl::Status s = ConnectQp(*qp, nic, req.initiator()); !s.ok()) {
    ibv_destroy_qp(*qp);
    return s;
  }
  auto ep = std::make_shared<Endpoint>(nic, index, from, req.initiator().nic());
  ep->qp = *qp;
  ep->peer_incarnation = req.initiator_incarnation();
  ep->state = Endpoint::State::kConnected;
  {
    // A reconnect (or a restarted peer) replaces the old passive QP.
    std::lock_guard<std::mutex> lock(ep_mu_);
    passive_[EndpointKey{from + "/" + req.initiator().nic(), index,
                         req.target_nic()}] = ep;
  }
  ConnectReply reply;
  DescribeQp(*qp, nic, reply.mutable_target());
  reply.set_target_incarnation(incarnation_);
  return reply.SerializeAsString();
}

bool RdmaTransport::PostWaiting(const std::shared_ptr<Endpoint>& ep) {
  std::lock_guard<std::mutex> lock(ep->mu);
  if (ep->state != Endpoint::State::kConnected) return false;
  bool posted_any = false;
  const int nic_index = ep->nic_index();
  while (!ep->waiting.empty() && ep->posted.size() < kMaxOutstanding) {
    ibv_send_wr wrs[kMaxChain];
    ibv_sge sges[kMaxChain];
    int n = 0;
    while (n < kMaxChain && !ep->waiting.empty() &&
           ep->posted.size() + static_cast<size_t>(n) < kMaxOutstanding) {
      auto [slice, rkey] = ep->waiting.front();
      const std::optional<uint32_t> lkey = LocalKey(slice, nic_index);
      ep->waiting.pop_front();
      if (!lkey.has_value()) {
        // Unregistered under us: fail it rather than post a stale key.
        nics_[nic_index]->inflight_bytes.fetch_sub(slice->length);
        ep->inflight_bytes.fetch_sub(slice->length);
        slice->Complete(absl::FailedPreconditionError(
            "local memory was unregistered while the transfer waited"));
        continue;
      }
      sges[n] = {reinterpret_cast<uint64_t>(slice->local),
                 static_cast<uint32_t>(slice->length), *lkey};
      ibv_send_wr& wr = wrs[n];
      wr = {};
      wr.wr_id = ep->next_seq++;
      wr.sg_list = &sges[n];
      wr.num_sge = 1;
      wr.opcode =
          slice->op == OpCode::kWrite ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
      wr.wr.rdma.remote_addr = slice->remote;
      wr.wr.rdma.rkey = rkey;
      if (slice->op == OpCode::kWrite && slice->length <= ep->max_inline) {
        wr.send_flags |= IBV_SEND_INLINE;
      }
      if (++ep->since_signal >= kSignalEvery) {
        wr.send_flags |= IBV_SEND_SIGNALED;
        ep->since_signal = 0;
      }
      if (n > 0) wrs[n - 1].next = &wr;
      ep->posted.push_back({slice, wr.wr_id, rkey});
      ++n;
    }
    if (n == 0) break;
    // The chain's last WR is always signaled, so every posted slice
    // completes without waiting for later traffic.
    if (!(wrs[n - 1].send_flags & IBV_SEND_SIGNALED)) {
      wrs[n - 1].send_flags |= IBV_SEND_SIGNALED;
      ep->since_signal = 0;
    }
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(ep->qp, wrs, &bad)) {
      // Nothing from `bad` on was posted: take those back for failover.
      size_t unposted = 0;
      for (ibv_send_wr* w = bad; w != nullptr; w = w->next) ++unposted;
      std::vector<Slice*> back;
      for (size_t k = 0; k < unposted; ++k) {
        back.push_back(ep->posted.back().slice);
        ep->posted.pop_back();
      }
      ep->state = Endpoint::State::kFailed;
      for (Slice* s : back) ep->waiting.emplace_front(s, 0);
      (void)rc;
      return posted_any;
    }
    posted_any = true;
  }
  return posted_any;
}

void RdmaTransport::HandleCompletion(Worker* w, const ibv_wc& wc) {
  std::shared_ptr<Endpoint> ep;
  {
    std::lock_guard<std::mutex> lock(w->mu);
    auto it = w->by_qpn.find(wc.qp_num);
    if (it == w->by_qpn.end()) return;
    ep = it->second;
  }
  std::vector<std::pair<Slice*, absl::Status>> done;
  bool failed = false;
  {
    std::lock_guard<std::mutex> lock(ep->mu);
    // In order on an RC QP: everything posted before this WR is complete.
    while (!ep->posted.empty() && ep->posted.front().seq <= wc.wr_id) {
      PostedSlice p = ep->posted.front();
      ep->posted.pop_front();
      if (p.seq < wc.wr_id || wc.status == IBV_WC_SUCCESS) {
        done.emplace_back(p.slice, absl::OkStatus());
      } else {
        done.emplace_back(p.slice, CompletionError(*p.slice, *ep, wc.status));
      }
    }
    if (wc.status != IBV_WC_SUCCESS) {
      failed = ep->state != Endpoint::State::kFailed;
      ep->state = Endpoint::State::kFailed;
    }
  }
  if (failed) {
    // Unlink the broken endpoint before retrying its slices, so that they
    // are routed to a fresh endpoint or another rail.
    std::lock_guard<std::mutex> lock(ep_mu_);
    EndpointKey key{ep->peer_segment(), ep->nic_index(), ep->remote_nic()};
    const auto* cur = endpoints_.Peek(key);
    if (cur != nullptr && *cur == ep) endpoints_.Erase(key);
  }
  bool any_success = false;
  for (auto& d : done) any_success |= d.second.ok();
  if (any_success) {
    // The rail works: forget its error history (one lock per signaled CQE,
    // not per slice).
    std::lock_guard<std::mutex> lock(ep_mu_);
    auto h = health_.find(
        EndpointKey{ep->peer_segment(), ep->nic_index(), ep->remote_nic()});
    if (h != health_.end()) h->second = RailHealth{};
  }
  for (auto& [slice, status] : done) {
    nics_[ep->nic_index()]->inflight_bytes.fetch_sub(slice->length);
    ep->inflight_bytes.fetch_sub(slice->length);
    if (status.ok()) {
      slice->Complete(status);
    } else {
      Retry(slice, status,
            EndpointKey{ep->peer_segment(), ep->nic_index(), ep->remote_nic()});
    }
  }
  if (failed) {
    // The QP is in ERR: route new and waiting slices elsewhere; the QP is
    // destroyed when its flushed WRs are drained and the last ref goes.
    FailEndpoint(ep, absl::UnavailableError("RDMA endpoint failed"));
  }
  bool drained;
  {
    std::lock_guard<std::mutex> lock(ep->mu);
    drained = ep->state == Endpoint::State::kFailed && ep->posted.empty();
  }
  if (drained) {
    std::lock_guard<std::mutex> lock(w->mu);
    w->by_qpn.erase(wc.qp_num);
  }
}

void RdmaTransport::WorkerLoop(Worker* w) {
  Nic* nic = w->nic;
  if (!options_.rdma_worker_cpus.empty()) {
    // Pin to the configured core (e.g. one near the NIC's NUMA node).
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(
        options_.rdma_worker_cpus[w->index % options_.rdma_worker_cpus.size()],
        &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  int spins = 0;
  ibv_wc wcs[64];
  while (!stopping_.load()) {
    std::deque<std::shared_ptr<Endpoint>> ready;
    {
      std::lock_guard<std::mutex> lock(w->mu);
      ready.swap(w->ready);
    }
    bool progress = false;
    for (auto& ep : ready) {
      progress |= PostWaiting(ep);
      bool post_failed;
      {
        std::lock_guard<std::mutex> lock(ep->mu);
        post_failed =
            ep->state == Endpoint::State::kFailed && !ep->waiting.empty();
      }
      // ibv_post_send refused: route its slices over other rails.
      if (post_failed) {
        FailEndpoint(ep, absl::UnavailableError("ibv_post_send failed"));
      }
    }
    int n = ibv_poll_cq(nic->cq(), 64, wcs);
    for (int i = 0; i < n; ++i) HandleCompletion(w, wcs[i]);
    if (n > 0) {
      // Completions free send-queue room: post what waits.
      std::vector<std::shared_ptr<Endpoint>> eps;
      {
        std::lock_guard<std::mutex> lock(w->mu);
        for (auto& [qpn, ep] : w->by_qpn) eps.push_back(ep);
      }
      for (auto& ep : eps) progress |= PostWaiting(ep);
    }
    if (n > 0 || progress) {
      spins = 0;
      continue;
    }
    if (++spins < options_.rdma_spin_polls) {
      std::this_thread::yield();
      continue;
    }
    spins = 0;
    // Sleep until a completion, a wake-up or a port event.
    ibv_req_notify_cq(nic->cq(), 0);
    n = ibv_poll_cq(nic->cq(), 64, wcs);
    for (int i = 0; i < n; ++i) HandleCompletion(w, wcs[i]);
    if (n > 0) continue;
    pollfd fds[3] = {{nic->channel()->fd, POLLIN, 0},
                     {w->wake_fd, POLLIN, 0},
                     {nic->context()->async_fd, POLLIN, 0}};
    if (::poll(fds, 3, 100) <= 0) continue;
    if (fds[0].revents & POLLIN) {
      ibv_cq* cq;
      void* ctx;
      if (ibv_get_cq_event(nic->channel(), &cq, &ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
      }
    }
    if (fds[1].revents & POLLIN) {
      uint64_t v;
      ssize_t r = ::read(w->wake_fd, &v, sizeof(v));
      (void)r;
    }
    if (fds[2].revents & POLLIN) {
      ibv_async_event ev;
      if (ibv_get_async_event(nic->context(), &ev) == 0) {
        if (ev.event_type == IBV_EVENT_PORT_ERR) nic->set_port_active(false);
        if (ev.event_type == IBV_EVENT_PORT_ACTIVE) nic->set_port_active(true);
        ibv_ack_async_event(&ev);
      }
    }
  }
}

void RdmaTransport::Shutdown() {
  if (stopping_.exchange(true)) return;
  hs_cv_.notify_all();
  if (handshake_thread_.joinable()) handshake_thread_.join();
  for (auto& w : workers_) {
    uint64_t one = 1;
    ssize_t n = ::write(w->wake_fd, &one, sizeof(one));
    (void)n;
    if (w->thread.joinable()) w->thread.join();
  }
  // Fail whatever is still queued or in flight.
  std::vector<std::shared_ptr<Endpoint>> eps;
  {
    std::lock_guard<std::mutex> lock(ep_mu_);
    endpoints_.ForEach(
        [&](const EndpointKey&, const std::shared_ptr<Endpoint>& ep) {
          eps.push_back(ep);
        });
    endpoints_.Clear();
    passive_.clear();
  }
  {
    std::lock_guard<std::mutex> lock(hs_mu_);
    for (auto& ep : hs_queue_) eps.push_back(ep);
    hs_queue_.clear();
  }
  for (auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->mu);
    for (auto& [q, ep] : w->by_qpn) eps.push_back(ep);
    w->by_qpn.clear();
    w->ready.clear();
  }
  std::sort(eps.begin(), eps.end());
  eps.erase(std::unique(eps.begin(), eps.end()), eps.end());
  for (auto& ep : eps) {
    std::deque<std::pair<Slice*, uint32_t>> waiting;
    std::deque<PostedSlice> posted;
    {
      std::lock_guard<std::mutex> lock(ep->mu);
      waiting.swap(ep->waiting);
      posted.swap(ep->posted);
      ep->state = Endpoint::State::kFailed;
      if (ep->qp != nullptr) {
        ibv_destroy_qp(ep->qp);
        ep->qp = nullptr;
      }
    }
    absl::Status cancelled = absl::CancelledError("RDMA transport shut down");
    for (auto& [s, rkey] : waiting) s->Complete(cancelled);
    for (auto& p : posted) p.slice->Complete(cancelled);
  }
  eps.clear();
  {
    std::unique_lock<std::shared_mutex> lock(mr_mu_);
    for (auto& [addr, entry] : mrs_) {
      for (ibv_mr* mr : entry.mrs) ibv_dereg_mr(mr);
    }
    mrs_.clear();
  }
  for (auto& w : workers_) {
    if (w->wake_fd >= 0) ::close(w->wake_fd);
  }
  workers_.clear();
  nics_.clear();
}

}  // namespace ferry::rdma
