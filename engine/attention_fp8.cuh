// Device helpers the E4M3 attention's producer (engine/attention_fp8.cu) and kernel
// (engine/attention_wgmma.cu) share: the V^T layout of Fp8AttentionInputs and the packing of
// four probabilities into one register of the 8-bit MMA's A fragment. CUDA C++17.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tpserve::device {

// Sequence `seq`'s first V^T column, its tokens starting at packed row `begin`.
__device__ __forceinline__ int Fp8VtBegin(int begin, int seq) {
  return ((begin + 15) & ~15) + 32 * seq;
}

// The key (0..15 within its group of 16) whose code V^T holds at column `slot` of the group.
__device__ __forceinline__ int Fp8VtKeyAtSlot(int slot) {
  return 2 * (slot >> 2) + (slot & 1) + 8 * ((slot >> 1) & 1);
}

// E4M3 codes of a, b, c, d (each rounded to nearest, saturating), a's in the low byte.
__device__ __forceinline__ uint32_t PackE4M3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

}  // namespace tpserve::device
