// Identities that cannot be spoofed without a secret. Each engine makes an
// Ed25519 key pair for its run and publishes the public half in its
// segment's descriptor; the control messages it sends to peers (RDMA
// handshakes and rail notices through PeerService.Exchange, and
// notifications) carry its signature, which the receiver checks against
// that descriptor. The metadata service lets only a segment's owner
// publish under its name (owner keys), so a stranger -- on another host or
// the same one, with the cluster's token or without -- cannot speak for a
// segment it does not own.
//
// Replays: a notification names its receiver, the receiver's run and a
// number, all signed, and each number is accepted once
// (engine/replay_window.h). An Exchange carries a number from the same
// sequence, inside what is signed, and is accepted once too; a handshake
// also names the receiver's incarnation and its rail epoch, so the
// transport refuses one sent to another engine or to a later run.
// (Exchanges of releases before numbers carry 0 and are not numbered.)
//
// Thread-safe: an IdentityKey does not change once made, and may sign from
// many threads at once.
#ifndef FERRY_COMMON_IDENTITY_H_
#define FERRY_COMMON_IDENTITY_H_

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

typedef struct evp_pkey_st EVP_PKEY;  // OpenSSL's, kept out of this header.

namespace ferry {

inline constexpr size_t kIdentityKeyBytes = 32;
inline constexpr size_t kSignatureBytes = 64;

class IdentityKey {
 public:
  // A fresh key pair, from OpenSSL's CSPRNG. Internal if OpenSSL cannot
  // make one (no Ed25519 in the library: a build against an old one).
  static absl::StatusOr<std::shared_ptr<const IdentityKey>> Generate();

  ~IdentityKey();
  IdentityKey(const IdentityKey&) = delete;
  IdentityKey& operator=(const IdentityKey&) = delete;

  // The public half, kIdentityKeyBytes raw bytes, as descriptors publish
  // it.
  const std::string& public_key() const { return public_key_; }

  // This key's signature of `message` (kSignatureBytes). Internal only if
  // OpenSSL fails, which a valid key never makes it do.
  absl::StatusOr<std::string> Sign(absl::string_view message) const;

 private:
  IdentityKey(EVP_PKEY* key, std::string public_key)
      : key_(key), public_key_(std::move(public_key)) {}

  EVP_PKEY* const key_;
  const std::string public_key_;
};

// OK if `signature` is the signature of `message` by the key whose public
// half is `public_key`; PermissionDenied saying what is wrong otherwise (no
// signature, a malformed key, a signature that does not match).
absl::Status VerifySignature(absl::string_view public_key,
                             absl::string_view message,
                             absl::string_view signature);

// The bytes a sender signs for a message of kind `kind` ("exchange",
// "notify") made of `fields`: a domain tag, so that a signature made for
// one kind of message is never valid as another, then each field prefixed
// by its length, so that no two field lists sign alike.
std::string SignedContent(absl::string_view kind,
                          std::initializer_list<absl::string_view> fields);

}  // namespace ferry

#endif  // FERRY_COMMON_IDENTITY_H_
