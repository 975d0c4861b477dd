#include "descriptor/validation.h"

#include <functional>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace ferry::descriptor {
namespace {

SegmentDescriptor Good() {
  SegmentDescriptor d;
  d.set_name("peer");
  d.set_incarnation(7);
  d.set_rpc_address("10.0.0.2:17100");
  TransportEndpoint* tcp = d.add_transports();
  tcp->set_transport("tcp");
  tcp->set_address("10.0.0.2:17101");
  TransportEndpoint* rdma = d.add_transports();
  rdma->set_transport("rdma");
  for (const char* nic : {"mlx5_0", "mlx5_1"}) {
    Device* dev = rdma->add_devices();
    dev->set_name(nic);
    dev->set_gid(std::string(16, '\1'));
  }
  TransportEndpoint* shm = d.add_transports();
  shm->set_transport("shm");
  shm->mutable_shm()->set_host("boot/pid:4026531836");
  shm->mutable_shm()->set_pid(1234);
  shm->mutable_shm()->set_table_fd(7);
  shm->mutable_shm()->set_token_addr(0x7f0000001000);
  shm->mutable_shm()->set_token(std::string(16, 't'));
  for (uint64_t addr : {0x10000, 0x30000}) {
    Buffer* b = d.add_buffers();
    b->set_addr(addr);
    b->set_length(0x10000);
    b->set_location("cpu:0");
    for (const char* nic : {"mlx5_0", "mlx5_1"}) {
      NicKey* k = b->add_keys();
      k->set_nic(nic);
      k->set_rkey(0x1234);
    }
  }
  return d;
}

TEST(ValidationTest, AcceptsAWellFormedDescriptor) {
  EXPECT_OK(ValidateSegmentDescriptor(Good()));
}

// Each bad descriptor is refused with InvalidArgument naming its field.
TEST(ValidationTest, RefusesEachBadFieldNamingIt) {
  struct Case {
    const char* field;  // Must appear in the message.
    std::function<void(SegmentDescriptor*)> spoil;
  };
  const std::vector<Case> cases = {
      {"segment name", [](auto* d) { d->set_name("two words"); }},
      {"rpc_address", [](auto* d) { d->set_rpc_address("nohost"); }},
      {"rpc_address", [](auto* d) { d->set_rpc_address("host:0"); }},
      {"rpc_address", [](auto* d) { d->set_rpc_address("host:99999"); }},
      {"transports[0] ('tcp').address",
       [](auto* d) { d->mutable_transports(0)->set_address("nohost"); }},
      {"transports[0] ('tcp').address",
       [](auto* d) { d->mutable_transports(0)->set_address(""); }},
      {"transports[0] ('tcp').address",
       [](auto* d) { d->mutable_transports(0)->set_address("::1:80"); }},
      {"network_id", [](auto* d) { d->set_network_id("two words"); }},
      {"network_id", [](auto* d) { d->set_network_id(std::string(129, 'n')); }},
      {"identity_key", [](auto* d) { d->set_identity_key("short"); }},
      {"identity_key",
       [](auto* d) { d->set_identity_key(std::string(33, 'k')); }},
      // A name: the TCP transport dials IPv4 addresses only, so it would
      // fail every request instead of OpenSegment.
      {"transports[0] ('tcp').address",
       [](auto* d) { d->mutable_transports(0)->set_address("myhost:17101"); }},
      {"transports[0] ('tcp').address",
       [](auto* d) { d->mutable_transports(0)->set_address(":80"); }},
      {"transports[0] ('tcp').address",
       [](auto* d) {
         d->mutable_transports(0)->set_address(std::string("a\0b:1", 5));
       }},
      {"transports[1].transport",
       [](auto* d) { d->mutable_transports(1)->set_transport("tcp"); }},
      {"transports[1].transport",
       [](auto* d) { d->mutable_transports(1)->set_transport(""); }},
      {"transports[1] ('rdma').devices[1].name",
       [](auto* d) {
         d->mutable_transports(1)->mutable_devices(1)->set_name("mlx5_0");
       }},
      {"transports[1] ('rdma').devices[0].gid",
       [](auto* d) {
         d->mutable_transports(1)->mutable_devices(0)->set_gid("short");
       }},
      {"transports[1] ('rdma').devices[0].lid",
       [](auto* d) {
         d->mutable_transports(1)->mutable_devices(0)->set_lid(70000);
       }},
      {"transports[1] ('rdma').devices[0].name",
       [](auto* d) {
         d->mutable_transports(1)->mutable_devices(0)->set_name("");
       }},
      {"transports",
       [](auto* d) {
         for (int i = 0; i < 10; ++i) {
           d->add_transports()->set_transport("t" + std::to_string(i));
         }
       }},
      {"transports[2] ('shm').shm",
       [](auto* d) { d->mutable_transports(2)->clear_shm(); }},
      {"transports[2] ('shm').shm.host",
       [](auto* d) {
         d->mutable_transports(2)->mutable_shm()->set_host("a b");
       }},
      {"transports[2] ('shm').shm.pid",
       [](auto* d) { d->mutable_transports(2)->mutable_shm()->set_pid(0); }},
      {"transports[2] ('shm').shm.pid",
       [](auto* d) {
         d->mutable_transports(2)->mutable_shm()->set_pid(1u << 23);
       }},
      {"transports[2] ('shm').shm.table_fd",
       [](auto* d) {
         d->mutable_transports(2)->mutable_shm()->set_table_fd(-1);
       }},
      {"transports[2] ('shm').shm.token",
       [](auto* d) {
         d->mutable_transports(2)->mutable_shm()->set_token("short");
       }},
      {"transports[0] ('tcp').shm",
       [](auto* d) {
         *d->mutable_transports(0)->mutable_shm() = d->transports(2).shm();
       }},
      {"buffers[0].cuda_ipc.handle",
       [](auto* d) {
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_handle("short");
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_base(0x10000);
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_size(0x10000);
       }},
      {"buffers[0].cuda_ipc.base",
       [](auto* d) {
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_handle(
             std::string(64, 'h'));
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_base(0x10001);
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_size(0x10000);
       }},
      {"buffers[0].cuda_ipc.size",
       [](auto* d) {
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_handle(
             std::string(64, 'h'));
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_base(0x8000);
         d->mutable_buffers(0)->mutable_cuda_ipc()->set_size(0x10000);
       }},
      {"buffers[1]", [](auto* d) { d->mutable_buffers(1)->set_addr(0x18000); }},
      {"buffers[0]", [](auto* d) { d->mutable_buffers(0)->set_length(0); }},
      {"buffers[1]",
       [](auto* d) { d->mutable_buffers(1)->set_length(~uint64_t{0}); }},
      {"buffers[0].location",
       [](auto* d) {
         d->mutable_buffers(0)->set_location(std::string(100, 'x'));
       }},
      {"buffers[1].keys[1].nic",
       [](auto* d) {
         d->mutable_buffers(1)->mutable_keys(1)->set_nic("mlx5_0");
       }},
      {"buffers[0].keys[0].nic",
       [](auto* d) {
         d->mutable_buffers(0)->mutable_keys(0)->set_nic("mlx9_9");
       }},
      {"buffers[0].keys[0].nic",
       [](auto* d) { d->mutable_buffers(0)->mutable_keys(0)->set_nic(""); }},
  };
  for (const Case& c : cases) {
    SegmentDescriptor d = Good();
    c.spoil(&d);
    absl::Status s = ValidateSegmentDescriptor(d);
    EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.message().find(c.field), absl::string_view::npos)
        << "expected the message to name " << c.field << ": " << s;
  }
}

// A descriptor within every per-field limit must still not make its
// readers build a huge index (found in review: 8 transports x 64 devices x
// 65,536 buffers, 519 KB on the wire, cost every reader 256 MiB).
TEST(ValidationTest, BoundsTheKeyIndexReadersBuild) {
  SegmentDescriptor d;
  d.set_name("wide");
  for (int t = 0; t < 8; ++t) {
    TransportEndpoint* ep = d.add_transports();
    ep->set_transport("t" + std::to_string(t));
    for (int k = 0; k < 64; ++k) {
      ep->add_devices()->set_name("nic" + std::to_string(k));
    }
  }
  for (uint64_t i = 0; i < 65536; ++i) {
    Buffer* b = d.add_buffers();
    b->set_addr((i + 1) << 12);
    b->set_length(4096);
  }
  absl::Status s = ValidateSegmentDescriptor(d);
  EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("key index"), absl::string_view::npos) << s;
}

TEST(ValidationTest, RdmaNeedsNoAddressButAnyGivenMustParse) {
  SegmentDescriptor d = Good();
  EXPECT_OK(ValidateSegmentDescriptor(d));  // rdma has no address.
  d.mutable_transports(1)->set_address("10.0.0.2:4791");
  EXPECT_OK(ValidateSegmentDescriptor(d));
  d.mutable_transports(1)->set_address("10.0.0.2");
  EXPECT_STATUS(ValidateSegmentDescriptor(d),
                absl::StatusCode::kInvalidArgument);
}

TEST(ValidationTest, AcceptsIpv6Endpoints) {
  SegmentDescriptor d = Good();
  d.set_rpc_address("[fd00::2]:17100");
  d.mutable_transports(0)->set_address("[fd00::2]:17101");
  EXPECT_OK(ValidateSegmentDescriptor(d));
}

TEST(CheckReachableTest, LoopbackFromAnotherHostIsRefusedWithTheFix) {
  SegmentDescriptor d = Good();
  d.set_network_id("boot-a/net:1");
  EXPECT_OK(CheckReachable(d, "boot-b/net:2"));  // Routable addresses.
  for (auto spoil : std::vector<std::function<void(SegmentDescriptor*)>>{
           [](auto* d) { d->set_rpc_address("127.0.0.1:17100"); },
           [](auto* d) { d->set_rpc_address("[::1]:17100"); },
           [](auto* d) {
             d->mutable_transports(0)->set_address("127.0.1.1:17101");
           }}) {
    SegmentDescriptor bad = Good();
    bad.set_network_id("boot-a/net:1");
    spoil(&bad);
    // The same host and namespace shares loopback.
    EXPECT_OK(CheckReachable(bad, "boot-a/net:1"));
    absl::Status s = CheckReachable(bad, "boot-a/net:2");
    EXPECT_STATUS(s, absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("loopback"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("advertise_host"), absl::string_view::npos) << s;
    // Descriptors of engines that do not say where they run pass.
    bad.clear_network_id();
    EXPECT_OK(CheckReachable(bad, "boot-a/net:2"));
  }
}

}  // namespace
}  // namespace ferry::descriptor
