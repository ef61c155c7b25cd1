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

}  // namespace
}  // namespace tpserve
