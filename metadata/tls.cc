#include "metadata/tls.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"

namespace ferry::metadata {
namespace {

// Reads a PEM file, bounded: the path may name anything (/dev/zero).
absl::StatusOr<std::string> ReadPem(const std::string& what,
                                    const std::string& path,
                                    absl::string_view must_contain) {
  absl::StatusOr<std::string> buf =
      ReadFileBounded(absl::StrCat("TLS ", what), path, kMaxPemFileBytes);
  if (!buf.ok()) return buf.status();
  if (!absl::StrContains(*buf, must_contain)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS ", what, ": ", path, " holds no PEM block '", must_contain, "'"));
  }
  return buf;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Tls>> Tls::Load(const TlsFiles& files) {
  if (!files.enabled()) {
    if (!files.server_name.empty()) {
      return absl::InvalidArgumentError(
          "a TLS server name without the CA, certificate and key files "
          "would leave TLS off");
    }
    return std::shared_ptr<const Tls>();
  }
  if (files.ca_file.empty() || files.cert_file.empty() ||
      files.key_file.empty()) {
    return absl::InvalidArgumentError(
        "TLS needs all of a CA file, a certificate file and a key file");
  }
  std::shared_ptr<Tls> tls(new Tls());
  auto ca = ReadPem("CA", files.ca_file, "-----BEGIN CERTIFICATE-----");
  if (!ca.ok()) return ca.status();
  auto cert =
      ReadPem("certificate", files.cert_file, "-----BEGIN CERTIFICATE-----");
  if (!cert.ok()) return cert.status();
  // "BEGIN PRIVATE KEY", "BEGIN RSA PRIVATE KEY", "BEGIN EC PRIVATE KEY".
  auto key = ReadPem("key", files.key_file, "PRIVATE KEY-----");
  if (!key.ok()) return key.status();
  tls->ca_ = std::move(*ca);
  tls->cert_ = std::move(*cert);
  tls->key_ = std::move(*key);
  tls->server_name_ = files.server_name;
  return std::shared_ptr<const Tls>(std::move(tls));
}

std::shared_ptr<grpc::ServerCredentials> Tls::ServerCredentials() const {
  grpc::SslServerCredentialsOptions o(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = ca_;
  o.pem_key_cert_pairs.push_back({key_, cert_});
  return grpc::SslServerCredentials(o);
}

std::shared_ptr<grpc::ChannelCredentials> Tls::ChannelCredentials() const {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ca_;
  o.pem_private_key = key_;
  o.pem_cert_chain = cert_;
  return grpc::SslCredentials(o);
}

void Tls::AddChannelArgs(grpc::ChannelArguments* args) const {
  if (!server_name_.empty()) args->SetSslTargetNameOverride(server_name_);
}

absl::Status CertificateMayPublish(const grpc::AuthContext* auth,
                                   absl::string_view segment) {
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return absl::OkStatus();
  std::vector<std::string> named;
  // URI SANs only (gRPC's peer_uri): a DNS name spelled like one must not
  // grant anything.
  for (const grpc::string_ref& v : auth->FindPropertyValues("peer_uri")) {
    const absl::string_view uri(v.data(), v.size());
    if (!absl::StartsWith(uri, kSegmentUriPrefix)) continue;
    const absl::string_view pattern = uri.substr(strlen(kSegmentUriPrefix));
    if (pattern == segment ||
        (absl::EndsWith(pattern, "*") &&
         absl::StartsWith(segment, pattern.substr(0, pattern.size() - 1)))) {
      return absl::OkStatus();
    }
    named.emplace_back(pattern);
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "the client's TLS certificate does not name segment '", segment,
      "' among those it may publish (",
      named.empty() ? std::string("it names none")
                    : absl::StrCat("it names ", absl::StrJoin(named, ", ")),
      "): give the host a certificate whose subjectAltName carries URI:",
      kSegmentUriPrefix, segment, " or a pattern such as URI:",
      kSegmentUriPrefix, "<prefix>* (docs/deployment.md)"));
}

}  // namespace ferry::metadata
