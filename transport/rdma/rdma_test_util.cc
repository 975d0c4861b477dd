#include "transport/rdma/rdma_test_util.h"

#include <unistd.h>

#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "transport/rdma/rdma_transport.h"

namespace ferry::rdma::testing {

class FakePeerNetwork::Channel final : public PeerChannel {
 public:
  Channel(FakePeerNetwork* net, std::string segment, std::string address)
      : net_(net), segment_(std::move(segment)), address_(std::move(address)) {}
  void SetHandler(const std::string& transport, Handler handler) override {
    net_->SetHandler(address_, transport, std::move(handler));
  }
  void RemoveHandler(const std::string& transport) override {
    net_->RemoveHandler(address_, transport);
  }
  absl::StatusOr<std::string> Call(const std::string& address,
                                   const std::string& transport,
                                   const std::string& payload) override {
    return net_->Call(segment_, address, transport, payload);
  }

 private:
  FakePeerNetwork* const net_;
  const std::string segment_;
  const std::string address_;
};

FakePeerNetwork::~FakePeerNetwork() {
  MutexLock lock(&mu_);
  faults_.clear();
  changed_.SignalAll();
  while (in_flight_ > 0) changed_.Wait(&mu_);
}

std::unique_ptr<PeerChannel> FakePeerNetwork::Join(const std::string& segment,
                                                   const std::string& address) {
  return std::make_unique<Channel>(this, segment, address);
}

// Peers are known by name, published as "name:1" (descriptors carry a
// host:port): both spellings are the same peer.
std::string FakePeerNetwork::Key(const std::string& address) {
  return absl::EndsWith(address, ":1") ? address.substr(0, address.size() - 2)
                                       : address;
}

void FakePeerNetwork::SetFault(const std::string& address_in, Fault fault) {
  const std::string address = Key(address_in);
  MutexLock lock(&mu_);
  faults_[address] = fault;
  changed_.SignalAll();
}

void FakePeerNetwork::SetInterceptor(Interceptor i) {
  MutexLock lock(&mu_);
  interceptor_ = std::move(i);
}

int FakePeerNetwork::calls(const std::string& address_in) const {
  const std::string address = Key(address_in);
  MutexLock lock(&mu_);
  auto it = endpoints_.find(address);
  return it == endpoints_.end() ? 0 : it->second.calls;
}

int FakePeerNetwork::in_flight() const {
  MutexLock lock(&mu_);
  return in_flight_;
}

void FakePeerNetwork::SetHandler(const std::string& address_in,
                                 const std::string& transport,
                                 PeerChannel::Handler h) {
  const std::string address = Key(address_in);
  MutexLock lock(&mu_);
  endpoints_[address].handlers[transport] =
      std::make_shared<PeerChannel::Handler>(std::move(h));
}

void FakePeerNetwork::RemoveHandler(const std::string& address_in,
                                    const std::string& transport) {
  const std::string address = Key(address_in);
  MutexLock lock(&mu_);
  endpoints_[address].handlers.erase(transport);
  const std::string key = absl::StrCat(address, "/", transport);
  while (running_[key] > 0) changed_.Wait(&mu_);
}

absl::StatusOr<std::string> FakePeerNetwork::Call(const std::string& from,
                                                  const std::string& address_in,
                                                  const std::string& transport,
                                                  const std::string& payload) {
  const std::string address = Key(address_in);
  std::shared_ptr<PeerChannel::Handler> handler;
  Interceptor interceptor;
  const std::string key = absl::StrCat(address, "/", transport);
  {
    MutexLock lock(&mu_);
    ++endpoints_[address].calls;
    ++in_flight_;
    const absl::Time deadline = absl::Now() + rpc_timeout_;
    while (true) {
      auto f = faults_.find(address);
      const Fault fault = f == faults_.end() ? Fault::kNone : f->second;
      if (fault == Fault::kRefuse) {
        --in_flight_;
        changed_.SignalAll();
        return absl::UnavailableError(
            absl::StrCat("peer ", address, ": connection refused"));
      }
      if (fault != Fault::kSilent) break;
      if (changed_.WaitWithDeadline(&mu_, deadline)) {
        --in_flight_;
        changed_.SignalAll();
        return absl::DeadlineExceededError(
            absl::StrCat("peer ", address, ": deadline exceeded"));
      }
    }
    auto& hs = endpoints_[address].handlers;
    auto it = hs.find(transport);
    if (it != hs.end()) {
      handler = it->second;
      ++running_[key];
    }
    interceptor = interceptor_;
  }
  absl::StatusOr<std::string> result =
      absl::UnavailableError(absl::StrCat("peer ", address, ": no handler"));
  absl::Status cut =
      interceptor ? interceptor(from, address, payload) : absl::OkStatus();
  if (!cut.ok()) {
    result = cut;
  } else if (handler != nullptr) {
    result = (*handler)(from, payload);
  }
  MutexLock lock(&mu_);
  if (handler != nullptr) --running_[key];
  --in_flight_;
  changed_.SignalAll();
  return result;
}

void TestSink::OnSliceDone(Slice* slice, const absl::Status& status) {
  MutexLock lock(&mu_);
  if (++seen_[slice] > 1) ++duplicates_;
  statuses_.push_back(status);
  if (!status.ok()) ++failed_;
  cv_.SignalAll();
}

bool TestSink::WaitFor(size_t n, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  MutexLock lock(&mu_);
  while (statuses_.size() < n) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) return statuses_.size() >= n;
  }
  return true;
}

size_t TestSink::done() const {
  MutexLock lock(&mu_);
  return statuses_.size();
}

size_t TestSink::failed() const {
  MutexLock lock(&mu_);
  return failed_;
}

std::vector<absl::Status> TestSink::statuses() const {
  MutexLock lock(&mu_);
  return statuses_;
}

size_t TestSink::duplicates() const {
  MutexLock lock(&mu_);
  return duplicates_;
}

absl::StatusOr<std::unique_ptr<TestNode>> TestNode::Start(
    FakePeerNetwork* net, const std::string& name, TransportOptions options,
    size_t buffer_bytes, std::string address, Clock* clock) {
  std::unique_ptr<TestNode> n(new TestNode());
  n->name_ = name;
  n->clock_ = clock;
  std::random_device rd;
  n->incarnation_ = (static_cast<uint64_t>(rd()) << 32) | rd() | 1;
  n->bytes_ = buffer_bytes;
  n->mem_.reset(new uint8_t[buffer_bytes]);
  std::memset(n->mem_.get(), 0, buffer_bytes);
  if (address.empty()) address = name + ":1";
  n->channel_ = net->Join(name, address);
  n->transport_ = std::make_unique<RdmaTransport>(options);
  descriptor::SegmentDescriptor desc;
  desc.set_name(name);
  desc.set_incarnation(n->incarnation_);
  desc.set_rpc_address(address);
  descriptor::TransportEndpoint* ep = desc.add_transports();
  ep->set_transport("rdma");
  TransportEnv env;
  env.local_segment = name;
  env.incarnation = n->incarnation_;
  env.listen_host = "127.0.0.1";
  env.rpc_address = address;
  env.peer_channel = n->channel_.get();
  env.clock = clock;
  FERRY_RETURN_IF_ERROR(n->transport_->Install(env, ep));
  MemoryRegion region;
  region.addr = reinterpret_cast<uintptr_t>(n->mem_.get());
  region.length = buffer_bytes;
  region.remote_accessible = true;
  descriptor::Buffer* b = desc.add_buffers();
  b->set_addr(region.addr);
  b->set_length(buffer_bytes);
  b->set_location("*");
  auto handle = n->transport_->RegisterMemory(region, b);
  if (!handle.ok()) return handle.status();
  n->handle_ = *handle;
  auto view = SegmentView::Create(desc);
  if (!view.ok()) return view.status();
  n->view_ = *view;
  return n;
}

TestNode::~TestNode() { Stop(); }

void TestNode::Stop() {
  if (stopped_) return;
  stopped_ = true;
  transport_->Shutdown();
}

std::vector<Slice> TestNode::MakeSlices(const TestNode& target, OpCode op,
                                        size_t off, size_t len, int n,
                                        SliceSink* sink,
                                        absl::Duration timeout) {
  std::vector<Slice> v(n);
  const absl::Time deadline = clock_->Now() + timeout;
  for (int i = 0; i < n; ++i) {
    Slice& s = v[i];
    s.op = op;
    s.local = mem_.get() + off + i * len;
    s.remote = target.addr(off + i * len);
    s.length = len;
    s.target = target.view().get();
    s.remote_buffer = 0;
    s.local_handle = handle_;
    s.deadline = deadline;
    s.sink = sink;
  }
  return v;
}

void TestNode::Submit(std::vector<Slice>* slices) {
  std::vector<Slice*> ptrs;
  for (Slice& s : *slices) ptrs.push_back(&s);
  transport_->Submit(absl::MakeSpan(ptrs));
}

}  // namespace ferry::rdma::testing
