// The C API's contract: statuses with codes and messages for every bad
// input, options by name, strings copied out, and the data path end to end
// (two engines in this process, over loopback).
#include "ferry/ferry_c.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace {

// Takes ownership of a status; the code, and the message for a failure.
struct Taken {
  int code;
  std::string message;
};
Taken Take(ferry_status* s) {
  Taken t{ferry_status_code(s), ferry_status_message(s)};
  ferry_status_free(s);
  return t;
}

#define EXPECT_C_OK(expr)                                        \
  do {                                                           \
    Taken t_ = Take(expr);                                       \
    EXPECT_EQ(t_.code, FERRY_OK) << #expr << ": " << t_.message; \
  } while (0)

ferry_engine* Start(const char* name, const std::string& metadata) {
  ferry_options* o = ferry_options_new();
  EXPECT_C_OK(ferry_options_set(o, "local_segment_name", name));
  EXPECT_C_OK(ferry_options_set(o, "listen_host", "127.0.0.1"));
  EXPECT_C_OK(ferry_options_set(o, "metadata_endpoint", metadata.c_str()));
  ferry_engine* e = nullptr;
  EXPECT_C_OK(ferry_engine_new(o, &e));
  ferry_options_free(o);
  return e;
}

TEST(FerryCTest, OptionsAreCheckedByName) {
  ferry_options* o = ferry_options_new();
  Taken t = Take(ferry_options_set(o, "no_such_option", "1"));
  EXPECT_EQ(t.code, FERRY_INVALID_ARGUMENT);
  EXPECT_NE(t.message.find("no_such_option"), std::string::npos) << t.message;
  t = Take(ferry_options_set(o, "rpc_port", "70000"));
  EXPECT_EQ(t.code, FERRY_INVALID_ARGUMENT);
  EXPECT_NE(t.message.find("rpc_port"), std::string::npos) << t.message;
  EXPECT_EQ(Take(ferry_options_set(o, "rpc_timeout_ms", "soon")).code,
            FERRY_INVALID_ARGUMENT);
  EXPECT_EQ(Take(ferry_options_set(o, "key", nullptr)).code,
            FERRY_INVALID_ARGUMENT);
  EXPECT_C_OK(ferry_options_set(o, "transports", "tcp"));
  EXPECT_C_OK(ferry_options_set(o, "metadata_endpoint", "redis://x:1"));
  ferry_engine* e = reinterpret_cast<ferry_engine*>(1);
  t = Take(ferry_engine_new(o, &e));
  EXPECT_EQ(t.code, FERRY_INVALID_ARGUMENT) << t.message;
  EXPECT_EQ(e, nullptr) << "no engine on failure";
  ferry_options_free(o);
  EXPECT_EQ(ferry_status_code(nullptr), FERRY_OK);
  EXPECT_STREQ(ferry_status_message(nullptr), "");
  ferry_status_free(nullptr);
}

TEST(FerryCTest, TransfersAndErrors) {
  ferry_engine* target = Start("capi-target", "embedded");
  ASSERT_NE(target, nullptr);
  char md[128];
  const size_t n = ferry_engine_metadata_address(target, md, sizeof(md));
  ASSERT_LT(n, sizeof(md));
  char tiny[4];
  EXPECT_EQ(ferry_engine_metadata_address(target, tiny, sizeof(tiny)), n);
  EXPECT_EQ(std::strlen(tiny), 3u) << "cut, NUL-terminated";
  ferry_engine* init = Start("capi-initiator", md);
  ASSERT_NE(init, nullptr);
  char name[64];
  ferry_engine_segment_name(init, name, sizeof(name));
  EXPECT_STREQ(name, "capi-initiator");

  std::vector<uint8_t> remote(8192, 0x5a), local(8192, 0);
  EXPECT_C_OK(
      ferry_register_memory(target, remote.data(), remote.size(), "cpu:0", 1));
  ferry_segment seg = 0;
  EXPECT_C_OK(ferry_open_segment(init, "capi-target", &seg));
  ferry_batch batch = 0;
  EXPECT_C_OK(ferry_batch_new(init, 4, &batch));
  // Local memory not registered: refused, naming the request.
  ferry_request r = {FERRY_READ, local.data(), seg,
                     reinterpret_cast<uint64_t>(remote.data()), 4096};
  Taken t = Take(ferry_submit(init, batch, &r, 1));
  EXPECT_EQ(t.code, FERRY_INVALID_ARGUMENT);
  EXPECT_NE(t.message.find("request 0"), std::string::npos) << t.message;
  ferry_request bad_op = r;
  bad_op.opcode = 7;
  EXPECT_EQ(Take(ferry_submit(init, batch, &bad_op, 1)).code,
            FERRY_INVALID_ARGUMENT);
  EXPECT_C_OK(
      ferry_register_memory(init, local.data(), local.size(), nullptr, 0));
  EXPECT_C_OK(ferry_submit(init, batch, &r, 1));
  ferry_batch_status st{};
  EXPECT_C_OK(ferry_batch_wait(init, batch, 10000, &st));
  EXPECT_EQ(st.state, FERRY_COMPLETED);
  EXPECT_EQ(st.transferred_bytes, 4096u);
  EXPECT_EQ(local[4095], 0x5a);
  // A remote range in no buffer: the batch fails, and the request says why.
  ferry_request outside = r;
  outside.target_offset = 0x10;
  EXPECT_C_OK(ferry_submit(init, batch, &outside, 1));
  EXPECT_C_OK(ferry_batch_wait(init, batch, 10000, &st));
  EXPECT_EQ(st.state, FERRY_FAILED);
  int state = -1;
  ferry_status* err = nullptr;
  EXPECT_C_OK(ferry_request_status(init, batch, 1, &state, nullptr, &err));
  EXPECT_EQ(state, FERRY_FAILED);
  t = Take(err);
  EXPECT_EQ(t.code, FERRY_INVALID_ARGUMENT);
  EXPECT_FALSE(t.message.empty());
  EXPECT_EQ(
      Take(ferry_request_status(init, batch, 9, &state, nullptr, nullptr)).code,
      FERRY_INVALID_ARGUMENT);
  EXPECT_C_OK(ferry_batch_free(init, batch));
  EXPECT_EQ(Take(ferry_batch_free(init, batch)).code, FERRY_INVALID_ARGUMENT)
      << "a freed batch";
  ferry_segment none = 0;
  EXPECT_EQ(Take(ferry_open_segment(init, "nobody", &none)).code,
            FERRY_NOT_FOUND);
  EXPECT_EQ(Take(ferry_open_segment(nullptr, "x", &none)).code,
            FERRY_INVALID_ARGUMENT);

  // Notifications: the bytes as sent, a NUL after them.
  const char msg[] = {'a', '\0', 'b'};
  EXPECT_C_OK(ferry_send_notification(init, seg, "kv-ready", msg, 3));
  ferry_notification* got = nullptr;
  size_t count = 0;
  EXPECT_C_OK(ferry_get_notifications(target, &got, &count));
  ASSERT_EQ(count, 1u);
  EXPECT_STREQ(got[0].from_segment, "capi-initiator");
  EXPECT_STREQ(got[0].name, "kv-ready");
  ASSERT_EQ(got[0].message_length, 3u);
  EXPECT_EQ(std::memcmp(got[0].message, msg, 3), 0);
  EXPECT_EQ(got[0].message[3], '\0');
  EXPECT_STREQ(got[0].sender_address, "ipv4:127.0.0.1");
  EXPECT_EQ(got[0].sender_verified, 1);
  ferry_notifications_free(got, count);
  EXPECT_C_OK(ferry_get_notifications(target, &got, &count));
  EXPECT_EQ(count, 0u);
  EXPECT_EQ(got, nullptr);

  // The segment's buffers, as the initiator sees them.
  ferry_remote_buffer* bufs = nullptr;
  EXPECT_C_OK(ferry_segment_buffers(init, seg, &bufs, &count));
  ASSERT_EQ(count, 1u);
  EXPECT_EQ(bufs[0].addr, reinterpret_cast<uint64_t>(remote.data()));
  EXPECT_EQ(bufs[0].length, remote.size());
  std::free(bufs);
  char rpc[128];
  ferry_engine_rpc_address(target, rpc, sizeof(rpc));
  EXPECT_STREQ(rpc, md) << "an embedded service is the engine's own server";
  // Batch registration: all or none.
  std::vector<uint8_t> more(3 * 4096);
  void* addrs[3] = {more.data(), more.data() + 4096, more.data() + 8192};
  size_t lens[3] = {4096, 4096, 4096};
  EXPECT_C_OK(ferry_register_memory_batch(init, addrs, lens, 3, "cpu:0", 1));
  size_t overlapping[3] = {4096, 8192, 4096};
  EXPECT_C_OK(ferry_unregister_memory_batch(init, addrs, 3));
  t = Take(
      ferry_register_memory_batch(init, addrs, overlapping, 3, nullptr, 1));
  EXPECT_EQ(t.code, FERRY_ALREADY_EXISTS) << t.message;
  EXPECT_EQ(Take(ferry_unregister_memory(init, addrs[0])).code, FERRY_NOT_FOUND)
      << "nothing stayed registered";
  EXPECT_C_OK(ferry_close_segment(init, seg));
  EXPECT_C_OK(ferry_unregister_memory(init, local.data()));
  EXPECT_EQ(Take(ferry_unregister_memory(init, local.data())).code,
            FERRY_NOT_FOUND);
  EXPECT_C_OK(ferry_unregister_memory(target, remote.data()));
  ferry_engine_free(init);
  ferry_engine_free(target);
}

// The topology goes through the public C++ API (TransferEngine::
// LocalTopology): a filter that names no NIC is NOT_FOUND, saying which,
// with no JSON to free. (The matrix itself: python/tests, on softrnic.)
TEST(FerryCTest, LocalTopologyOfNoNicIsNotFound) {
  char* json = reinterpret_cast<char*>(1);
  Taken t = Take(ferry_local_topology("no-such-nic", &json));
  EXPECT_EQ(t.code, FERRY_NOT_FOUND) << t.message;
  EXPECT_EQ(json, nullptr);
  EXPECT_EQ(Take(ferry_local_topology("", nullptr)).code,
            FERRY_INVALID_ARGUMENT);
}

}  // namespace
