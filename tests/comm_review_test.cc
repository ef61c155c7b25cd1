// Argument checks of comm/'s CUDA-side classes that run before any CUDA call,
// so they need no GPU.
#include <gtest/gtest.h>

#include <cstdint>

#include "comm/peer_memory.h"

namespace tpserve {
namespace {

// An out-of-range rank used to reach std::vector::at and throw across the
// Status boundary.
TEST(PeerBufferTest, CopyFromPeerRejectsARankOutsideTheBuffer) {
  const PeerBuffer empty;  // no ranks
  char dst[4] = {};
  for (int rank : {0, -1, 7}) {
    Status s;
    EXPECT_NO_THROW(s = empty.CopyFromPeer(rank, 0, dst, 0, nullptr)) << "rank " << rank;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("rank " + std::to_string(rank)), std::string::npos) << s.ToString();
  }
  Status s;
  EXPECT_NO_THROW(s = empty.CopyFromPeer(0, SIZE_MAX, dst, 1, nullptr));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

// The 2D copy checks its geometry before the rank and the range: pitches shorter than a row,
// and a row count whose span overflows size_t, are refused without a CUDA call; a span past
// the buffer (or an unknown rank) as CopyFromPeer refuses it.
TEST(PeerBufferTest, CopyFromPeer2DRejectsBadGeometry) {
  const PeerBuffer empty;  // no ranks
  char dst[64] = {};
  Status s =
      empty.CopyFromPeer2D(0, 0, /*src_pitch=*/8, dst, /*dst_pitch=*/16, /*width=*/16, 2, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("shorter than a row of 16 bytes"), std::string::npos) << s.ToString();
  s = empty.CopyFromPeer2D(0, 0, 16, dst, 8, 16, 2, nullptr);
  EXPECT_NE(s.message().find("shorter than a row"), std::string::npos) << s.ToString();
  s = empty.CopyFromPeer2D(0, 0, SIZE_MAX / 2, dst, 16, 16, 4, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("overflow"), std::string::npos) << s.ToString();
  s = empty.CopyFromPeer2D(3, 0, 16, dst, 16, 16, 2, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("rank 3"), std::string::npos) << s.ToString();
  // Nothing to copy still names a rank the buffer does not have, as CopyFromPeer does.
  s = empty.CopyFromPeer2D(3, 0, 16, dst, 16, 16, 0, nullptr);
  EXPECT_NE(s.message().find("rank 3"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace tpserve
