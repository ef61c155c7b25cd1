// x / scale for an FP8 conversion, correctly rounded like the CPU's float division, without
// the IEEE division routine per element. Device code only; included by .cu files.
//
// With inv = RN(1 / scale) (the correctly rounded reciprocal, once per thread), q0 = RN(x *
// inv) is within an ulp of x / scale; if the remainder x - q0 * scale is exact (one FMA),
// RN(q0 + remainder * inv) is the correctly rounded quotient (Markstein's correction step,
// the one the IEEE routine takes on its fast path). The remainder is exact unless x is tiny
// (below about 2^-102, where it would fall among the subnormals). The quotients that decide
// an E4M3 code are at least 2^-10 (the midpoint between 0 and the smallest code, 2^-9), so
// for a scale of at least 2^-64 every x that matters is above 2^-74, and smaller x give
// quotients that encode as a signed zero either way. Scales outside [2^-64, 2^126] keep the
// IEEE division (a review found codes one step off for scales near 2^-126, where x of
// code-deciding quotients is itself tiny). Where q0 overflows, the correction would turn the
// infinity into a NaN, so the infinity stands (both saturate to the same E4M3 code); an exact
// q0 (remainder 0) stands, which keeps -0 from becoming +0.
// tests/gpu_gemm_test.cc checks the codes against the CPU for every BF16 value, millions of
// FP32 bit patterns, and the inputs next to every E4M3 midpoint, over a range of scales.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "layers/fp8_divide_range.h"

namespace tpserve {

struct Fp8Divisor {
  float scale = 1.0f;
  float inv = 0.0f;  // RN(1 / scale), or 0: use the IEEE division
};

__device__ __forceinline__ Fp8Divisor MakeFp8Divisor(float scale) {
  Fp8Divisor d;
  d.scale = scale;
  // False for NaN too.
  const bool fast = scale >= kFp8FastDivideMinScale && scale <= kFp8FastDivideMaxScale;
  d.inv = fast ? __frcp_rn(scale) : 0.0f;
  return d;
}

// The quotient for a divisor on the fast path (d.inv != 0), without branches.
__device__ __forceinline__ float DivideForFp8Fast(float x, const Fp8Divisor& d) {
  const float q0 = x * d.inv;
  const float remainder = fmaf(-q0, d.scale, x);
  const float q = fmaf(remainder, d.inv, q0);
  // A zero remainder means q0 is exact; it also keeps the sign of x = -0, which the
  // correction would turn into +0 (-0 + +0).
  return remainder == 0.0f || isinf(q0) ? q0 : q;
}

__device__ __forceinline__ float DivideForFp8(float x, const Fp8Divisor& d) {
  return d.inv == 0.0f ? __fdiv_rn(x, d.scale) : DivideForFp8Fast(x, d);
}

// The E4M3 dequantization scale of values whose absolute maximum is m, as ScaleFromAmax
// (layers/fp8.cc): m / 448 by IEEE division, never below the smallest subnormal, 1 for m = 0.
__device__ __forceinline__ float ScaleFromAmaxE4M3(float m) {
  return m == 0.0f ? 1.0f : fmaxf(__fdiv_rn(m, 448.0f), 1.40129846e-45f);
}

// The E4M3 code of x / scale, saturating to +-448 (NaN stays NaN). kFast: the caller has
// checked d.inv != 0 once for many values (a branch per value costs more than the division
// saves where the compiler does not hoist it out of a loop).
template <bool kFast = false>
__device__ __forceinline__ uint8_t QuantizeToE4M3(float x, const Fp8Divisor& d) {
  const float q = kFast ? DivideForFp8Fast(x, d) : DivideForFp8(x, d);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
}

// The E4M3 codes of lo / scale and hi / scale, lo's in the low byte, as QuantizeToE4M3 gives
// them, from one conversion instruction for the pair.
template <bool kFast = false>
__device__ __forceinline__ uint16_t QuantizeToE4M3x2(float lo, float hi, const Fp8Divisor& d) {
  const float a = kFast ? DivideForFp8Fast(lo, d) : DivideForFp8(lo, d);
  const float b = kFast ? DivideForFp8Fast(hi, d) : DivideForFp8(hi, d);
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace tpserve
