// Test certificates, made at test time with the openssl command (nothing
// is checked in, nothing expires between runs): a cluster CA with a node
// certificate it signed, and a rogue CA with a certificate of its own.
#ifndef FERRY_METADATA_TLS_TESTING_H_
#define FERRY_METADATA_TLS_TESTING_H_

#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "metadata/tls.h"

namespace ferry::metadata::testing {

struct TestPki {
  TlsFiles node;   // Signed by the cluster CA; trusts it; any segment.
  TlsFiles rogue;  // Signed by another CA; trusts that one.
  // Signed by the cluster CA, naming segments "prefill-*" only, and none.
  TlsFiles prefill_only;
  TlsFiles no_segments;
};

// Every certificate names DNS:ferry.test and IP:127.0.0.1 and ::1, and,
// but for no_segments, the segments it may publish (tls.h): any
// ("ferry-segment:*"), or "prefill-*" for prefill_only. Files go to `dir`,
// which must exist. Internal error if openssl fails.
inline absl::StatusOr<TestPki> MakeTestPki(const std::string& dir) {
  const std::string names = "DNS:ferry.test,IP:127.0.0.1,IP:::1";
  const std::string script = absl::StrCat(
      "set -e; cd '", dir, "'; { ", "printf 'subjectAltName=", names,
      ",URI:ferry-segment:*\\n' > any.cnf; ", "printf 'subjectAltName=", names,
      ",URI:ferry-segment:prefill-*\\n' > prefill.cnf; ",
      "printf 'subjectAltName=", names, "\\n' > none.cnf; ",
      // Certificate $2 with extensions $3, signed by CA $1.
      "cert() { timeout 60 openssl req -newkey ec -pkeyopt "
      "ec_paramgen_curve:prime256v1 -nodes -keyout $2.key -out $2.csr "
      "-subj /CN=node; timeout 60 openssl x509 -req -in $2.csr -CA $1.pem "
      "-CAkey $1.key -CAcreateserial -out $2.pem -days 2 -extfile $3; }; ",
      "for ca in ca rogue; do ",
      "timeout 60 openssl req -x509 -newkey ec -pkeyopt "
      "ec_paramgen_curve:prime256v1 -nodes -keyout $ca.key -out $ca.pem "
      "-days 2 -subj /CN=ferry-test-$ca; ",
      "cert $ca $ca-node any.cnf; done; ",
      "cert ca prefill prefill.cnf; cert ca none none.cnf; ",
      "} >/dev/null 2>&1");
  if (std::system(script.c_str()) != 0) {
    return absl::InternalError("openssl failed to make test certificates");
  }
  TestPki p;
  p.node = {dir + "/ca.pem", dir + "/ca-node.pem", dir + "/ca-node.key", ""};
  p.rogue = {dir + "/rogue.pem", dir + "/rogue-node.pem",
             dir + "/rogue-node.key", ""};
  p.prefill_only = {dir + "/ca.pem", dir + "/prefill.pem", dir + "/prefill.key",
                    ""};
  p.no_segments = {dir + "/ca.pem", dir + "/none.pem", dir + "/none.key", ""};
  return p;
}

}  // namespace ferry::metadata::testing

#endif  // FERRY_METADATA_TLS_TESTING_H_
