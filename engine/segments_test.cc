// Segments through the public API against hostile or changing metadata:
// forged descriptors, descriptors that change under requests, closing.
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/happens_before.h"
#include "common/mutex.h"
#include "common/simulated_clock.h"
#include "common/status_testing.h"
#include "ferry/transfer_engine.h"
#include "gtest/gtest.h"
#include "metadata/grpc_status.h"
#include "metadata/proto/metadata.grpc.pb.h"
#include "metadata/rpc_server.h"
#include "metadata/segment_store.h"

namespace ferry {
namespace {

// A metadata service that stores what engines publish, like the real one,
// but serves forged descriptors for chosen names: what anyone who can reach
// a metadata service can do, since nothing authenticates descriptors.
class ForgingMetadataService final
    : public metadata::MetadataService::WithCallbackMethod_WatchSegment<
          metadata::MetadataService::Service> {
 public:
  void Forge(const descriptor::SegmentDescriptor& d) {
    MutexLock lock(&mu_);
    forged_[d.name()] = d;
  }
  int gets() {
    MutexLock lock(&mu_);
    return gets_;
  }
  // While closed, GetSegment blocks (up to 10 s): a metadata service that
  // is slow or unreachable.
  void CloseGate() {
    MutexLock lock(&mu_);
    gate_open_ = false;
  }
  void OpenGate() {
    MutexLock lock(&mu_);
    gate_open_ = true;
    gate_cv_.SignalAll();
  }
  int blocked() {
    MutexLock lock(&mu_);
    return blocked_;
  }

  grpc::Status PutSegment(grpc::ServerContext*,
                          const metadata::PutSegmentRequest* req,
                          metadata::PutSegmentResponse* resp) override {
    auto v = store_.Put(*req);
    if (!v.ok()) return metadata::ToGrpcStatus(v.status());
    resp->set_version(*v);
    return grpc::Status::OK;
  }
  grpc::Status UpdateBuffers(grpc::ServerContext*,
                             const metadata::UpdateBuffersRequest* req,
                             metadata::UpdateBuffersResponse* resp) override {
    auto v = store_.UpdateBuffers(*req);
    if (!v.ok()) return metadata::ToGrpcStatus(v.status());
    resp->set_version(*v);
    return grpc::Status::OK;
  }
  grpc::Status GetSegment(grpc::ServerContext*,
                          const metadata::GetSegmentRequest* req,
                          metadata::GetSegmentResponse* resp) override {
    {
      MutexLock lock(&mu_);
      ++gets_;
      const absl::Time until = absl::Now() + absl::Seconds(10);
      ++blocked_;
      while (!gate_open_ && !gate_cv_.WaitWithDeadline(&mu_, until)) {
      }
      --blocked_;
      auto it = forged_.find(req->name());
      if (it != forged_.end()) {
        *resp->mutable_segment() = it->second;
        return grpc::Status::OK;
      }
    }
    auto d = store_.Get(req->name());
    if (!d.ok()) return metadata::ToGrpcStatus(d.status());
    *resp->mutable_segment() = *d;
    return grpc::Status::OK;
  }
  grpc::Status RemoveSegment(grpc::ServerContext*,
                             const metadata::RemoveSegmentRequest* req,
                             metadata::RemoveSegmentResponse*) override {
    return metadata::ToGrpcStatus(store_.Remove(*req));
  }

  // Off by default (the stream ends UNIMPLEMENTED, so engines refresh on a
  // miss). On: one stream that writes what Push queues, as a metadata
  // service that pushes forged changes would.
  void EnableWatch() {
    MutexLock lock(&mu_);
    watchable_ = true;
  }
  void Push(const metadata::SegmentEvent& ev) {
    MutexLock lock(&mu_);
    pushes_.push_back(ev);
    if (reactor_ != nullptr) reactor_->Poked();
  }
  int watchers() {
    MutexLock lock(&mu_);
    return watchers_;
  }
  absl::StatusOr<descriptor::SegmentDescriptor> Current(const std::string& n) {
    return store_.Get(n);
  }
  // The stream (gRPC's callback API, as the real service serves it: a
  // sync-API stream's writer is made by gRPC threads TSan cannot see).
  class PushReactor final
      : public grpc::ServerWriteReactor<metadata::SegmentEvent> {
   public:
    explicit PushReactor(ForgingMetadataService* s) : s_(s) {
      MutexLock lock(&s_->mu_);
      s_->reactor_ = this;
      ++s_->watchers_;
      NextLocked();
      HappensBefore(this);
    }
    // From Push, which holds the service's mu_ (the analysis cannot tie it
    // to s_->mu_).
    void Poked() {
      s_->mu_.AssertHeld();
      NextLocked();
    }
    // Writes the next queued event unless a write is out.
    void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
      if (writing_ || done_ || s_->pushes_.empty()) return;
      event_ = std::move(s_->pushes_.front());
      s_->pushes_.pop_front();
      writing_ = true;
      StartWrite(&event_);
    }
    void OnWriteDone(bool ok) override {
      HappensAfter(this);
      MutexLock lock(&s_->mu_);
      writing_ = false;
      if (!ok) {
        FinishLocked();
      } else {
        NextLocked();
      }
    }
    void OnCancel() override {
      HappensAfter(this);
      MutexLock lock(&s_->mu_);
      FinishLocked();
    }
    void OnDone() override {
      HappensAfter(this);
      {
        MutexLock lock(&s_->mu_);
        s_->reactor_ = nullptr;
        --s_->watchers_;
      }
      delete this;
    }

   private:
    void FinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu_) {
      if (done_) return;
      done_ = true;
      Finish(grpc::Status::OK);
    }
    ForgingMetadataService* const s_;
    metadata::SegmentEvent event_;
    bool writing_ = false;
    bool done_ = false;
  };
  grpc::ServerWriteReactor<metadata::SegmentEvent>* WatchSegment(
      grpc::CallbackServerContext*,
      const metadata::WatchSegmentRequest*) override {
    HappensAfter(static_cast<grpc::Service*>(this));
    {
      MutexLock lock(&mu_);
      if (!watchable_ || reactor_ != nullptr) {
        class Refused final
            : public grpc::ServerWriteReactor<metadata::SegmentEvent> {
         public:
          Refused() {
            Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no watch"));
          }
          void OnDone() override { delete this; }
        };
        return new Refused();
      }
    }
    return new PushReactor(this);
  }

  metadata::SegmentStore store_;
  Mutex mu_;
  std::map<std::string, descriptor::SegmentDescriptor> forged_
      ABSL_GUARDED_BY(mu_);
  int gets_ ABSL_GUARDED_BY(mu_) = 0;
  bool gate_open_ ABSL_GUARDED_BY(mu_) = true;
  int blocked_ ABSL_GUARDED_BY(mu_) = 0;
  CondVar gate_cv_;
  bool watchable_ ABSL_GUARDED_BY(mu_) = false;
  int watchers_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<metadata::SegmentEvent> pushes_ ABSL_GUARDED_BY(mu_);
  PushReactor* reactor_ ABSL_GUARDED_BY(mu_) = nullptr;
};

class SegmentsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = metadata::RpcServer::Start("127.0.0.1:0", {&service_});
    ASSERT_OK(server);
    server_ = std::move(*server);
    EngineOptions t;
    t.local_segment_name = "target";
    t.metadata_endpoint = server_->address();
    ASSERT_OK(target_.Init(t));
    EngineOptions i;
    i.local_segment_name = "initiator";
    i.metadata_endpoint = server_->address();
    i.transfer_timeout = absl::Seconds(5);
    ASSERT_OK(initiator_.Init(i));
    remote_.assign(1 << 20, 0);
    local_.assign(1 << 20, 0);
    ASSERT_OK(target_.RegisterLocalMemory(remote_.data(), remote_.size()));
    ASSERT_OK(initiator_.RegisterLocalMemory(local_.data(), local_.size()));
  }

  // Writes `len` bytes of `fill` to the target and waits for the result.
  BatchStatus Write(SegmentHandle seg, uint64_t remote, size_t len,
                    uint8_t fill) {
    std::memset(local_.data(), fill, len);
    TransferRequest r;
    r.opcode = OpCode::kWrite;
    r.source = local_.data();
    r.target_id = seg;
    r.target_offset = remote;
    r.length = len;
    auto batch = initiator_.AllocateBatch(1);
    EXPECT_OK(batch);
    EXPECT_OK(initiator_.SubmitTransfer(*batch, {r}));
    auto st = initiator_.WaitBatch(*batch, absl::Seconds(20));
    EXPECT_OK(st);
    EXPECT_OK(initiator_.FreeBatch(*batch));
    return st.ok() ? *st : BatchStatus{};
  }

  uint64_t RemoteAddr() const {
    return reinterpret_cast<uint64_t>(remote_.data());
  }

  ForgingMetadataService service_;
  std::unique_ptr<metadata::RpcServer> server_;
  TransferEngine target_, initiator_;
  // Starts `engine` ("quick") on `clock` and submits one 64-byte WRITE to
  // "target" in a new batch (`*batch`) that parks: the metadata service's
  // gate is closed, so the descriptor fetch it waits for stays stuck (the
  // caller opens the gate).
  void ParkOneWrite(SimulatedClock* clock, absl::Duration transfer_timeout,
                    TransferEngine* engine, BatchId* batch) {
    EngineOptions o;
    o.local_segment_name = "quick";
    o.metadata_endpoint = server_->address();
    o.transfer_timeout = transfer_timeout;
    o.rpc_timeout = absl::Seconds(10);  // The stuck fetch outlasts the test.
    o.clock = clock;
    ASSERT_OK(engine->Init(o));
    ASSERT_OK(engine->RegisterLocalMemory(local_.data(), 4096, "*", false));
    ASSERT_OK_AND_ASSIGN(SegmentHandle seg, engine->OpenSegment("target"));
    service_.CloseGate();
    ASSERT_OK_AND_ASSIGN(*batch, engine->AllocateBatch(1));
    TransferRequest r{OpCode::kWrite, local_.data(), seg, 0x10, 64};
    ASSERT_OK(engine->SubmitTransfer(*batch, {r}));
  }

  std::vector<uint8_t> remote_, local_;
};

// Reproduced on the unvalidated engine: a TCP endpoint of "nohost" left a
// null connection pool that the TCP transport's reaper dereferenced.
TEST_F(SegmentsTest, ForgedDescriptorFailsOpenSegmentAndChangesNothing) {
  descriptor::SegmentDescriptor forged;
  forged.set_name("forged");
  forged.set_incarnation(1);
  auto* tcp = forged.add_transports();
  tcp->set_transport("tcp");
  tcp->set_address("nohost");
  auto* b = forged.add_buffers();
  b->set_addr(0x10000);
  b->set_length(0x10000);
  service_.Forge(forged);
  const std::vector<TransportStats> before = initiator_.GetTransportStats();

  auto h = initiator_.OpenSegment("forged");
  EXPECT_STATUS(h, absl::StatusCode::kInvalidArgument);
  EXPECT_NE(h.status().message().find("transports[0] ('tcp').address"),
            absl::string_view::npos)
      << h.status();
  if (h.ok()) {
    // What the unvalidated engine then did: use it (and crash).
    std::vector<uint8_t> buf(64);
    TransferRequest r{OpCode::kWrite, local_.data(), *h, 0x10000, 64};
    auto batch = initiator_.AllocateBatch(1);
    ASSERT_OK(batch);
    EXPECT_OK(initiator_.SubmitTransfer(*batch, {r}));
    initiator_.WaitBatch(*batch, absl::Seconds(10)).IgnoreError();
    absl::SleepFor(absl::Milliseconds(100));  // Let the reaper run.
  }
  // Nothing else changed: no connection was opened, and the engine still
  // works with a good segment.
  const std::vector<TransportStats> after = initiator_.GetTransportStats();
  ASSERT_EQ(after.size(), before.size());
  EXPECT_EQ(after[0].connects_started, before[0].connects_started);
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, initiator_.OpenSegment("target"));
  EXPECT_EQ(Write(seg, RemoteAddr(), 4096, 0x5a).state,
            TransferState::kCompleted);
  EXPECT_EQ(remote_[4095], 0x5a);
}

// Each kind of forged field is refused by OpenSegment with its name.
// A pushed change is checked before it touches the watch's base: one
// naming another segment, or one that makes the descriptor invalid, is
// refused, and deltas after a refused one are not applied to a base the
// service no longer shares (they were, and corrupted it); a whole
// descriptor then resynchronizes.
TEST_F(SegmentsTest, PushedChangesAreCheckedBeforeTheyApply) {
  service_.EnableWatch();
  ASSERT_OK_AND_ASSIGN(SegmentHandle h, initiator_.OpenSegment("target"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (service_.watchers() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(service_.watchers(), 1);
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor real,
                       service_.Current("target"));
  ASSERT_EQ(real.buffers_size(), 1);
  const uint64_t v = real.version();
  auto wait_pushes = [&](uint64_t n) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (initiator_.GetEngineStats().descriptor_pushes < n &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return initiator_.GetEngineStats().descriptor_pushes;
  };

  // A delta that removes the real buffer and adds a zero-length one...
  metadata::SegmentEvent bad;
  bad.set_version(v + 1);
  bad.add_remove_addrs(real.buffers(0).addr());
  descriptor::Buffer* zero = bad.add_add();
  zero->set_addr(0x10000);
  zero->set_length(0);
  zero->set_location("cpu:0");
  service_.Push(bad);
  // ...then one that would make that base valid again, without the real
  // buffer.
  metadata::SegmentEvent follow;
  follow.set_version(v + 2);
  follow.add_remove_addrs(0x10000);
  descriptor::Buffer* other = follow.add_add();
  other->set_addr(0x20000);
  other->set_length(4096);
  other->set_location("cpu:0");
  service_.Push(follow);
  metadata::SegmentEvent whole;
  *whole.mutable_full() = real;
  whole.mutable_full()->set_version(v + 3);
  whole.set_version(v + 3);
  service_.Push(whole);
  EXPECT_EQ(wait_pushes(1), 1u);

  // A whole descriptor of another segment.
  ASSERT_OK_AND_ASSIGN(descriptor::SegmentDescriptor stranger,
                       service_.Current("initiator"));
  metadata::SegmentEvent swap;
  *swap.mutable_full() = stranger;
  swap.mutable_full()->set_version(v + 4);
  swap.set_version(v + 4);
  service_.Push(swap);
  whole.mutable_full()->set_version(v + 5);
  whole.set_version(v + 5);
  service_.Push(whole);
  EXPECT_EQ(wait_pushes(2), 2u);
  // Only the two whole descriptors of "target" were applied.
  EXPECT_EQ(initiator_.GetEngineStats().descriptor_pushes, 2u);
  EXPECT_EQ(Write(h, RemoteAddr(), 64, 0x5a).state, TransferState::kCompleted);
  EXPECT_EQ(remote_[63], 0x5a);
}

TEST_F(SegmentsTest, EveryForgedFieldIsNamed) {
  struct Case {
    const char* name;
    const char* field;
    void (*spoil)(descriptor::SegmentDescriptor*);
  };
  const Case cases[] = {
      {"f1", "rpc_address",
       [](descriptor::SegmentDescriptor* d) { d->set_rpc_address("x"); }},
      {"f2", "buffers[1]",
       [](descriptor::SegmentDescriptor* d) {
         auto* b = d->add_buffers();
         b->set_addr(0x18000);
         b->set_length(0x1000);
       }},
      {"f3", "buffers[0].keys[0].nic",
       [](descriptor::SegmentDescriptor* d) {
         d->mutable_buffers(0)->add_keys()->set_nic("mlx5_9");
       }},
      {"f4", "transports[1].transport",
       [](descriptor::SegmentDescriptor* d) {
         *d->add_transports() = d->transports(0);
       }},
  };
  for (const Case& c : cases) {
    descriptor::SegmentDescriptor d;
    d.set_name(c.name);
    d.set_incarnation(1);
    auto* tcp = d.add_transports();
    tcp->set_transport("tcp");
    tcp->set_address("127.0.0.1:9");
    auto* b = d.add_buffers();
    b->set_addr(0x10000);
    b->set_length(0x10000);
    c.spoil(&d);
    service_.Forge(d);
    auto h = initiator_.OpenSegment(c.name);
    EXPECT_STATUS(h, absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(h.status().message().find(c.field), absl::string_view::npos)
        << h.status();
  }
}

// SubmitTransfer never waits on the metadata service: a request that misses
// its buffer in the cached descriptor waits for a background fetch, and
// however many such requests come, fetches are rate-limited per segment.
TEST_F(SegmentsTest, MissesNeverBlockSubmitAndFetchesAreRateLimited) {
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, initiator_.OpenSegment("target"));
  // A buffer the initiator's cached descriptor does not have yet.
  std::vector<uint8_t> late(1 << 16, 0);
  ASSERT_OK(target_.RegisterLocalMemory(late.data(), late.size()));
  const uint64_t late_addr = reinterpret_cast<uint64_t>(late.data());
  service_.CloseGate();
  const int gets_before = service_.gets();
  constexpr int kRequests = 200;
  std::vector<BatchId> batches;
  std::memset(local_.data(), 0x6b, 64);
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_OK_AND_ASSIGN(BatchId b, initiator_.AllocateBatch(1));
    TransferRequest r{OpCode::kWrite, local_.data(), seg,
                      late_addr + static_cast<uint64_t>(i) * 64, 64};
    // Would block (up to 10 s, the gate's bound) if it fetched inline.
    ASSERT_OK(initiator_.SubmitTransfer(b, {r}));
    batches.push_back(b);
  }
  // Every request was accepted while the metadata service was stuck.
  EXPECT_LE(service_.blocked(), 1);
  EXPECT_EQ(initiator_.GetEngineStats().requests_waiting_for_descriptor,
            static_cast<uint64_t>(kRequests));
  ASSERT_OK_AND_ASSIGN(TransferStatus t0,
                       initiator_.GetTransferStatus(batches[0], 0));
  EXPECT_EQ(t0.state, TransferState::kWaiting);
  service_.OpenGate();
  for (BatchId b : batches) {
    ASSERT_OK_AND_ASSIGN(BatchStatus st,
                         initiator_.WaitBatch(b, absl::Seconds(20)));
    EXPECT_EQ(st.state, TransferState::kCompleted) << st.first_error;
    EXPECT_OK(initiator_.FreeBatch(b));
  }
  EXPECT_EQ(late[kRequests * 64 - 1], 0x6b);
  // One fetch was in flight when the requests came; one more after it
  // serves all of them.
  EXPECT_LE(service_.gets() - gets_before, 3);
  const EngineStats st = initiator_.GetEngineStats();
  EXPECT_EQ(st.requests_waiting_for_descriptor, 0u);
  EXPECT_GE(st.requests_waited_for_descriptor,
            static_cast<uint64_t>(kRequests));
  ASSERT_OK(target_.UnregisterLocalMemory(late.data()));
}

// A parked request whose deadline passes while the metadata service is
// stuck ends TIMEOUT on time, not when the service answers. On a
// SimulatedClock: still waiting just before its deadline, TIMEOUT soon
// after it, while the fetch it waits for is still held at the gate.
TEST_F(SegmentsTest, ParkedRequestsTimeOutOnTime) {
  SimulatedClock clock;  // Outlives the engine.
  TransferEngine quick;
  constexpr absl::Duration kTimeout = absl::Milliseconds(300);
  BatchId b = 0;
  ParkOneWrite(&clock, kTimeout, &quick, &b);
  if (HasFatalFailure()) return;
  const absl::Time deadline = clock.Now() + kTimeout;
  auto state = [&] {
    auto ts = quick.GetTransferStatus(b, 0);
    return ts.ok() ? ts->state : TransferState::kFailed;
  };
  clock.AdvanceTo(deadline - absl::Milliseconds(1));
  EXPECT_EQ(state(), TransferState::kWaiting);
  // The refresher looks at parked deadlines every 10 ms of the clock; the
  // fetch stays blocked at the gate (10 s of real time) meanwhile.
  EXPECT_TRUE(
      clock.AdvanceUntil([&] { return state() != TransferState::kWaiting; },
                         absl::Milliseconds(100), absl::Milliseconds(1)))
      << "still waiting " << (clock.Now() - deadline) << " past the deadline";
  EXPECT_GE(clock.Now(), deadline);
  ASSERT_OK_AND_ASSIGN(BatchStatus st, quick.GetBatchStatus(b));
  service_.OpenGate();
  EXPECT_EQ(st.state, TransferState::kTimeout) << st.first_error;
  EXPECT_STATUS(st.first_error, absl::StatusCode::kDeadlineExceeded);
  EXPECT_OK(quick.FreeBatch(b));
  quick.Shutdown();
}

// WaitBatch gives up after its own timeout on the engine's clock, with
// DeadlineExceeded, while the request (parked, its fetch stuck) goes on.
TEST_F(SegmentsTest, WaitBatchTimesOutOnTheClock) {
  SimulatedClock clock;  // Outlives the engine.
  TransferEngine quick;
  BatchId b = 0;
  ParkOneWrite(&clock, absl::Seconds(30), &quick, &b);
  if (HasFatalFailure()) return;
  const absl::Time start = clock.Now();
  std::atomic<bool> returned{false};
  absl::Time returned_at;
  absl::StatusOr<BatchStatus> waited;
  std::thread waiter([&] {
    waited = quick.WaitBatch(b, absl::Milliseconds(100));
    returned_at = clock.Now();
    returned = true;
  });
  EXPECT_TRUE(clock.AdvanceUntil([&] { return returned.load(); },
                                 absl::Seconds(10), absl::Milliseconds(5)));
  waiter.join();
  EXPECT_STATUS(waited, absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(returned_at - start, absl::Milliseconds(100));
  ASSERT_OK_AND_ASSIGN(TransferStatus ts, quick.GetTransferStatus(b, 0));
  EXPECT_EQ(ts.state, TransferState::kWaiting);
  service_.OpenGate();
  quick.Shutdown();
}

// CloseSegment releases the handle and what the engine keeps for the
// peer; reopening works, and opening and closing many peers in turn keeps
// the engine's tables flat.
TEST_F(SegmentsTest, CloseSegmentInvalidatesHandleAndReleasesState) {
  ASSERT_OK_AND_ASSIGN(SegmentHandle seg, initiator_.OpenSegment("target"));
  EXPECT_EQ(Write(seg, RemoteAddr(), 4096, 1).state, TransferState::kCompleted);
  ASSERT_OK(initiator_.SendNotification(seg, "hi", "there"));
  EXPECT_EQ(initiator_.GetEngineStats().segments_open, 1u);
  EXPECT_EQ(initiator_.GetEngineStats().peer_channels, 1u);
  ASSERT_OK(initiator_.CloseSegment(seg));
  EXPECT_EQ(initiator_.GetEngineStats().segments_open, 0u);
  EXPECT_STATUS(initiator_.CloseSegment(seg), absl::StatusCode::kNotFound);
  TransferRequest r{OpCode::kWrite, local_.data(), seg, RemoteAddr(), 64};
  ASSERT_OK_AND_ASSIGN(BatchId b, initiator_.AllocateBatch(1));
  EXPECT_STATUS(initiator_.SubmitTransfer(b, {r}), absl::StatusCode::kNotFound);
  EXPECT_OK(initiator_.FreeBatch(b));
  ASSERT_OK_AND_ASSIGN(SegmentHandle again, initiator_.OpenSegment("target"));
  EXPECT_NE(again, seg);
  EXPECT_EQ(Write(again, RemoteAddr(), 4096, 2).state,
            TransferState::kCompleted);
  ASSERT_OK(initiator_.CloseSegment(again));
  EXPECT_EQ(initiator_.GetEngineStats().peer_channels, 0u);
}

// A receiver that does not take its notifications refuses more beyond its
// bounds (count and bytes), and accepts again once it took them.
TEST_F(SegmentsTest, NotificationQueueIsBoundedInBytes) {
  TransferEngine receiver;
  EngineOptions o;
  o.local_segment_name = "receiver";
  o.metadata_endpoint = server_->address();
  o.max_queued_notification_bytes = 1000;
  ASSERT_OK(receiver.Init(o));
  ASSERT_OK_AND_ASSIGN(SegmentHandle to, initiator_.OpenSegment("receiver"));
  const std::string msg(400, 'm');
  EXPECT_OK(initiator_.SendNotification(to, "a", msg));
  EXPECT_OK(initiator_.SendNotification(to, "b", msg));
  EXPECT_STATUS(initiator_.SendNotification(to, "c", msg),
                absl::StatusCode::kResourceExhausted);
  EngineStats st = receiver.GetEngineStats();
  EXPECT_EQ(st.notifications_queued, 2u);
  EXPECT_GE(st.notification_bytes_queued, 800u);
  EXPECT_EQ(st.notifications_refused, 1u);
  EXPECT_EQ(receiver.GetNotifications().size(), 2u);
  EXPECT_OK(initiator_.SendNotification(to, "d", msg));
  EXPECT_EQ(receiver.GetEngineStats().notification_bytes_queued,
            msg.size() + 1 + std::string("initiator").size());
  receiver.Shutdown();
}

}  // namespace
}  // namespace ferry
