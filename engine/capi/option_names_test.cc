#include "engine/capi/option_names.h"

#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "common/status_testing.h"
#include "engine/capi/stats_json.h"
#include "gtest/gtest.h"

namespace ferry::capi {
namespace {

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  std::ifstream in(std::string(srcdir != nullptr ? srcdir : ".") + "/" +
                   (ws != nullptr ? ws : "ferry") + "/" + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The fields of `struct name { ... };` in `header`: (type, field) pairs of
// its member declarations, comments skipped.
std::vector<std::pair<std::string, std::string>> Fields(
    const std::string& header, const std::string& name) {
  std::vector<std::pair<std::string, std::string>> out;
  const std::string text = Runfile(header);
  const size_t begin = text.find("\nstruct " + name + " {");
  EXPECT_NE(begin, std::string::npos) << name << " in " << header;
  const size_t end = text.find("\n};", begin);
  std::istringstream body(text.substr(begin, end - begin));
  // Two-space indented "Type name;" or "Type name = value;", perhaps with
  // a comment after it.
  const std::regex decl(
      R"(^  ([A-Za-z_][\w:<>, ]*?[\w>*]) (\w+)( = [^;]*)?;( *//.*)?$)");
  std::string line;
  std::smatch m;
  while (std::getline(body, line)) {
    if (std::regex_match(line, m, decl)) out.emplace_back(m[1], m[2]);
  }
  return out;
}

// The name each field must have.
std::set<std::string> ExpectedNames() {
  std::set<std::string> names;
  auto add = [&](const std::string& prefix, const std::string& header,
                 const std::string& strct) {
    for (const auto& [type, field] : Fields(header, strct)) {
      if (type == "TcpOptions" || type == "RdmaOptions" ||
          type == "ShmOptions" || type == "metadata::EtcdLimits" ||
          type == "Clock*") {
        continue;  // Nested (named below), or not a string.
      }
      std::string name = prefix + field;
      if (type == "absl::Duration")
        name += field == "wait_spin" ? "_us" : "_ms";
      names.insert(name);
    }
  };
  add("", "include/ferry/transfer_engine.h", "EngineOptions");
  add("tcp.", "include/ferry/options.h", "TcpOptions");
  add("rdma.", "include/ferry/options.h", "RdmaOptions");
  add("shm.", "include/ferry/options.h", "ShmOptions");
  add("etcd.", "include/ferry/etcd_limits.h", "EtcdLimits");
  return names;
}

TEST(OptionNamesTest, EveryFieldHasAName) {
  const std::set<std::string> expected = ExpectedNames();
  ASSERT_GT(expected.size(), 60u);  // The parse found the structs.
  const std::vector<std::string> names = OptionNames();
  const std::set<std::string> got(names.begin(), names.end());
  for (const std::string& n : expected) {
    EXPECT_TRUE(got.count(n)) << "field without a name: " << n;
  }
  for (const std::string& n : got) {
    EXPECT_TRUE(expected.count(n)) << "name of no field: " << n;
  }
}

TEST(OptionNamesTest, EveryOptionRoundTripsItsDefault) {
  EngineOptions o;
  for (const std::string& name : OptionNames()) {
    ASSERT_OK_AND_ASSIGN(std::string v, GetOption(o, name));
    ASSERT_OK(SetOption(o, name, v)) << name;
    EXPECT_EQ(*GetOption(o, name), v) << name;
  }
}

TEST(OptionNamesTest, ValuesReachTheirFields) {
  EngineOptions o;
  ASSERT_OK(SetOption(o, "rdma.slice_bytes", "131072"));
  EXPECT_EQ(o.rdma.slice_bytes, 131072u);
  ASSERT_OK(SetOption(o, "rdma.stripe_bytes", "0"));
  EXPECT_EQ(o.rdma.stripe_bytes, 0u);
  ASSERT_OK(SetOption(o, "shm.copy_threads", "4"));
  EXPECT_EQ(o.shm.copy_threads, 4);
  ASSERT_OK(SetOption(o, "shm.unregister_wait_ms", "250"));
  EXPECT_EQ(o.shm.unregister_wait, absl::Milliseconds(250));
  ASSERT_OK(SetOption(o, "tcp.frame_timeout_ms", "2500"));
  EXPECT_EQ(o.tcp.frame_timeout, absl::Milliseconds(2500));
  ASSERT_OK(SetOption(o, "wait_spin_us", "0"));
  EXPECT_EQ(o.wait_spin, absl::ZeroDuration());
  ASSERT_OK(SetOption(o, "rdma.gpu_staging", "false"));
  EXPECT_FALSE(o.rdma.gpu_staging);
  ASSERT_OK(SetOption(o, "rdma.worker_cpus", "0, 2"));
  EXPECT_EQ(o.rdma.worker_cpus, (std::vector<int>{0, 2}));
  ASSERT_OK(SetOption(o, "rdma_devices", "mlx5_0,mlx5_1"));  // Old name.
  EXPECT_EQ(o.rdma.devices, (std::vector<std::string>{"mlx5_0", "mlx5_1"}));
  ASSERT_OK(SetOption(o, "tcp.port", "65535"));
  EXPECT_EQ(o.tcp.port, 65535);
}

TEST(OptionNamesTest, BadNamesAndValuesSayWhich) {
  EngineOptions o;
  absl::Status s = SetOption(o, "rpc_port", "70000");
  EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "rpc_port")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "0..65535")) << s;
  EXPECT_EQ(o.rpc_port, 0);
  EXPECT_STATUS(SetOption(o, "rdma.slice_bytes", "-1"),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(SetOption(o, "rdma.fork_safe", "yes"),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(SetOption(o, "rdma.worker_cpus", "0,x"),
                absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(SetOption(o, "transfer_timeout_ms", "1.5"),
                absl::StatusCode::kInvalidArgument);
  s = SetOption(o, "rdma.nope", "1");
  EXPECT_STATUS(s, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "unknown")) << s;
  EXPECT_STATUS(GetOption(o, "rdma.nope").status(),
                absl::StatusCode::kNotFound);
}

TEST(StatsJsonTest, EveryCounterIsThere) {
  TransportStats t;
  t.transport = "rdma";
  t.nics.emplace_back().name = "mlx5_\"0";  // Quoted in the output.
  t.staging_copy_bytes = 12345;
  EngineStats e;
  e.mr_cache_evictions = 678;
  const std::string json = StatsJson(e, {t, TransportStats()});
  size_t fields = 0;
  for (const auto& [header, strct] :
       std::vector<std::pair<std::string, std::string>>{
           {"include/ferry/transfer_engine.h", "EngineStats"},
           {"include/ferry/stats.h", "TransportStats"},
           {"include/ferry/stats.h", "NicStats"}}) {
    for (const auto& [type, field] : Fields(header, strct)) {
      ++fields;
      EXPECT_TRUE(absl::StrContains(json, "\"" + field + "\":"))
          << strct << "." << field << " is not in " << json;
    }
  }
  EXPECT_GT(fields, 40u);
  EXPECT_TRUE(absl::StrContains(json, "\"staging_copy_bytes\":12345"));
  EXPECT_TRUE(absl::StrContains(json, "\"mr_cache_evictions\":678"));
  EXPECT_TRUE(absl::StrContains(json, "\"name\":\"mlx5_\\\"0\""));
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
}

}  // namespace
}  // namespace ferry::capi
