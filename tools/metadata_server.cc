// metadata_server: a standalone Ferry metadata service, for deployments
// where no engine should own the segment table.
//   metadata_server --listen=0.0.0.0:50051
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "metadata/metadata_service.h"
#include "metadata/rpc_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "host:port to serve on (port 0 picks one)");

namespace {
std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }
}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  ferry::metadata::MetadataServiceImpl service;
  auto server = ferry::metadata::RpcServer::Start(absl::GetFlag(FLAGS_listen),
                                                  {&service});
  if (!server.ok()) {
    std::fprintf(stderr, "metadata_server: %s\n",
                 server.status().ToString().c_str());
    return 1;
  }
  std::printf("metadata_server listening on %s\n",
              (*server)->address().c_str());
  std::fflush(stdout);
  while (!g_stop.load()) absl::SleepFor(absl::Milliseconds(100));
  (*server)->Shutdown();
  return 0;
}
