// Launch-shape helpers shared by the element-wise kernels (layers/ and
// engine/ .cu files): grid-stride loops over `work_items` with kThreads
// threads per block, at most kMaxBlocks blocks (enough to fill an H200:
// 132 SMs x 8 blocks of 256 threads), and an alignment test for the
// vectorised paths. Host-only inline functions; CUDA C++17 safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpserve {

inline constexpr int kThreads = 256;
inline constexpr int64_t kMaxBlocks = 1056;

// Blocks for a grid-stride loop over work_items (at least 1).
inline unsigned GridFor(int64_t work_items) {
  int64_t blocks = (work_items + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks);
}

inline bool IsAligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace tpserve
