// Fuzz target: the bytes an initiator (or anyone) sends to the TCP
// transport's target side. Drives ServerSession, the target's frame state
// machine, exactly as the server does, with the input cut into reads and
// the output taken in pieces, over a registered buffer at a fixed address.
//
// Input: byte 0 sets the read size, byte 1 the send size, byte 2 the clock
// step (ms); the rest is the byte stream from the peer.
//
// Checked: request headers decode only if they re-encode to the same bytes;
// no access outside the remote-accessible buffer (guard pages, and a
// registered but not remote-accessible buffer that must stay untouched);
// the output is a sequence of valid response frames; every lease is given
// back when the session ends.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/time/time.h"
#include "transport/memory_registry.h"
#include "transport/tcp/fuzz/fuzz_memory.h"
#include "transport/tcp/server_session.h"
#include "transport/tcp/wire.h"

namespace {

using ferry::MemoryRegion;
using ferry::MemoryRegistry;
using ferry::tcp::ServerSession;
namespace fuzz = ferry::tcp::fuzz;
namespace tcp = ferry::tcp;

constexpr size_t kRemoteBytes = fuzz::kFuzzBytes / 2;
constexpr uint8_t kPrivateFill = 0xa5;

struct World {
  uintptr_t base = 0;
  MemoryRegistry registry;
  MemoryRegion remote;
  MemoryRegion priv;
};

World* GetWorld() {
  static World* w = [] {
    auto* w = new World;
    w->base = fuzz::MapFuzzMemory();
    if (w->base == 0) __builtin_trap();
    w->remote.addr = w->base;
    w->remote.length = kRemoteBytes;
    w->remote.remote_accessible = true;
    w->priv.addr = w->base + kRemoteBytes;
    w->priv.length = fuzz::kFuzzBytes - kRemoteBytes;
    w->priv.remote_accessible = false;
    static const ferry::tcp::BufferKey key{fuzz::kFuzzKey};
    if (!w->registry.Add(w->remote, {&key}).ok() ||
        !w->registry.Add(w->priv).ok()) {
      __builtin_trap();
    }
    std::memset(reinterpret_cast<void*>(w->priv.addr), kPrivateFill,
                w->priv.length);
    return w;
  }();
  return w;
}

void CheckHeaderCodecs(const uint8_t* data, size_t size) {
  if (size >= tcp::kRequestHeaderBytes) {
    tcp::RequestHeader h;
    if (tcp::DecodeRequest(data, &h).ok()) {
      uint8_t again[tcp::kRequestHeaderBytes];
      tcp::EncodeRequest(h, again);
      if (std::memcmp(again, data, sizeof(again)) != 0) __builtin_trap();
    }
  }
  if (size >= tcp::kResponseHeaderBytes) {
    tcp::ResponseHeader h;
    if (tcp::DecodeResponse(data, &h).ok()) {
      uint8_t again[tcp::kResponseHeaderBytes];
      tcp::EncodeResponse(h, again);
      if (std::memcmp(again, data, sizeof(again)) != 0) __builtin_trap();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  CheckHeaderCodecs(data, size);
  if (size < 3) return 0;
  World* w = GetWorld();
  const size_t read_size = data[0] == 0 ? 65536 : data[0];
  const size_t send_size = data[1] == 0 ? 65536 : data[1];
  // The top bit: a session under a token, which must refuse whatever the
  // input holds in place of a proof (it cannot know the fresh challenge).
  const absl::Duration step = absl::Milliseconds(data[2] & 0x7f);
  const bool token = (data[2] & 0x80) != 0;
  data += 3;
  size -= 3;

  ServerSession::Limits limits;
  limits.handshake_timeout = absl::Seconds(1);
  limits.idle_timeout = absl::Seconds(2);
  limits.frame_timeout = absl::Milliseconds(500);
  absl::Time now = absl::FromUnixSeconds(1);
  std::string out;
  {
    ServerSession s(&w->registry, limits, fuzz::kFuzzIncarnation, now,
                    /*gpu_staging=*/nullptr,
                    token ? "fuzz-cluster-token-0123" : "");
    size_t off = 0;
    while (true) {
      // Input, as the server reads it.
      if (off < size && s.wants_input()) {
        auto [buf, len] = s.InputBuffer();
        if (buf == nullptr || len == 0) __builtin_trap();
        const size_t n = std::min({len, read_size, size - off});
        std::memcpy(buf, data + off, n);
        off += n;
        if (!s.OnReceived(n, now).ok()) break;
      }
      // Output, a piece at a time.
      if (s.has_output()) {
        iovec iov[64];
        const int n = s.PrepareOutput(iov, 64);
        if (n <= 0) __builtin_trap();
        size_t taken = 0;
        for (int i = 0; i < n && taken < send_size; ++i) {
          const size_t k = std::min(iov[i].iov_len, send_size - taken);
          out.append(static_cast<const char*>(iov[i].iov_base), k);
          taken += k;
        }
        if (!s.OnSent(taken, now).ok()) break;
      } else if (off >= size || !s.wants_input()) {
        if (!s.wants_input()) __builtin_trap();  // Paused with no output.
        break;
      }
      now += step;
      if (!s.CheckTimeouts(now).ok()) break;
    }
    if (token && s.requests() > 0) __builtin_trap();  // Served, unproven.
  }
  // Every request's lease was given back with the session.
  if (!w->registry.Remove(w->remote.addr, absl::ZeroDuration()).ok() ||
      !w->registry.Add(w->remote).ok()) {
    __builtin_trap();
  }
  // Nothing landed in memory that is registered but not remote-accessible.
  const auto* priv = reinterpret_cast<const uint8_t*>(w->priv.addr);
  for (size_t i = 0; i < w->priv.length; ++i) {
    if (priv[i] != kPrivateFill) __builtin_trap();
  }
  // The output is response frames (the last one may be cut short where
  // the session stopped).
  size_t off = 0;
  while (off + tcp::kResponseHeaderBytes <= out.size()) {
    tcp::ResponseHeader h;
    if (!tcp::DecodeResponse(reinterpret_cast<const uint8_t*>(out.data()) + off,
                             &h)
             .ok()) {
      __builtin_trap();
    }
    off += tcp::kResponseHeaderBytes + h.length;
  }
  return 0;
}
