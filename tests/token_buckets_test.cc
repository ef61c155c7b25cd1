// The batch shaping of the CUDA model's graphs (engine/token_buckets.h), on
// the CPU: buckets, sequence slots and padding.
#include "engine/token_buckets.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace tpserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TokenBuckets, DefaultsDoubleFrom256AndEndAtMaxTokensRoundedToTp) {
  auto b = MakeTokenBuckets(8192, 2, {});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_THAT(*b, ElementsAre(256, 512, 1024, 2048, 4096, 8192));
  b = MakeTokenBuckets(1001, 4, {});
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(256, 512, 1004));  // 1001 rounded up to a multiple of 4
  b = MakeTokenBuckets(100, 2, {});
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(100));
}

TEST(TokenBuckets, RequestedOnesAreRoundedCappedSortedAndUnique) {
  auto b = MakeTokenBuckets(8192, 3, {8192, 1000, 999, 20000});
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_THAT(*b, ElementsAre(999, 1002, 8193));  // 1000 -> 1002; 20000 and 8192 -> 8193
  for (int64_t v : *b) EXPECT_EQ(v % 3, 0) << v;
}

TEST(TokenBuckets, BadArgumentsAreErrors) {
  EXPECT_EQ(MakeTokenBuckets(0, 2, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeTokenBuckets(10, 0, {}).status().code(), StatusCode::kInvalidArgument);
  auto b = MakeTokenBuckets(10, 2, {0});
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr(">= 1, got 0"));
}

TEST(TokenBuckets, BucketForPicksTheSmallestThatHolds) {
  const std::vector<int64_t> b = {256, 512, 1024};
  EXPECT_EQ(*BucketFor(b, 1), 256);
  EXPECT_EQ(*BucketFor(b, 256), 256);
  EXPECT_EQ(*BucketFor(b, 257), 512);
  EXPECT_EQ(*BucketFor(b, 1024), 1024);
  auto none = BucketFor(b, 1025);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("1025 tokens"));
}

TEST(TokenBuckets, SequenceSlotsArePowersOfTwoCappedAtMaxSeqsPlusOne) {
  EXPECT_EQ(SequenceSlots(1, 64), 1);
  EXPECT_EQ(SequenceSlots(2, 64), 2);
  EXPECT_EQ(SequenceSlots(3, 64), 4);
  EXPECT_EQ(SequenceSlots(9, 64), 16);
  EXPECT_EQ(SequenceSlots(65, 64), 65);  // 64 sequences + the padding one
  EXPECT_EQ(SequenceSlots(33, 64), 64);
  EXPECT_EQ(SequenceSlots(5, 4), 5);
}

TEST(TokenBuckets, PadBatchAddsAPaddingSequenceAndEmptySlots) {
  auto b = PackSequences({{5, 6, 7}, {8, 9}}, 1024, 2048);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const TokenBatch p = PadBatch(*b, 8, 4);
  EXPECT_THAT(p.ids, ElementsAre(5, 6, 7, 8, 9, 0, 0, 0));
  EXPECT_THAT(p.positions, ElementsAre(0, 1, 2, 0, 1, 0, 1, 2));
  // Sequences: [0,3), [3,5), the padding one [5,8), then one empty slot.
  EXPECT_THAT(p.cu_seqlens, ElementsAre(0, 3, 5, 8, 8));

  // No padding tokens: the padding slot is an empty sequence.
  const TokenBatch q = PadBatch(*b, 5, 4);
  EXPECT_THAT(q.ids, ElementsAre(5, 6, 7, 8, 9));
  EXPECT_THAT(q.cu_seqlens, ElementsAre(0, 3, 5, 5, 5));
}

TEST(TokenBuckets, PadBatchIntoWritesOnlyTheBucketAndTheSlots) {
  auto b = PackSequences({{5, 6, 7}, {8, 9}}, 1024, 2048);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  // Arrays as a pinned upload buffer holds them: larger than the pass, stale contents.
  std::vector<int32_t> ids(10, -1), positions(10, -1), cu(7, -1);
  PadBatchInto(*b, 8, 4, ids.data(), positions.data(), cu.data());
  EXPECT_THAT(ids, ElementsAre(5, 6, 7, 8, 9, 0, 0, 0, -1, -1));
  EXPECT_THAT(positions, ElementsAre(0, 1, 2, 0, 1, 0, 1, 2, -1, -1));
  EXPECT_THAT(cu, ElementsAre(0, 3, 5, 8, 8, -1, -1));
}

}  // namespace
}  // namespace tpserve
