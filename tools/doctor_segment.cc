// doctor --metadata=HOST:PORT --peer=SEGMENT: the NIC pair matrix against a
// running engine. The doctor speaks the engine's own RDMA handshake
// (transport/rdma/handshake.proto, carried by PeerService.Exchange) as a
// peer segment of its own, "doctor@<host>:<pid>.<random>": a ConnectRequest for
// a rail of one QP, READY once its QP is connected, and DISCONNECT when the
// probe is done, so the engine closes the rail at once (its record of the
// doctor as a peer stays until its peer table's LRU bound evicts it).
// Engines answer only what the segment it names signed
// (common/identity.h), so the doctor registers that segment for the probe
// -- a descriptor with its identity key and a lease, renewed while it
// probes and removed at the end -- as an engine would. The WRITE
// and READ go to the probe page the engine's RDMA transport publishes per NIC
// in its descriptor (metadata.proto, Device.probe_addr/probe_rkey): never to
// application memory.
#include <unistd.h>

#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/identity.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "metadata/auth.h"
#include "metadata/grpc_status.h"
#include "metadata/metadata_client.h"
#include "metadata/peer_service.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/store.h"
#include "tools/doctor_peer.h"
#include "tools/doctor_probe.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/handshake.pb.h"
#include "transport/rdma/qp.h"

namespace ferry::doctor {
namespace {

constexpr absl::Duration kRpcTimeout = absl::Seconds(10);
// Bytes WRITTEN and READ per pair, at a random slot of the probe page, so
// that two doctors probing one engine at once rarely meet.
constexpr uint32_t kSlotBytes = 512;
// The probe identity's lease: longer than a probe of every pair takes
// (each is bounded by kRpcTimeout and the probe's own waits).
constexpr absl::Duration kIdentityLease = absl::Minutes(2);

// The cluster's token, when the environment gives one (as it gives every
// engine of the cluster): a protected cluster answers nothing without it.
const std::string& EnvToken() {
  static const std::string* token = [] {
    auto t = metadata::AuthTokenFromEnv();
    return new std::string(t.ok() ? *t : "");
  }();
  return *token;
}

// One Exchange with the engine; `out` gets the reply payload parsed.
template <typename Reply>
absl::Status Exchange(metadata::PeerService::Stub* stub,
                      const IdentityKey& identity, const std::string& from,
                      const rdma::RdmaMessage& msg, Reply* out) {
  metadata::ExchangeRequest req;
  req.set_transport("rdma");
  req.set_from_segment(from);
  req.set_payload(msg.SerializeAsString());
  auto sig = identity.Sign(metadata::ExchangeContent(req));
  if (!sig.ok()) return sig.status();
  req.set_signature(std::move(*sig));
  metadata::ExchangeResponse resp;
  grpc::ClientContext ctx;
  metadata::AddAuthToken(&ctx, EnvToken());
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRpcTimeout));
  if (grpc::Status s = stub->Exchange(&ctx, req, &resp); !s.ok()) {
    return metadata::FromGrpcStatus(s, "the engine's peer service");
  }
  if (!out->ParseFromString(resp.payload())) {
    return absl::DataLossError("the engine's handshake reply does not parse");
  }
  return absl::OkStatus();
}

struct Session {
  metadata::PeerService::Stub* stub;
  const IdentityKey* identity;  // The one `from` publishes.
  std::string from;
  uint64_t incarnation;         // Ours.
  uint64_t target_incarnation;  // The engine's, from its descriptor.
};

rdma::RdmaMessage Notice(const Session& ss, rdma::RailNotice::Kind kind,
                         const std::string& local_nic,
                         const std::string& remote_nic, uint64_t epoch) {
  rdma::RdmaMessage m;
  rdma::RailNotice* n = m.mutable_notice();
  n->set_kind(kind);
  n->set_initiator_segment(ss.from);
  n->set_initiator_incarnation(ss.incarnation);
  n->set_initiator_nic(local_nic);
  n->set_target_nic(remote_nic);
  n->set_epoch(epoch);
  n->set_target_incarnation(ss.target_incarnation);
  return m;
}

// Probes one pair; appends its check. False if the other pairs would fare
// no better: the engine's peer service did not answer at all (they would
// only wait as long), or it refused the doctor (they would be refused).
bool ProbePair(const Session& ss, const std::string& local_nic,
               ibv_device* ldev, const descriptor::Device& remote,
               uint32_t seed, std::vector<Check>* out) {
  const std::string name =
      absl::StrCat("peer ", local_nic, " -> ", remote.name());
  auto fail = [&](const std::string& detail, const std::string& fix) {
    out->push_back({name, Level::kFail, detail, fix});
  };
  constexpr char kRpcFix[] =
      "the engine's RPC address must be reachable from here (its "
      "advertise_host and port; docs/deployment.md)";
  auto p = NewProbe(ldev);
  if (!p.ok()) {
    fail(std::string(p.status().message()), "fix the local NIC first");
    return true;
  }
  Probe& probe = **p;
  rdma::RdmaMessage m;
  rdma::ConnectRequest* req = m.mutable_connect();
  req->set_initiator_segment(ss.from);
  req->set_initiator_incarnation(ss.incarnation);
  req->set_target_incarnation(ss.target_incarnation);
  req->set_initiator_nic(local_nic);
  req->set_target_nic(remote.name());
  rdma::DescribeQp(probe.qp, probe.nic.get(), req->add_initiator_qps());
  rdma::ConnectReply reply;
  absl::Status s = Exchange(ss.stub, *ss.identity, ss.from, m, &reply);
  // No answer at all: stop probing. An engine that refused the request
  // (INVALID_ARGUMENT, ...) or sent a reply that does not parse answered.
  const bool answered = s.code() != absl::StatusCode::kUnavailable &&
                        s.code() != absl::StatusCode::kDeadlineExceeded;
  if (s.ok()) s = rdma::ValidateConnectReply(reply, 1);
  if (s.code() == absl::StatusCode::kPermissionDenied) {
    // Answered: the engine checked who the doctor is and refused it.
    fail(std::string(s.message()),
         "the engine must find the doctor's probe segment in its metadata: "
         "give the doctor the --metadata the engine uses");
    return false;  // Every other pair would be refused the same way.
  }
  if (!s.ok()) {
    fail(std::string(s.message()), kRpcFix);
    return answered;
  }
  if (reply.result() != rdma::ConnectReply::ACCEPTED) {
    fail(absl::StrCat("the engine refused the rail (",
                      rdma::ConnectReply::Result_Name(reply.result()),
                      reply.reason().empty() ? "" : ": ", reply.reason(), ")"),
         reply.result() == rdma::ConnectReply::STALE_INCARNATION
             ? "the engine restarted while probing: run the doctor again"
             : "see the engine's log and its own doctor checks");
    return true;
  }
  // From here the engine holds a rail for us: whatever happens, it is told
  // to drop it (DISCONNECT) rather than wait for its timeout.
  const rdma::QpInfo& target = reply.target_qps(0);
  rdma::RailNoticeReply ignored;
  s = rdma::ConnectQp(probe.qp, probe.nic.get(), target, ProbeTimers());
  if (!s.ok()) {
    fail(absl::StrCat("QP set-up refused: ", s.message()),
         "the two NICs disagree on MTU or GID type; compare both hosts' "
         "doctor MTU and GID lines");
  } else if (s = Exchange(ss.stub, *ss.identity, ss.from,
                          Notice(ss, rdma::RailNotice::READY, local_nic,
                                 remote.name(), reply.epoch()),
                          &ignored);
             !s.ok()) {
    fail(absl::StrCat("READY not delivered: ", s.message()), kRpcFix);
  } else {
    const uint64_t slot =
        (seed % (rdma::kProbePageBytes / kSlotBytes)) * kSlotBytes;
    const uint64_t addr = remote.probe_addr() + slot;
    s = WriteReadVerify(&probe, kSlotBytes, addr, remote.probe_rkey(), seed);
    const absl::StatusOr<double> p50 =
        s.ok() ? WriteLatencyUs(&probe, addr, remote.probe_rkey())
               : absl::StatusOr<double>(s);
    out->push_back(
        p50.ok() ? PairVerdict(name, probe, target.mtu(), kSlotBytes, *p50)
                 : UnreachableVerdict(name, p50.status()));
  }
  Exchange(ss.stub, *ss.identity, ss.from,
           Notice(ss, rdma::RailNotice::DISCONNECT, local_nic, remote.name(),
                  reply.epoch()),
           &ignored)
      .IgnoreError();
  return true;
}

}  // namespace

void ProbeSegment(const std::string& metadata, const std::string& segment,
                  const std::vector<std::string>& filter,
                  std::vector<Check>* out) {
  const std::string check = absl::StrCat("segment ", segment);
  metadata::MetadataClient client(metadata, kRpcTimeout, EnvToken());
  auto desc = client.Get(segment);
  if (!desc.ok()) {
    out->push_back(
        {check, Level::kFail,
         absl::StrCat("cannot look it up at ", metadata, ": ",
                      desc.status().message()),
         "check --metadata (the metadata server, or the engine that embeds "
         "it) and the segment name the engine was started with"});
    return;
  }
  const descriptor::TransportEndpoint* rdma = nullptr;
  for (const auto& t : desc->transports()) {
    if (t.transport() == "rdma") rdma = &t;
  }
  if (rdma == nullptr || rdma->devices_size() == 0) {
    out->push_back({check, Level::kFail, "the engine runs no RDMA transport",
                    "start it with the rdma transport (and an RDMA NIC)"});
    return;
  }
  int probeable = 0;
  for (const auto& d : rdma->devices()) probeable += d.probe_rkey() != 0;
  out->push_back(
      {check, probeable == 0 ? Level::kFail : Level::kOk,
       absl::StrCat("RPC at ", desc->rpc_address(), ", ", rdma->devices_size(),
                    " RDMA NIC(s), ", probeable, " with a probe page"),
       probeable == 0 ? "the engine publishes no probe page (a Ferry before "
                        "the doctor could probe engines): upgrade it, or run "
                        "'doctor --serve' on its host"
                      : ""});
  const auto local = Devices(filter);
  if (local.empty()) {
    out->push_back({"peer", Level::kFail, "no local NIC to probe from",
                    "see the checks above"});
    return;
  }
  if (probeable == 0) return;
  auto stub = metadata::PeerService::NewStub(
      metadata::MakeChannel(desc->rpc_address()));
  char host[256] = "";
  ::gethostname(host, sizeof(host) - 1);
  std::random_device rd;
  auto identity = IdentityKey::Generate();
  if (!identity.ok()) {
    out->push_back({"peer", Level::kFail,
                    std::string(identity.status().message()),
                    "the doctor needs OpenSSL's Ed25519 (libcrypto 1.1.1 or "
                    "later)"});
    return;
  }
  // A name of the doctor's own: two doctors on one host, or in two
  // containers with the same host name and pid, never share one (the
  // second's registration would be refused).
  Session ss{stub.get(), identity->get(),
             absl::StrCat("doctor@", host, ":", ::getpid(), ".",
                          absl::Hex(rd(), absl::kZeroPad8)),
             (uint64_t{rd()} << 32 | rd()) | 1, desc->incarnation()};
  // The probe's own segment, for as long as the probe runs: what the
  // engine checks the doctor's handshakes against.
  metadata::PutSegmentRequest put;
  put.mutable_segment()->set_name(ss.from);
  put.mutable_segment()->set_incarnation(ss.incarnation);
  put.mutable_segment()->set_identity_key((*identity)->public_key());
  put.set_lease_ttl_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(kIdentityLease)));
  put.set_owner_key(metadata::NewOwnerKey());
  if (auto put_ok = client.Put(put); !put_ok.ok()) {
    const absl::StatusCode code = put_ok.status().code();
    out->push_back(
        {"peer", Level::kFail,
         absl::StrCat("cannot register the probe's segment '", ss.from, "' at ",
                      metadata, ": ", put_ok.status().message()),
         code == absl::StatusCode::kUnauthenticated ||
                 code == absl::StatusCode::kPermissionDenied
             ? "the metadata service refuses the doctor: give it the "
               "cluster's token (FERRY_AUTH_TOKEN_FILE, as the engines "
               "have it)"
         : code == absl::StatusCode::kUnavailable ||
                 code == absl::StatusCode::kDeadlineExceeded
             ? "the metadata service must be reachable from here (--metadata)"
             : "the engine answers only a registered, signed peer: see the "
               "message, and the metadata service's log"});
    return;
  }
  // Kept registered while the pairs are probed, however many there are.
  absl::Time renewed = absl::Now();
  auto renew = [&] {
    if (absl::Now() - renewed < kIdentityLease / 2) return;
    metadata::KeepAliveRequest ka;
    ka.set_name(ss.from);
    ka.set_incarnation(ss.incarnation);
    ka.set_owner_key(put.owner_key());
    if (client.KeepAlive(ka).ok()) renewed = absl::Now();
  };
  struct Unregister {
    metadata::MetadataClient* client;
    metadata::RemoveSegmentRequest rm;
    ~Unregister() { client->Remove(rm).IgnoreError(); }
  } unregister{&client, {}};
  unregister.rm.set_name(ss.from);
  unregister.rm.set_incarnation(ss.incarnation);
  unregister.rm.set_owner_key(put.owner_key());
  uint32_t seed = rd();
  for (const auto& [lname, ldev] : local) {
    for (const descriptor::Device& remote : rdma->devices()) {
      if (remote.probe_rkey() == 0) continue;
      renew();
      if (!ProbePair(ss, lname, ldev, remote, seed++, out)) {
        out->push_back({"peer", Level::kFail,
                        "the other NIC pairs were not probed: the engine's "
                        "peer service did not answer, or refused the doctor",
                        "fix that first (see the pair above)"});
        return;
      }
    }
  }
}

}  // namespace ferry::doctor
