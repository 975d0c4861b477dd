// EngineImpl's lifecycle: Init, step by step, and Shutdown, which undoes
// it. Also what the options mean for a run: their validation, and the
// host this engine advertises.
#include <grpc/grpc.h>

#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/host_info.h"
#include "common/identity.h"
#include "common/log.h"
#include "common/socket_util.h"
#include "common/status_macros.h"
#include "engine/engine_impl.h"
#include "metadata/address/metadata_address.h"
#include "metadata/auth.h"
#include "metadata/p2p_store.h"
#include "metadata/tls.h"
#include "metadata/validation.h"
#include "transport/registry/registry.h"

namespace ferry {

struct EngineImpl::Startup {
  TransportOptions topts;
  metadata::MetadataAddress md_address;
  bool p2p = false;
  bool embedded = false;
  std::shared_ptr<const metadata::Tls> tls;
  std::string rpc_address;
  std::string segment_name;
  std::string metadata_addr;  // How the store describes itself.
};

namespace {

// Distinct per engine in a process (until 65,536 engines), so that one
// engine never accepts another's segment handles.
uint16_t NextHandleTag() {
  static std::atomic<uint16_t> next{static_cast<uint16_t>(
      absl::Uniform<uint32_t>(absl::BitGen(), 1, 0xffff))};
  uint16_t tag = next.fetch_add(1);
  if (tag == 0) tag = next.fetch_add(1);
  return tag;
}

// Names, addresses, the metadata service and who may use it.
absl::Status ValidateAddressing(const EngineOptions& o) {
  // In P2PHANDSHAKE mode the name is the engine's RPC address, chosen at
  // Init; a name given is only a hint (host:port sets nothing here).
  const bool p2p = o.metadata_endpoint == "P2PHANDSHAKE";
  if (absl::Status s = descriptor::ValidateSegmentName(o.local_segment_name);
      !s.ok() && !(p2p && o.local_segment_name.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_segment_name: ", s.message()));
  }
  for (const auto& [field, host] : {std::pair<const char*, const std::string&>{
                                        "listen_host", o.listen_host},
                                    {"advertise_host", o.advertise_host}}) {
    if (host.empty()) continue;
    if (auto hp = ParseHostPort(JoinHostPort(host, 0)); !hp.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", hp.status().message()));
    }
  }
  if (IsWildcardHost(o.advertise_host) && !o.advertise_host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("advertise_host '", o.advertise_host,
                     "' is a wildcard; peers need an address they can reach "
                     "(leave it empty to have one chosen)"));
  }
  if (auto a = metadata::ParseMetadataAddress(o.metadata_endpoint); !a.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata_endpoint: ", a.status().message()));
  }
  FERRY_RETURN_IF_ERROR(metadata::ValidateAuthToken(o.auth_token));
  // Ferry's metadata services (embedded or a metadata_server) refuse such
  // segments from callers with neither; etcd, P2P: not Ferry's rule.
  if (o.metadata_lease_ttl == absl::ZeroDuration() && o.auth_token.empty() &&
      o.tls_cert_file.empty() && !p2p &&
      !absl::StartsWith(o.metadata_endpoint, "etcd://")) {
    return absl::InvalidArgumentError(
        "metadata_lease_ttl 0 (a segment with no lease, kept until removed) "
        "needs the cluster's auth_token or mutual TLS: a Ferry metadata "
        "service with neither refuses such segments, since anyone could "
        "hold a name for ever");
  }
  if (p2p && !o.metadata_namespace.empty()) {
    return absl::InvalidArgumentError(
        "metadata_namespace has no meaning in P2PHANDSHAKE mode (segments "
        "are named by their engines' addresses)");
  }
  if (!o.metadata_namespace.empty()) {
    if (absl::Status s = descriptor::ValidateSegmentName(o.metadata_namespace);
        !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata_namespace: ", s.message()));
    }
  }
  return absl::OkStatus();
}

// Transports, logging, timeouts and sizes.
absl::Status ValidateLimits(const EngineOptions& o) {
  if (o.transports.empty()) {
    return absl::InvalidArgumentError("no transport requested");
  }
  if (absl::Status s = log::ValidateLevels(o.log_level); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("log_level: ", s.message()));
  }
  absl::flat_hash_set<std::string> seen;
  for (const std::string& t : o.transports) {
    if (!seen.insert(t).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("transport '", t, "' listed twice"));
    }
  }
  if (o.rpc_timeout <= absl::ZeroDuration() ||
      o.transfer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeouts must be positive");
  }
  if (o.max_batch_capacity == 0) {
    return absl::InvalidArgumentError("max_batch_capacity must be positive");
  }
  if (o.metadata_lease_ttl != absl::ZeroDuration() &&
      (o.metadata_lease_ttl < absl::Milliseconds(300) ||
       o.metadata_lease_ttl > absl::Hours(1))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata_lease_ttl ", absl::FormatDuration(o.metadata_lease_ttl),
        " is outside 300ms .. 1h (or 0: no lease)"));
  }
  if (o.segment_name_wait > absl::Hours(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "segment_name_wait ", absl::FormatDuration(o.segment_name_wait),
        " is more than 1h (negative: the lease TTL plus 1s)"));
  }
  if (o.max_queued_notifications == 0 || o.max_queued_notification_bytes == 0 ||
      o.max_queued_notifications_per_sender == 0 ||
      o.max_queued_notification_bytes_per_sender == 0) {
    return absl::InvalidArgumentError(
        "max_queued_notifications, max_queued_notification_bytes, "
        "max_queued_notifications_per_sender and "
        "max_queued_notification_bytes_per_sender must be positive");
  }
  return absl::OkStatus();
}

}  // namespace

EngineImpl::~EngineImpl() { Shutdown(); }

absl::Status EngineImpl::Init(const EngineOptions& requested) {
  if (initialized_) {
    return absl::AlreadyExistsError("engine is already initialized");
  }
  // gRPC 1.51 cannot shut down once one of its own threads failed to start
  // (under a thread or pids limit its timer manager then waits for ever
  // for a thread that never ran): it stays initialised for the life of the
  // process, so that destroying an engine never starts gRPC's shutdown.
  static const bool grpc_kept = [] {
    grpc_init();
    return true;
  }();
  (void)grpc_kept;
  EngineOptions options = requested;
  FERRY_RETURN_IF_ERROR(CompleteOptions(&options));
  Startup up;
  FERRY_RETURN_IF_ERROR(BeginRun(options, &up));
  if (absl::Status s = StartRpcServer(options, &up); !s.ok()) {
    registrations_.StopCache();  // Gives its watcher back.
    return s;
  }
  absl::Status s = NameRun(options, &up);
  if (s.ok()) s = ConnectMetadata(options, &up);
  if (s.ok()) StartPeerServices(options, up);
  descriptor::SegmentDescriptor desc;
  if (s.ok()) s = InstallTransports(options, up, &desc);
  if (s.ok()) s = PublishSegment(options, up, desc);
  if (!s.ok()) {
    ReleaseAll();
    return s;
  }
  initialized_ = true;
  LogStarted(options, up);
  return absl::OkStatus();
}

absl::Status EngineImpl::CompleteOptions(EngineOptions* options) const {
  if (options->auth_token.empty()) {
    // Callers that cannot pass a token (ferry.mooncake, Mooncake-style
    // code) get the cluster's from the environment.
    FERRY_ASSIGN_OR_RETURN(options->auth_token, metadata::AuthTokenFromEnv());
  }
  FERRY_RETURN_IF_ERROR(ValidateAddressing(*options));
  FERRY_RETURN_IF_ERROR(ValidateLimits(*options));
  if (!options->log_level.empty()) {
    FERRY_RETURN_IF_ERROR(log::SetLevels(options->log_level));
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::BeginRun(const EngineOptions& options, Startup* up) {
  options_ = options;
  clock_ = ClockOrReal(options.clock);
  registrations_.Configure(options.mr_cache_bytes, clock_);
  up->topts.tcp = options.tcp;
  up->topts.rdma = options.rdma;
  up->topts.shm = options.shm;
  up->topts.connect_timeout = options.rpc_timeout;
  FERRY_RETURN_IF_ERROR(ChooseAdvertisedHost(options, up->topts));
  FERRY_RETURN_IF_ERROR(registrations_.StartCache());
  absl::BitGen gen;
  incarnation_ = absl::Uniform<uint64_t>(gen, 1, ~uint64_t{0});
  return absl::OkStatus();
}

absl::Status EngineImpl::ChooseAdvertisedHost(const EngineOptions& o,
                                              const TransportOptions& topts) {
  // An address the user gave: resolved once, here, and never a wildcard.
  auto take = [this](const char* field, const std::string& host,
                     const char* reason) {
    auto r = ResolveHost(host);
    if (r.ok() && IsWildcardHost(*r)) {
      r = absl::InvalidArgumentError(
          absl::StrCat("'", host, "' is a wildcard address"));
    }
    if (!r.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", r.status().message()));
    }
    advertised_host_ = *r;
    advertised_reason_ = reason;
    return absl::OkStatus();
  };
  if (!o.advertise_host.empty()) {
    return take("advertise_host", o.advertise_host,
                "EngineOptions::advertise_host");
  }
  if (!IsWildcardHost(o.listen_host)) {
    return take("listen_host", o.listen_host, "the address listen_host binds");
  }
  for (const std::string& t : o.transports) {
    std::string hint = TransportAdvertiseHint(t, topts);
    if (!hint.empty()) {
      advertised_host_ = std::move(hint);
      advertised_reason_ = absl::StrCat(
          "the address of the interface behind the first ", t, " device");
      return absl::OkStatus();
    }
  }
  if (auto primary = PrimaryHostAddress(); primary.ok()) {
    advertised_host_ = *primary;
    advertised_reason_ = "the host's primary address";
  } else {
    advertised_host_ = "127.0.0.1";
    advertised_reason_ =
        "loopback: the host has no other address (only peers on this host "
        "can reach it)";
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::StartRpcServer(const EngineOptions& options,
                                        Startup* up) {
  auto md_address = metadata::ParseMetadataAddress(options.metadata_endpoint);
  if (!md_address.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata_endpoint: ", md_address.status().message()));
  }
  up->md_address = std::move(*md_address);
  up->p2p = up->md_address.kind == metadata::MetadataAddress::Kind::kP2p;
  FERRY_ASSIGN_OR_RETURN(
      up->tls,
      metadata::Tls::Load({options.tls_ca_file, options.tls_cert_file,
                           options.tls_key_file, options.tls_server_name}));
  if (metadata_service_ == nullptr || metadata_service_clock_ != clock_) {
    metadata_service_ = std::make_unique<metadata::MetadataServiceImpl>(clock_);
    metadata_service_clock_ = clock_;
  }
  peer_service_.SetAuthToken(options.auth_token);
  metadata_service_->SetAuthToken(options.auth_token);
  std::vector<grpc::Service*> services = {&peer_service_};
  up->embedded =
      up->md_address.kind == metadata::MetadataAddress::Kind::kEmbedded;
  if (up->embedded) services.push_back(metadata_service_.get());
  metadata::RpcServerOptions rpc_options;
  rpc_options.tls = up->tls;
  // The RPC server's connection timeouts (a first byte within 5 s, idle
  // for 2 min) stay on real time even on a simulated engine clock: they
  // guard real sockets against real clients, and a test that advances its
  // clock by minutes must not cut the engine's own gRPC connections.
  FERRY_ASSIGN_OR_RETURN(
      rpc_server_,
      metadata::RpcServer::Start(
          JoinHostPort(options.listen_host.empty() ? "::" : options.listen_host,
                       options.rpc_port),
          services, rpc_options));
  if (options.auth_token.empty() && options.tls_cert_file.empty() &&
      metadata::ListensBeyondLoopback(options.listen_host)) {
    metadata::WarnOpenServer("this engine's RPC port", rpc_server_->address());
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::NameRun(const EngineOptions& options, Startup* up) {
  up->rpc_address = JoinHostPort(advertised_host_, rpc_server_->port());
  metadata_address_ =
      up->embedded ? up->rpc_address : options.metadata_endpoint;
  rpc_address_ = up->rpc_address;
  // P2PHANDSHAKE (Mooncake's): the segment is named by the engine's RPC
  // address, where peers ask for its descriptor.
  up->segment_name = up->p2p ? up->rpc_address : options.local_segment_name;
  options_.local_segment_name = up->segment_name;
  // This run's identity: its public half goes into the descriptor, and
  // every Exchange and Notify this engine sends is signed with it.
  FERRY_ASSIGN_OR_RETURN(identity_, IdentityKey::Generate());
  peer_client_ = std::make_unique<metadata::PeerClient>(
      options.rpc_timeout, metadata::PeerClient::kMaxStubs, options.auth_token,
      up->tls, identity_);
  return absl::OkStatus();
}

absl::Status EngineImpl::ConnectMetadata(const EngineOptions& options,
                                         Startup* up) {
  std::unique_ptr<metadata::Store> store;
  if (up->p2p) {
    auto own = std::make_unique<metadata::P2pStore>(peer_client_.get());
    peer_service_.SetDescriptorSource(own->local());
    store = std::move(own);
  } else if (up->embedded) {
    // An embedded service is called through loopback when it listens
    // there too: the advertised address may be one only remote peers can
    // use.
    std::string local;
    if (IsWildcardHost(options.listen_host)) {
      local = JoinHostPort("127.0.0.1", rpc_server_->port());
    } else {
      auto host = ResolveHost(options.listen_host);  // Bound: it resolves.
      local = JoinHostPort(host.ok() ? *host : options.listen_host,
                           rpc_server_->port());
    }
    store = std::make_unique<metadata::MetadataClient>(
        local, options.rpc_timeout, options.auth_token, up->tls);
  } else {
    // Names are resolved here, once: the store then dials addresses, with
    // no DNS on any later call.
    auto connected = metadata::ConnectStore(up->md_address, options.rpc_timeout,
                                            options.auth_token, up->tls, clock_,
                                            options.etcd_limits);
    if (!connected.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata_endpoint: ", connected.status().message()));
    }
    store = std::move(*connected);
  }
  if (!options.metadata_namespace.empty()) {
    FERRY_ASSIGN_OR_RETURN(
        store, metadata::NamespacedStore::Create(std::move(store),
                                                 options.metadata_namespace));
  }
  metadata_ = std::move(store);
  up->metadata_addr = metadata_->Describe();
  return absl::OkStatus();
}

void EngineImpl::StartPeerServices(const EngineOptions& options,
                                   const Startup& up) {
  segments_ = std::make_unique<SegmentCache>(
      metadata_.get(), NextHandleTag(),
      [this](Task* task, std::shared_ptr<const SegmentView> view,
             const absl::Status& fetch) {
        OnDescriptorReady(task, std::move(view), fetch);
      },
      clock_);
  sink_.set_segments(segments_.get());
  // P2P names are addresses: a notification's claimed address is held to
  // the caller's host first, and only then read for its key (a lookup
  // first would dial whatever a caller names).
  sender_check_ = std::make_unique<SenderCheck>(
      metadata_.get(), options.metadata_lease_ttl, nullptr, up.p2p);
  notifications_.Configure(
      {options.max_queued_notifications, options.max_queued_notification_bytes,
       options.max_queued_notifications_per_sender,
       options.max_queued_notification_bytes_per_sender},
      up.segment_name, incarnation_, options.refuse_unverified_notifications,
      [this](const metadata::NotifyRequest& request,
             const std::string& sender) {
        // A signed notification is numbered, and each number is good once.
        return sender_check_->Verify(
            request.from_segment(), sender, metadata::NotifyContent(request),
            request.signature(),
            request.signature().empty()
                ? std::nullopt
                : std::optional<uint64_t>(request.seq()));
      });
  peer_service_.SetNotifyHandler([this](const metadata::NotifyRequest& request,
                                        const std::string& sender) {
    return notifications_.Receive(request, sender);
  });
  // Handshakes and rail notices from a segment that did not sign them
  // never reach a transport.
  peer_service_.SetSenderVerifier(
      [this](const std::string& from, const std::string& caller,
             const std::string& content, const std::string& signature,
             uint64_t seq) {
        // Handshakes are not held to a host (multi-homed or NATed peers
        // would fail it, and a release before identity keys, whose
        // unsigned ones are taken, checked nothing here); in P2P mode the
        // claimed address itself is read for the key that must sign them.
        // Numbered ones are accepted once: a captured handshake or rail
        // notice cannot be sent again.
        return sender_check_->Verify(
            from, caller, content, signature,
            seq != 0 ? std::optional<uint64_t>(seq) : std::nullopt,
            /*check_host=*/false);
      });
}

absl::Status EngineImpl::InstallTransports(
    const EngineOptions& options, const Startup& up,
    descriptor::SegmentDescriptor* desc) {
  desc->set_name(up.segment_name);
  desc->set_incarnation(incarnation_);
  desc->set_rpc_address(up.rpc_address);
  desc->set_network_id(NetworkIdentity());
  desc->set_identity_key(identity_->public_key());

  TransportEnv env;
  env.local_segment = up.segment_name;
  env.incarnation = incarnation_;
  env.listen_host = options.listen_host;
  env.advertise_host = advertised_host_;
  env.rpc_address = up.rpc_address;
  peer_channel_ = std::make_unique<GrpcPeerChannel>(
      &peer_service_, peer_client_.get(), up.segment_name);
  env.peer_channel = peer_channel_.get();
  env.clock = clock_;
  env.auth_token = options.auth_token;
  for (const std::string& name : options.transports) {
    auto transport = CreateTransport(name, up.topts);
    absl::Status s = transport.status();
    descriptor::TransportEndpoint* ep = desc->add_transports();
    ep->set_transport(name);
    if (s.ok()) s = (*transport)->Install(env, ep);
    if (!s.ok()) {
      // The half-installed transport goes first: its shutdown still uses
      // the peer channel, which ReleaseAll releases.
      transport = absl::CancelledError("not installed");
      return absl::Status(s.code(), absl::StrCat("installing transport '", name,
                                                 "': ", s.message()));
    }
    slice_bytes_.push_back((*transport)->max_slice_bytes());
    transports_.push_back(std::move(*transport));
  }
  return absl::OkStatus();
}

absl::Status EngineImpl::PublishSegment(
    const EngineOptions& options, const Startup& up,
    const descriptor::SegmentDescriptor& desc) {
  FERRY_RETURN_IF_ERROR(segments_->Start());
  // This run's owner key: only this run can change or remove the segment,
  // and a second engine with the same name cannot take it over.
  publisher_ = std::make_unique<SegmentPublisher>(
      metadata_.get(), metadata::NewOwnerKey(), options.metadata_lease_ttl,
      clock_);
  const absl::Duration name_wait =
      options.segment_name_wait >= absl::ZeroDuration()
          ? options.segment_name_wait
          : options.metadata_lease_ttl + absl::Seconds(1);
  if (absl::Status s = publisher_->Publish(desc, name_wait); !s.ok()) {
    FERRY_LOG(kError, "metadata", "cannot publish segment '", up.segment_name,
              "' to ", up.metadata_addr, ": ", s.message());
    return absl::Status(
        s.code(), absl::StrCat("cannot publish segment '", up.segment_name,
                               "' to the metadata service at ",
                               up.metadata_addr, ": ", s.message()));
  }
  return absl::OkStatus();
}

void EngineImpl::LogStarted(const EngineOptions& options,
                            const Startup& up) const {
  if (IsLoopbackHost(advertised_host_) && !up.embedded) {
    if (auto md = ParseHostPort(options.metadata_endpoint);
        md.ok() && !IsLoopbackHost(md->host) && md->host != "localhost") {
      FERRY_LOG(kWarn, "engine", "segment '", up.segment_name,
                "' advertises the loopback address ", advertised_host_,
                " to the metadata service at ", options.metadata_endpoint,
                ": peers on other hosts will be refused at OpenSegment. Set "
                "advertise_host (or listen_host) to an address they can "
                "route to");
    }
  }
  FERRY_LOG(
      kInfo, "engine", "segment '", up.segment_name, "' up: metadata ",
      up.embedded ? "embedded at " : "at ", metadata_address_, ", rpc ",
      up.rpc_address, ", bound to '",
      options.listen_host.empty() ? "every interface" : options.listen_host,
      "', advertising ", advertised_host_, " (", advertised_reason_,
      "), transports [", absl::StrJoin(options.transports, ","),
      "], rpc_timeout ", absl::FormatDuration(options.rpc_timeout),
      ", metadata_lease_ttl ", absl::FormatDuration(options.metadata_lease_ttl),
      ", transfer_timeout ", absl::FormatDuration(options.transfer_timeout),
      ", mr_cache_bytes ", options.mr_cache_bytes);
}

void EngineImpl::ReleaseAll() {
  // No renewal may race with the removal or outlive the client.
  if (publisher_ != nullptr) publisher_->Stop();
  publisher_.reset();
  StopTransports();
  if (rpc_server_ != nullptr) rpc_server_->Shutdown();
  rpc_server_.reset();
  // The services' handlers ran on their pools' threads and touched this
  // engine's state (the notification queue, transports): wait until every
  // one has returned, which also orders them before what follows (gRPC's
  // own completion of their calls is invisible to TSan).
  peer_service_.WaitIdle();
  if (metadata_service_ != nullptr) metadata_service_->WaitIdle();
  // No call is in progress once the server is down: the source (in
  // metadata_) may go.
  peer_service_.SetDescriptorSource(nullptr);
  // Both use sender_check_ and the store: a later Init serves calls
  // before it makes new ones.
  peer_service_.SetSenderVerifier(nullptr);
  peer_service_.SetNotifyHandler(nullptr);
  // Its readers read through metadata_ (or, P2P, through peer_client_):
  // joined before either goes, and before a later Init replaces them.
  sender_check_.reset();
  // Every slice has completed (the transports cancelled what was left), so
  // no lease is held: the registrations go with the transports whose
  // handles they carry, and a later Init starts clean.
  registrations_.StopCache();
  registrations_.Clear();
  transports_.clear();
  transports_stopped_ = false;
  slice_bytes_.clear();
  sink_.set_segments(nullptr);
  segments_.reset();
  peer_channel_.reset();
  peer_client_.reset();
  identity_.reset();
}

void EngineImpl::Shutdown() {
  if (!initialized_) return;
  initialized_ = false;
  // Farewells first (RDMA's DISCONNECTs), while the segment is still
  // published: peers check each against the identity key it publishes,
  // and refuse what a segment no longer registered sends.
  StopTransports();
  // Renewals stop before the removal: none may publish the segment again.
  // Best effort: a stopped metadata service must not stall shutdown long.
  if (publisher_ != nullptr) publisher_->Withdraw();
  ReleaseAll();
}

void EngineImpl::StopTransports() {
  if (transports_stopped_) return;
  transports_stopped_ = true;
  // Requests waiting for a descriptor end first (Cancelled): none may
  // reach a transport that is going away.
  if (segments_ != nullptr) segments_->Stop();
  // Farewells (RDMA's DISCONNECTs) get one RPC timeout, not the patience
  // a busy peer gets while the engine runs: shutdown must not wait on it.
  if (peer_client_ != nullptr) peer_client_->EndPatience();
  for (auto& t : transports_) t->Shutdown();
}

}  // namespace ferry
