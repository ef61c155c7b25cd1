// RoPE's arithmetic, shared by the kernels that rotate (engine/cuda_ops.cu's RoPE kernel, the
// decode attention kernel that rotates its own query and key rows): one definition, so that
// every kernel gives the same bits for the same inputs. Internal to engine/; include only from
// .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tpserve::device {

// Cosine and sine of pair i's angle at `position` (RopeParams's convention: inverse frequency
// inv_freq[i], or theta^(-2i / head_dim) without a table), computed in double as the CPU
// reference does (the angle's product rounded, never fused into the sine's arithmetic) and
// rounded to FP32 once.
__device__ __forceinline__ float2 RopeCosSin(int32_t position, int i, int head_dim,
                                             const double* inv_freq, double theta) {
  const double f = inv_freq != nullptr
                       ? inv_freq[i]
                       : pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  double s, c;
  sincos(__dmul_rn(static_cast<double>(position), f), &s, &c);
  return make_float2(static_cast<float>(c), static_cast<float>(s));
}

// The pair (x, y) (elements i and i + head_dim / 2 of a head) rotated by cs = (cos, sin):
// (x cos - y sin, y cos + x sin) in FP32, with the contraction spelled out (one product
// rounded, the other fused) so that no compiler choice can make two kernels differ.
__device__ __forceinline__ void RotatePair(float x, float y, float2 cs, float* rx, float* ry) {
  *rx = __fmaf_rn(x, cs.x, -__fmul_rn(y, cs.y));
  *ry = __fmaf_rn(y, cs.x, __fmul_rn(x, cs.y));
}

}  // namespace tpserve::device
