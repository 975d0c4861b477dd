#include "transport/tcp/tcp_transport.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/secure_random.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "transport/tcp/wire.h"

namespace ferry::tcp {
namespace {

absl::Status ValidateOptions(const TransportOptions& o) {
  const TcpOptions& t = o.tcp;
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("tcp.", what));
  };
  if (t.connections_per_peer < 1 || t.connections_per_peer > 64) {
    return bad("connections_per_peer must be in 1..64");
  }
  if (t.max_slice_bytes == 0 || t.max_slice_bytes > kMaxFrameLength) {
    return bad("max_slice_bytes must be in 1..64 MiB");
  }
  if (t.io_threads < 1 || t.io_threads > 16) {
    return bad("io_threads must be in 1..16");
  }
  if (t.staging_buffers < 1 || t.staging_buffers > 1024) {
    return bad("staging_buffers must be in 1..1024");
  }
  if (t.max_connections < 1 || t.max_connections_per_address < 1) {
    return bad("max_connections and max_connections_per_address must be >= 1");
  }
  if (t.max_peers < 1) return bad("max_peers must be >= 1");
  // Bounded: a peer's lease on a buffer lasts up to 2 x frame_timeout,
  // and UnregisterMemory waits that long (an infinite one never returned).
  const absl::Duration kMaxTimeout = absl::Hours(1);
  for (absl::Duration d :
       {t.handshake_timeout, t.idle_timeout, t.frame_timeout}) {
    if (d <= absl::ZeroDuration() || d > kMaxTimeout) {
      return bad(
          "handshake_timeout, idle_timeout and frame_timeout must be in "
          "(0, 1h]");
    }
  }
  if (t.backoff_min <= absl::ZeroDuration() || t.backoff_max < t.backoff_min) {
    return bad("backoff_min must be > 0 and backoff_max >= backoff_min");
  }
  if (o.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("connect_timeout must be > 0");
  }
  return absl::OkStatus();
}

}  // namespace

TcpTransport::TcpTransport(const TransportOptions& options)
    : options_(options),
      server_(&registry_, options_.tcp),
      client_(options_.tcp, options_.connect_timeout),
      gpu_staging_(&staging_path_, "TCP", "tcp.staging_buffers",
                   options_.tcp.staging_buffers, options_.tcp.max_slice_bytes) {
}

TcpTransport::~TcpTransport() { Shutdown(); }

absl::Status TcpTransport::Install(const TransportEnv& env,
                                   descriptor::TransportEndpoint* endpoint) {
  FERRY_RETURN_IF_ERROR(ValidateOptions(options_));
  // UnregisterMemory's bounded wait, like the frame timeout it covers.
  Clock* const clock = ClockOrReal(env.clock);
  registry_.SetClock(clock);
  gpu_staging_.SetClock(clock);
  if (absl::Status s = client_.Start(clock, env.auth_token, env.listen_host);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("TCP transport: ", s.message()));
  }
  if (absl::Status s = server_.Start(env.listen_host, options_.tcp.port,
                                     env.incarnation, clock, env.auth_token);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("TCP transport: ", s.message()));
  }
  // A numeric address: peers never resolve names.
  endpoint->set_address(env.advertise_host.empty()
                            ? server_.address()
                            : JoinHostPort(env.advertise_host, server_.port()));
  return absl::OkStatus();
}

absl::StatusOr<MemoryHandle> TcpTransport::RegisterMemory(
    const MemoryRegion& region, descriptor::Buffer* published) {
  // GPU memory is staged through pinned host buffers on both sides (the
  // socket calls cannot touch it); the handle tells Submit which device.
  MemoryHandle local_handle = nullptr;
  if (region.cuda_device >= 0) {
    FERRY_ASSIGN_OR_RETURN(local_handle,
                           gpu_staging_.PrepareHandle(region.cuda_device));
  }
  if (!region.remote_accessible) {
    FERRY_RETURN_IF_ERROR(registry_.Add(region));
    return local_handle;  // Only the initiator side uses it; no key.
  }
  // A fresh key per registration: a peer holding the key of a buffer that
  // was unregistered cannot reach whatever is registered there next.
  auto key = std::make_unique<BufferKey>();
  key->value = SecureRandomNonZero64();
  const BufferKey* handle = key.get();
  {
    MutexLock lock(&keys_mu_);
    // Claimed before the buffer is servable, so that no frame ever sees
    // it without its key.
    if (!keys_.emplace(region.addr, std::move(key)).second) {
      return absl::AlreadyExistsError(absl::StrCat(
          "a buffer at 0x", absl::Hex(region.addr), " is already registered"));
    }
  }
  if (absl::Status s = registry_.Add(region, {handle}); !s.ok()) {
    MutexLock lock(&keys_mu_);
    keys_.erase(region.addr);
    return s;
  }
  if (published != nullptr) published->set_tcp_key(handle->value);
  return local_handle;  // The target side looks buffers up per request.
}

absl::Status TcpTransport::UnregisterMemory(uintptr_t addr) {
  // A peer's access holds its lease at most 2 x frame_timeout (then the
  // server closes that connection; tcp_transport.h), so this wait is
  // enough: a buffer is never left half-unregistered and still served.
  absl::Status s =
      registry_.Remove(addr, 2 * options_.tcp.frame_timeout + absl::Seconds(1));
  if (s.ok()) {
    // No lease, hence no session, can see the key any more.
    MutexLock lock(&keys_mu_);
    keys_.erase(addr);
  }
  return s;
}

void TcpTransport::Submit(absl::Span<Slice* const> slices) {
  // Host memory goes to the sockets as it is, in runs (the common case is
  // one run of the whole span); GPU memory through staging.
  size_t run = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    const int gpu = GpuStaging::DeviceOf(slices[i]->local_handle);
    if (gpu < 0) continue;
    if (i > run) client_.Submit(slices.subspan(run, i - run));
    run = i + 1;
    gpu_staging_.Submit(slices[i], gpu);
  }
  if (run < slices.size()) client_.Submit(slices.subspan(run));
}

void TcpTransport::ClosePeer(const SegmentView& segment) {
  if (const auto* ep = segment.FindTransport("tcp"); ep != nullptr) {
    client_.ClosePeer(ep->address());
  }
}

TransportStats TcpTransport::Stats() const {
  TransportStats st;
  st.transport = "tcp";
  NicStats& all = st.nics.emplace_back();
  all.name = "tcp";
  all.port_active = true;
  client_.AddStats(&st);
  const TcpServer::Counters c = server_.counters();
  st.endpoints += c.open;
  st.connects_accepted = c.accepted;
  st.refused_connections = c.refused;
  st.timed_out_connections = c.timeouts;
  st.bad_frames = c.bad_frames;
  st.denied_frames = c.denied;
  st.threads += server_.threads();
  gpu_staging_.AddStats(&st);
  return st;
}

void TcpTransport::Shutdown() {
  // Staging first: its copy thread hands slices to the client, which must
  // not take any once it is shutting down. Stop cancels what waits for a
  // buffer; the client then cancels what is on the wire.
  gpu_staging_.Stop();
  client_.Shutdown();
  server_.Stop();
}

}  // namespace ferry::tcp
