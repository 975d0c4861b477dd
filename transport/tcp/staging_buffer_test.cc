#include "transport/tcp/staging_buffer.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace ferry::tcp {
namespace {

constexpr size_t kCapacity = StagingBuffer::kCapacity;

// Receives `n` bytes counting up from `first` into the buffer's space.
void Receive(StagingBuffer* b, size_t n, uint8_t first) {
  auto [space, len] = b->Space();
  ASSERT_LE(n, len);
  for (size_t i = 0; i < n; ++i) space[i] = static_cast<uint8_t>(first + i);
  b->Commit(n);
}

TEST(StagingBufferTest, StartsEmptyWithAllTheSpace) {
  StagingBuffer b;
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(b.Space().second, kCapacity);
}

TEST(StagingBufferTest, ParsesFromTheHeadInArrivalOrder) {
  StagingBuffer b;
  Receive(&b, 10, 0);
  Receive(&b, 5, 10);
  ASSERT_EQ(b.size(), 15u);
  for (size_t i = 0; i < 15; ++i) EXPECT_EQ(b.data()[i], i);
  b.Consume(4);
  EXPECT_EQ(b.size(), 11u);
  EXPECT_EQ(b.data()[0], 4);
}

TEST(StagingBufferTest, KeepsUnreadBytesInPlaceUntilTheTailIsFull) {
  StagingBuffer b;
  Receive(&b, 100, 0);
  b.Consume(60);
  const uint8_t* unread = b.data();
  // Room remains after the tail: nothing moves.
  EXPECT_EQ(b.Space().second, kCapacity - 100);
  EXPECT_EQ(b.data(), unread);
}

TEST(StagingBufferTest, MovesUnreadBytesToTheFrontWhenTheTailIsFull) {
  StagingBuffer b;
  Receive(&b, kCapacity, 0);
  b.Consume(kCapacity - 3);
  const std::vector<uint8_t> unread(b.data(), b.data() + b.size());
  auto [space, len] = b.Space();
  EXPECT_EQ(len, kCapacity - 3);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(std::memcmp(b.data(), unread.data(), unread.size()), 0);
  EXPECT_EQ(space, b.data() + 3);
}

TEST(StagingBufferTest, EmptyBufferStartsAgainAtTheFront) {
  StagingBuffer b;
  Receive(&b, 50, 0);
  const uint8_t* front = b.data();
  b.Consume(50);
  EXPECT_TRUE(b.empty());
  auto [space, len] = b.Space();
  EXPECT_EQ(space, front);
  EXPECT_EQ(len, kCapacity);
}

TEST(StagingBufferTest, CommitKeepsNothingBeyondTheEnd) {
  StagingBuffer b;
  Receive(&b, kCapacity - 8, 0);
  b.Commit(100);
  EXPECT_EQ(b.size(), kCapacity);
  EXPECT_EQ(b.Space().second, 0u);  // Full of unread bytes.
}

TEST(StagingBufferTest, ClearDropsEverything) {
  StagingBuffer b;
  Receive(&b, 30, 0);
  b.Consume(10);
  b.Clear();
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(b.Space().second, kCapacity);
}

}  // namespace
}  // namespace ferry::tcp
