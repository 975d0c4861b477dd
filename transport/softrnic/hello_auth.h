// The cluster token on softrnic's wire: a device listener that has one
// opens every accepted connection with a CHALLENGE (a fresh random nonce),
// and takes a HELLO only if its payload is the HMAC-SHA256, under the
// token, of that challenge and of the HELLO's own header. Without the
// token nobody can open a connection to a QP, whatever QP numbers they
// guess or learn. The token comes from the environment, as the engine's
// does ($FERRY_AUTH_TOKEN_FILE or $FERRY_AUTH_TOKEN): softrnic is the
// process's libibverbs and sees no engine options.
//
// The proof authenticates the opening of a connection, not its frames: a
// host that can splice into an established TCP stream is beyond it (as it
// is beyond RoCE itself). docs/reliability.md has the threat model.
//
// Thread-safe.
#ifndef FERRY_TRANSPORT_SOFTRNIC_HELLO_AUTH_H_
#define FERRY_TRANSPORT_SOFTRNIC_HELLO_AUTH_H_

#include <cstdint>
#include <string>

#include "transport/softrnic/wire.h"

namespace softrnic {

// The token from the environment (read once) or SetClusterToken, or null
// when there is none.
// A token that is set but unusable (an unreadable file, a short or
// unprintable token) is reported on stderr and replaced by a random one
// nobody knows, so the device refuses every HELLO and its own are refused:
// a misconfiguration fails closed, not open.
const std::string* ClusterToken();

// Sets the token when the environment gave none: an engine passes its
// EngineOptions::auth_token (through softrnic_set_cluster_token), since
// softrnic sees no engine options. 0, or EEXIST if another token is in
// force already (it is never replaced: connections were proven with it),
// or EINVAL for an unusable one.
int SetClusterToken(const char* token);

// A CHALLENGE frame with a fresh nonce (16 bytes from the kernel's CSPRNG
// in msn, remote_addr and aux).
Frame MakeChallenge();

// The HELLO's proof: HMAC-SHA256 under `token` of a label, the encoded
// challenge and the encoded HELLO header (whose length is the proof's).
void HelloProof(const std::string& token, const uint8_t challenge[kHeaderBytes],
                const uint8_t hello[kHeaderBytes],
                uint8_t out[kHelloProofBytes]);

// Whether `proof` is HelloProof(token, challenge, hello), in time that does
// not depend on where it differs.
bool HelloProofMatches(const std::string& token,
                       const uint8_t challenge[kHeaderBytes],
                       const uint8_t hello[kHeaderBytes],
                       const uint8_t proof[kHelloProofBytes]);

}  // namespace softrnic

#endif  // FERRY_TRANSPORT_SOFTRNIC_HELLO_AUTH_H_
