#include "common/identity.h"

#include <openssl/err.h>
#include <openssl/evp.h>

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

// OpenSSL's reason for the last failure on this thread, and a clean queue
// for the next call.
std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no reason given";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

const unsigned char* Bytes(absl::string_view s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

}  // namespace

absl::StatusOr<std::shared_ptr<const IdentityKey>> IdentityKey::Generate() {
  EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, nullptr);
  EVP_PKEY* key = nullptr;
  const bool made = ctx != nullptr && EVP_PKEY_keygen_init(ctx) > 0 &&
                    EVP_PKEY_keygen(ctx, &key) > 0;
  EVP_PKEY_CTX_free(ctx);
  if (!made) {
    return absl::InternalError(
        absl::StrCat("cannot make an Ed25519 identity key: ", OpenSslError()));
  }
  std::string pub(kIdentityKeyBytes, '\0');
  size_t len = pub.size();
  if (EVP_PKEY_get_raw_public_key(
          key, reinterpret_cast<unsigned char*>(pub.data()), &len) <= 0 ||
      len != kIdentityKeyBytes) {
    EVP_PKEY_free(key);
    return absl::InternalError(absl::StrCat(
        "cannot read the identity key's public half: ", OpenSslError()));
  }
  return std::shared_ptr<const IdentityKey>(
      new IdentityKey(key, std::move(pub)));
}

IdentityKey::~IdentityKey() { EVP_PKEY_free(key_); }

absl::StatusOr<std::string> IdentityKey::Sign(absl::string_view message) const {
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  std::string sig(kSignatureBytes, '\0');
  size_t len = sig.size();
  // Ed25519 hashes the message itself: no digest is named.
  const bool ok =
      md != nullptr &&
      EVP_DigestSignInit(md, nullptr, nullptr, nullptr, key_) > 0 &&
      EVP_DigestSign(md, reinterpret_cast<unsigned char*>(sig.data()), &len,
                     Bytes(message), message.size()) > 0 &&
      len == kSignatureBytes;
  EVP_MD_CTX_free(md);
  if (!ok) {
    return absl::InternalError(
        absl::StrCat("cannot sign with the identity key: ", OpenSslError()));
  }
  return sig;
}

absl::Status VerifySignature(absl::string_view public_key,
                             absl::string_view message,
                             absl::string_view signature) {
  if (signature.empty()) {
    return absl::PermissionDeniedError("the message is not signed");
  }
  if (signature.size() != kSignatureBytes) {
    return absl::PermissionDeniedError(
        absl::StrCat("the signature is ", signature.size(), " bytes, not ",
                     kSignatureBytes));
  }
  if (public_key.size() != kIdentityKeyBytes) {
    return absl::PermissionDeniedError(
        absl::StrCat("the published identity key is ", public_key.size(),
                     " bytes, not ", kIdentityKeyBytes));
  }
  EVP_PKEY* key = EVP_PKEY_new_raw_public_key(
      EVP_PKEY_ED25519, nullptr, Bytes(public_key), public_key.size());
  if (key == nullptr) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the published identity key is not an Ed25519 key: ", OpenSslError()));
  }
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  const int rc = md != nullptr && EVP_DigestVerifyInit(md, nullptr, nullptr,
                                                       nullptr, key) > 0
                     ? EVP_DigestVerify(md, Bytes(signature), signature.size(),
                                        Bytes(message), message.size())
                     : -1;
  EVP_MD_CTX_free(md);
  EVP_PKEY_free(key);
  ERR_clear_error();  // A mismatch leaves a reason queued; it says no more.
  if (rc != 1) {
    return absl::PermissionDeniedError(
        "the signature does not match the sender's published identity key");
  }
  return absl::OkStatus();
}

std::string SignedContent(absl::string_view kind,
                          std::initializer_list<absl::string_view> fields) {
  std::string out = absl::StrCat("ferry/", kind, "/v1");
  out.push_back('\0');
  for (absl::string_view f : fields) {
    uint64_t n = f.size();
    for (int i = 0; i < 8; ++i) {
      out.push_back(static_cast<char>(n & 0xff));
      n >>= 8;
    }
    out.append(f.data(), f.size());
  }
  return out;
}

}  // namespace ferry
