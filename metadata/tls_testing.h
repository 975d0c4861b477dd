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
  TlsFiles node;   // Signed by the cluster CA; trusts it.
  TlsFiles rogue;  // Signed by another CA; trusts that one.
};

// Every certificate names DNS:ferry.test and IP:127.0.0.1 and ::1.
// Files go to `dir`, which must exist. Internal error if openssl fails.
inline absl::StatusOr<TestPki> MakeTestPki(const std::string& dir) {
  const std::string ext = dir + "/san.cnf";
  const std::string script = absl::StrCat(
      "set -e; cd '", dir, "'; ",
      "printf 'subjectAltName=DNS:ferry.test,IP:127.0.0.1,IP:::1\\n' > ", ext,
      "; for ca in ca rogue; do ",
      "timeout 60 openssl req -x509 -newkey ec -pkeyopt "
      "ec_paramgen_curve:prime256v1 -nodes -keyout $ca.key -out $ca.pem "
      "-days 2 -subj /CN=ferry-test-$ca; ",
      "timeout 60 openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
      "-nodes -keyout $ca-node.key -out $ca-node.csr -subj /CN=node; ",
      "timeout 60 openssl x509 -req -in $ca-node.csr -CA $ca.pem -CAkey "
      "$ca.key "
      "-CAcreateserial -out $ca-node.pem -days 2 -extfile ",
      ext, "; done >/dev/null 2>&1");
  if (std::system(script.c_str()) != 0) {
    return absl::InternalError("openssl failed to make test certificates");
  }
  TestPki p;
  p.node = {dir + "/ca.pem", dir + "/ca-node.pem", dir + "/ca-node.key", ""};
  p.rogue = {dir + "/rogue.pem", dir + "/rogue-node.pem",
             dir + "/rogue-node.key", ""};
  return p;
}

}  // namespace ferry::metadata::testing

#endif  // FERRY_METADATA_TLS_TESTING_H_
