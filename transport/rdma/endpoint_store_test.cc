// EndpointStore and PeerTable on their own: endpoints without QPs or a
// NIC, peers without a transport.
#include "transport/rdma/endpoint_store.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/peer.h"

namespace ferry::rdma {
namespace {

std::shared_ptr<Endpoint> MakeEndpoint(uint64_t id, Endpoint::State state,
                                       bool confirmed = true) {
  auto ep = std::make_shared<Endpoint>(id, nullptr, 1, 0, nullptr, "nic");
  MutexLock lock(&ep->mu);
  ep->SetStateLocked(state);
  ep->confirmed.store(confirmed);
  return ep;
}

TEST(EndpointStoreTest, EvictsOnlyIdleEndpoints) {
  EndpointStore store(2);
  std::vector<std::shared_ptr<Endpoint>> evicted;
  auto connecting = MakeEndpoint(1, Endpoint::State::kConnecting);
  auto unconfirmed = MakeEndpoint(2, Endpoint::State::kConnected, false);
  store.Insert(connecting, &evicted);
  store.Insert(unconfirmed, &evicted);
  // Neither may go: the store grows past its bound.
  auto busy = MakeEndpoint(3, Endpoint::State::kConnected);
  busy->busy.store(1);
  store.Insert(busy, &evicted);
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(store.live(), 3u);
  // An idle one is evicted to make room (the oldest first).
  auto idle = MakeEndpoint(4, Endpoint::State::kConnected);
  busy->busy.store(0);
  store.Insert(idle, &evicted);
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_EQ(evicted[0], busy);
  // Keep puts back one that turned out busy without evicting another.
  store.Keep(busy);
  EXPECT_EQ(store.live(), 4u);
}

// An endpoint its initiator had not confirmed when a newer one came could
// not be evicted then; once confirmed, Trim brings the store back within
// its bound (it stayed over it until the next insert before).
TEST(EndpointStoreTest, TrimEvictsWhatBecameIdleOverTheBound) {
  EndpointStore store(1);
  std::vector<std::shared_ptr<Endpoint>> evicted;
  auto old_one = MakeEndpoint(1, Endpoint::State::kConnected, false);
  auto new_one = MakeEndpoint(2, Endpoint::State::kConnected, false);
  store.Insert(old_one, &evicted);
  store.Insert(new_one, &evicted);
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(store.live(), 2u);
  store.Trim(&evicted);  // Both unconfirmed: nothing may go yet.
  EXPECT_TRUE(evicted.empty());
  old_one->confirmed.store(true);
  store.Trim(&evicted);
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_EQ(evicted[0], old_one);
  EXPECT_EQ(store.live(), 1u);
  // Within its bound, Trim evicts nothing, idle or not.
  new_one->confirmed.store(true);
  store.Trim(&evicted);
  EXPECT_EQ(evicted.size(), 1u);
}

TEST(EndpointStoreTest, DrainingEndpointsAreHeldUntilRemoved) {
  EndpointStore store(8);
  std::vector<std::shared_ptr<Endpoint>> evicted;
  auto ep = MakeEndpoint(1, Endpoint::State::kConnected);
  store.Insert(ep, &evicted);
  store.Drain(ep);
  EXPECT_EQ(store.live(), 0u);
  EXPECT_EQ(store.draining(), 1u);
  EXPECT_EQ(store.size(), 1u);  // Still holds QPs: counted.
  store.Keep(ep);               // Draining ones do not come back.
  EXPECT_EQ(store.live(), 0u);
  EXPECT_TRUE(store.Remove(*ep));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_FALSE(store.Remove(*ep));
  // Another endpoint with the same id is not this one.
  auto other = MakeEndpoint(1, Endpoint::State::kConnected);
  store.Insert(other, &evicted);
  EXPECT_FALSE(store.Remove(*ep));
  EXPECT_EQ(store.TakeAll().size(), 1u);
  EXPECT_EQ(store.size(), 0u);
}

TEST(EndpointStoreTest, DroppedEndpointsNeverComeBack) {
  // A failure can drain and drop an endpoint between its creation (or a
  // Close that found it busy) and the insertion that follows: the late
  // Insert or Keep must not bring it back to the live set for good.
  EndpointStore store(8);
  std::vector<std::shared_ptr<Endpoint>> evicted;
  auto fresh = MakeEndpoint(1, Endpoint::State::kConnecting);
  store.Drain(fresh);
  EXPECT_TRUE(store.Remove(*fresh));
  store.Insert(fresh, &evicted);
  EXPECT_EQ(store.size(), 0u);
  auto busy = MakeEndpoint(2, Endpoint::State::kConnected);
  store.Insert(busy, &evicted);
  store.Drain(busy);
  EXPECT_TRUE(store.Remove(*busy));
  store.Keep(busy);
  EXPECT_EQ(store.size(), 0u);
}

TEST(PeerTableTest, DropsLeastRecentlyUsedPeersWithoutEndpoints) {
  PeerTable table(2, [](const std::string& name) {
    return std::make_shared<Peer>(name, true, 1000);
  });
  auto a = table.Get("a");
  auto b = table.Get("b");
  {
    // "a" has an endpoint: never dropped.
    MutexLock lock(&a->mu);
    a->GetRail(0, "nic").ep = MakeEndpoint(1, Endpoint::State::kConnected);
  }
  table.Get("c");  // Over the bound: "b" (oldest without endpoints) goes.
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(table.Find("b"), nullptr);
  EXPECT_EQ(table.Find("a"), a);
  table.Get("a");  // Most recent now.
  table.Get("d");  // "c" goes.
  EXPECT_EQ(table.Find("c"), nullptr);
  EXPECT_EQ(table.evictions(), 2u);
  // With every old record busy the table grows past its bound, and Trim
  // brings it back once they are idle.
  auto d = table.Find("d");
  {
    MutexLock lock(&d->mu);
    d->GetRail(0, "nic").ep = MakeEndpoint(2, Endpoint::State::kConnected);
  }
  table.Get("e");
  EXPECT_EQ(table.size(), 3u);  // "a" and "d" are busy, "e" is new.
  {
    MutexLock lock(&a->mu);
    a->rails.front().ep = nullptr;
  }
  {
    MutexLock lock(&d->mu);
    d->rails.front().ep = nullptr;
  }
  table.Trim();
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(table.Find("e")->name(), "e");  // The most recent stays.
  EXPECT_EQ(table.Remove("e")->name(), "e");
  EXPECT_EQ(table.Remove("e"), nullptr);
}

TEST(PeerTest, AnEarlierRunNeverComesBack) {
  // A descriptor, connect request or STALE reply naming a run the peer
  // has since replaced must not roll the record back to it.
  Peer peer("p", true, 1000);
  MutexLock lock(&peer.mu);
  std::vector<std::shared_ptr<Endpoint>> old;
  EXPECT_TRUE(peer.SeeIncarnation(1, &old));
  peer.GetRail(0, "nic").ep = MakeEndpoint(1, Endpoint::State::kConnected);
  EXPECT_TRUE(peer.SeeIncarnation(1, &old));  // The same run: nothing.
  EXPECT_TRUE(old.empty());
  EXPECT_TRUE(peer.SeeIncarnation(2, &old));  // Restarted.
  EXPECT_EQ(old.size(), 1u);
  EXPECT_EQ(peer.incarnation, 2u);
  peer.GetRail(0, "nic").ep = MakeEndpoint(2, Endpoint::State::kConnected);
  old.clear();
  EXPECT_FALSE(peer.SeeIncarnation(1, &old));  // Dead: refused.
  EXPECT_EQ(peer.incarnation, 2u);
  EXPECT_TRUE(old.empty());
  EXPECT_NE(peer.rails.front().ep, nullptr);
  EXPECT_TRUE(peer.SeeIncarnation(0, &old));  // Unknown: ignored.
  EXPECT_EQ(peer.incarnation, 2u);
}

}  // namespace
}  // namespace ferry::rdma
