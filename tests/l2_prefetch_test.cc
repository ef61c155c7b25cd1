// layers/l2_prefetch.h: the parts that the issuing threads take tile the ranges exactly, and
// bad hints are refused naming the range.
#include "layers/l2_prefetch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace tpserve {
namespace {

alignas(16) char g_bytes[4096];

TEST(L2PrefetchTest, PartsTileTheRangesInSixteenByteUnits) {
  L2Prefetch p;
  p.ptr[0] = g_bytes;
  p.bytes[0] = 16 * 1000;
  p.ptr[1] = g_bytes + 2048;
  p.bytes[1] = 16 * 37;
  for (const uint64_t parts :
       {uint64_t{1}, uint64_t{3}, uint64_t{72}, uint64_t{256}, uint64_t{2000}}) {
    SCOPED_TRACE(parts);
    uint64_t expect_begin = 0, smallest = UINT64_MAX, largest = 0;
    for (uint64_t part = 0; part < parts; ++part) {
      uint64_t begin = 0, end = 0;
      L2PrefetchPart(p, part, parts, &begin, &end);
      ASSERT_EQ(begin, expect_begin) << "part " << part << " leaves a gap or overlaps";
      ASSERT_LE(begin, end);
      EXPECT_EQ(begin % 16, 0u);
      EXPECT_EQ(end % 16, 0u);
      expect_begin = end;
      smallest = std::min(smallest, end - begin);
      largest = std::max(largest, end - begin);
    }
    EXPECT_EQ(expect_begin, p.total()) << "the parts do not reach the end";
    EXPECT_LE(largest - smallest, 16u) << "uneven parts";
  }
  L2Prefetch none;
  EXPECT_TRUE(none.empty());
  uint64_t begin = 1, end = 1;
  L2PrefetchPart(none, 0, 5, &begin, &end);
  EXPECT_EQ(begin, 0u);
  EXPECT_EQ(end, 0u);
}

TEST(L2PrefetchTest, CheckNamesTheRangeItRefuses) {
  L2Prefetch p;
  EXPECT_TRUE(CheckL2Prefetch(p, "hint").ok()) << "an empty hint is valid";
  p.bytes[1] = 32;
  Status s = CheckL2Prefetch(p, "hint");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("hint.ptr[1] is null"), std::string::npos) << s.message();
  p.ptr[1] = g_bytes + 8;
  s = CheckL2Prefetch(p, "hint");
  EXPECT_NE(s.message().find("hint.ptr[1] must be 16-byte aligned"), std::string::npos)
      << s.message();
  p.ptr[1] = g_bytes + 16;
  p.bytes[1] = 40;
  s = CheckL2Prefetch(p, "hint");
  EXPECT_NE(s.message().find("hint.bytes[1] = 40: must be a multiple of 16"), std::string::npos)
      << s.message();
  p.bytes[1] = 48;
  EXPECT_TRUE(CheckL2Prefetch(p, "hint").ok());
  // A null pointer with no bytes is an unused range.
  p.ptr[0] = nullptr;
  p.bytes[0] = 0;
  EXPECT_TRUE(CheckL2Prefetch(p, "hint").ok());
}

TEST(L2PrefetchTest, OfCapsAWeightAtItsFirstBytes) {
  const L2Prefetch whole = L2PrefetchOf(g_bytes, 4096, 1 << 20);
  EXPECT_EQ(whole.ptr[0], g_bytes);
  EXPECT_EQ(whole.bytes[0], 4096u);
  EXPECT_EQ(whole.bytes[1], 0u);
  EXPECT_EQ(L2PrefetchOf(g_bytes, 4096, 1000).bytes[0], 992u) << "capped, rounded down to 16";
  EXPECT_TRUE(L2PrefetchOf(g_bytes + 4, 4096, 1 << 20).empty()) << "misaligned: no hint";
  EXPECT_TRUE(L2PrefetchOf(nullptr, 4096, 1 << 20).empty());
  EXPECT_TRUE(CheckL2Prefetch(L2PrefetchOf(g_bytes, 4095, 1 << 20), "of").ok());
}

}  // namespace
}  // namespace tpserve
