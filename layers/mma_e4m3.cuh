// The 8-bit tensor-core MMA (m16n8k32, E4M3 x E4M3, FP32 accumulation) and the lane layout in
// which tpserve's warp-level kernels feed it from 16-byte loads. Device code only (sm_89 and
// later); included by .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tpserve {

__device__ __forceinline__ void MmaE4m3(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 64-column block of A rows g and g + 8 (lo, hi) against B column g (xv), as two MMAs:
// lane (g, t) = (lane / 4, lane % 4) holds bytes 16t .. 16t + 15 of the block of each. MMA 1
// takes bytes 0-7, MMA 2 bytes 8-15: in the m16n8k32 fragments lane t holds k = 4t .. 4t + 3
// (registers a0/a1, b0) and 16 + 4t .. 16 + 4t + 3 (a2/a3, b1), so both operands see the
// block's columns in the same order and each byte is multiplied with its own partner. The
// accumulator is the m16n8 C fragment: acc[0], acc[1] row g, columns 2t, 2t + 1; acc[2],
// acc[3] row g + 8, the same columns.
__device__ __forceinline__ void MmaBlockE4m3(float (&acc)[4], const uint4& lo, const uint4& hi,
                                             const uint4& xv) {
  MmaE4m3(acc, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
  MmaE4m3(acc, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
}

}  // namespace tpserve
