// TLS for Ferry's gRPC services (metadata and peer), gRPC's own (OpenSSL).
//
// One cluster CA signs a certificate for every engine and metadata_server.
// With TLS on, every connection is mutual TLS: a server accepts only
// clients whose certificate the CA signed, a client only servers whose
// certificate the CA signed and names the host it dialled (or
// `server_name`, when one name is shared by the whole cluster). The shared
// token (auth.h) still applies on top.
//
// What it protects: the token, descriptors (addresses, rkeys, TCP buffer
// keys), handshakes and notifications can no longer be read or changed on
// the network, and a process without a certificate from the CA cannot
// call the services at all. What it does not: the data path (RDMA and the
// TCP transport's frames are not encrypted; their keys are), and the etcd
// connection of the etcd store (etcd has its own TLS, not used yet).
#ifndef FERRY_METADATA_TLS_H_
#define FERRY_METADATA_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace ferry::metadata {

// PEM files. All of ca_file, cert_file and key_file, or none (TLS off).
struct TlsFiles {
  std::string ca_file;    // The cluster CA's certificate(s).
  std::string cert_file;  // This process's certificate chain.
  std::string key_file;   // Its private key.
  // The name every server's certificate must carry; empty: the host (name
  // or IP address) the client dialled.
  std::string server_name;

  bool enabled() const {
    return !ca_file.empty() || !cert_file.empty() || !key_file.empty();
  }
};

// Largest PEM file read (a chain of a few certificates is a few KiB).
constexpr size_t kMaxPemFileBytes = 1 << 20;

// Credentials loaded once from TlsFiles. Immutable; thread-safe.
class Tls {
 public:
  // nullptr if `files` is not enabled. InvalidArgument naming the file if
  // one is missing, unreadable, too large or not PEM of the right kind, or
  // if only some of the three (or only server_name) are given.
  static absl::StatusOr<std::shared_ptr<const Tls>> Load(const TlsFiles& files);

  // Requires and verifies a client certificate.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;
  // Sets what a client checks the server's certificate against, if
  // server_name is set.
  void AddChannelArgs(grpc::ChannelArguments* args) const;

 private:
  Tls() = default;

  std::string ca_;
  std::string cert_;
  std::string key_;
  std::string server_name_;
};

// With mutual TLS a certificate also names the segments its holder may
// publish, as URI subject alternative names "ferry-segment:<name>" (that
// name), "ferry-segment:<prefix>*" (the names that start with the prefix:
// end a namespace's with its '/', "cluster-a/*", or it also grants
// "cluster-ab/...") or "ferry-segment:*" (any). The
// metadata service takes a PutSegment for a name only from a client whose
// certificate names it, so one host's key cannot publish (or take over,
// once a lease ends) another's segments. Mooncake has no such binding.
constexpr char kSegmentUriPrefix[] = "ferry-segment:";

// OK if `auth` is not an authenticated TLS peer (no TLS: the token and
// owner keys apply alone) or its certificate names `segment`; else
// PermissionDenied saying what the certificate names and how to add it.
absl::Status CertificateMayPublish(const grpc::AuthContext* auth,
                                   absl::string_view segment);

}  // namespace ferry::metadata

#endif  // FERRY_METADATA_TLS_H_
