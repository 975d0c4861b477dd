// Fuzz target: the requests an application hands SubmitTransfer, and the
// batch calls around them. Two real engines in this process (TCP over
// loopback, embedded metadata service); every input is a batch capacity,
// then requests of 24 bytes each:
//   u8 opcode | u8 source kind | u8 target kind | u8 flags
//   u32 source offset | u64 target offset | u32 length | u32 (unused)
// Source and target kinds pick registered, unregistered, null or arbitrary
// memory, so that every validation path is reached; lengths are bounded so
// that the transfers a valid request makes stay fast. Whatever the input:
// no crash, and an accepted batch ends within its deadline.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ferry/transfer_engine.h"

namespace {

constexpr size_t kBuffer = 1 << 20;
constexpr size_t kRequestBytes = 24;
constexpr size_t kMaxLength = 64 << 10;

struct World {
  ferry::TransferEngine target, initiator;
  std::vector<uint8_t> remote, local, unregistered;
  ferry::SegmentHandle seg = 0;
};

World* world = nullptr;

void Die(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  std::abort();
}

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  world = new World();
  world->remote.assign(kBuffer, 1);
  world->local.assign(kBuffer, 2);
  world->unregistered.assign(kBuffer, 3);
  ferry::EngineOptions t;
  t.local_segment_name = "fuzz-target";
  if (auto s = world->target.Init(t); !s.ok()) Die("target Init", s);
  ferry::EngineOptions i;
  i.local_segment_name = "fuzz-initiator";
  i.metadata_endpoint = world->target.metadata_address();
  i.transfer_timeout = absl::Seconds(5);
  i.max_batch_capacity = 256;
  if (auto s = world->initiator.Init(i); !s.ok()) Die("initiator Init", s);
  if (auto s = world->target.RegisterLocalMemory(world->remote.data(),
                                                 world->remote.size());
      !s.ok()) {
    Die("register remote", s);
  }
  if (auto s = world->initiator.RegisterLocalMemory(world->local.data(),
                                                    world->local.size());
      !s.ok()) {
    Die("register local", s);
  }
  auto seg = world->initiator.OpenSegment("fuzz-target");
  if (!seg.ok()) Die("OpenSegment", seg.status());
  world->seg = *seg;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  World& w = *world;
  const size_t capacity = 1 + data[0] % 255 + (data[1] == 0 ? 1000 : 0);
  data += 2;
  size -= 2;
  std::vector<ferry::TransferRequest> reqs;
  for (size_t off = 0; off + kRequestBytes <= size && reqs.size() < 64;
       off += kRequestBytes) {
    const uint8_t* r = data + off;
    ferry::TransferRequest q;
    q.opcode = static_cast<ferry::OpCode>(r[0] % 3);  // 2: not an opcode.
    const uint32_t src_off = Load<uint32_t>(r + 4);
    switch (r[1] % 4) {
      case 0:
        q.source = w.local.data() + src_off % kBuffer;
        break;
      case 1:
        q.source = w.unregistered.data() + src_off % kBuffer;
        break;
      case 2:
        q.source = nullptr;
        break;
      default:  // Never dereferenced unless it is registered memory.
        q.source = reinterpret_cast<void*>(uintptr_t{src_off} << 12);
    }
    const uint64_t tgt_off = Load<uint64_t>(r + 8);
    switch (r[2] % 4) {
      case 0:
        q.target_id = w.seg;
        q.target_offset =
            reinterpret_cast<uint64_t>(w.remote.data()) + tgt_off % kBuffer;
        break;
      case 1:
        q.target_id = w.seg;
        q.target_offset = tgt_off;
        break;
      case 2:
        q.target_id = tgt_off;  // A forged handle.
        q.target_offset = reinterpret_cast<uint64_t>(w.remote.data());
        break;
      default:
        q.target_id = w.seg ^ (uint64_t{1} << (r[3] % 64));
        q.target_offset = reinterpret_cast<uint64_t>(w.remote.data());
    }
    q.length = Load<uint32_t>(r + 16) % (kMaxLength + 1);
    reqs.push_back(q);
  }
  auto batch = w.initiator.AllocateBatch(capacity);
  if (!batch.ok()) return 0;
  absl::Status submitted = w.initiator.SubmitTransfer(*batch, reqs);
  // A forged batch id and out-of-range indexes must be refused cleanly.
  (void)w.initiator.GetTransferStatus(*batch ^ 0x100000000ull, 0);
  (void)w.initiator.GetTransferStatus(*batch, reqs.size() + 7);
  if (submitted.ok() && !reqs.empty()) {
    auto st = w.initiator.WaitBatch(*batch, absl::Seconds(30));
    if (!st.ok()) Die("accepted batch did not end in time", st.status());
  }
  if (auto s = w.initiator.FreeBatch(*batch); !s.ok()) Die("FreeBatch", s);
  if (w.initiator.FreeBatch(*batch).ok()) {
    Die("double free accepted", absl::InternalError(""));
  }
  return 0;
}
