// Device helpers shared by the engine's kernels (engine/cuda_ops.cu, engine/attention.cu,
// engine/paged_kv_ops.cu, engine/paged_decode_attention.cu, engine/paged_kv_write.cu):
// BF16 as raw bits, warp and block reductions, grid-stride indexing. CUDA C++17, device code
// only; include from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "layers/fp8_divide.cuh"

namespace tpserve::device {

__device__ __forceinline__ float Bf16ToFloat(uint32_t bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ uint32_t FloatToBf16(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Two floats as a bf16x2 word, the lower index in the low half (the MMA operand order too).
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return FloatToBf16(lo) | (FloatToBf16(hi) << 16);
}

__device__ __forceinline__ void UnpackBf16x8(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint4 PackBf16x8(const float (&f)[8]) {
  return make_uint4(PackBf16x2(f[0], f[1]), PackBf16x2(f[2], f[3]), PackBf16x2(f[4], f[5]),
                    PackBf16x2(f[6], f[7]));
}

// Eight BF16 values (raw bits) as E4M3 codes, saturating to +-448, the first in the low byte:
// how a paged KV cache of E4M3 stores a row (no scale).
__device__ __forceinline__ uint2 Bf16x8ToE4m3Sat(const uint4& raw) {
  float f[8];
  UnpackBf16x8(raw, f);
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t code = __nv_cvt_float_to_fp8(f[j], __NV_SATFINITE, __NV_E4M3);
    w[j / 4] |= code << (8 * (j % 4));
  }
  return make_uint2(w[0], w[1]);
}

// Eight codes, two to a conversion, the divisor's path chosen once for the eight.
template <bool kFast>
__device__ __forceinline__ uint2 Fp8Codes8(const float (&f)[8], const Fp8Divisor& d) {
  uint2 w;
  w.x = QuantizeToE4M3x2<kFast>(f[0], f[1], d) |
        (static_cast<uint32_t>(QuantizeToE4M3x2<kFast>(f[2], f[3], d)) << 16);
  w.y = QuantizeToE4M3x2<kFast>(f[4], f[5], d) |
        (static_cast<uint32_t>(QuantizeToE4M3x2<kFast>(f[6], f[7], d)) << 16);
  return w;
}

// Eight codes: one 8-byte store when aligned, bytes otherwise.
__device__ __forceinline__ void StoreFp8x8(uint8_t* dst, const float (&f)[8], const Fp8Divisor& d) {
  const uint2 w = d.inv != 0.0f ? Fp8Codes8<true>(f, d) : Fp8Codes8<false>(f, d);
  if ((reinterpret_cast<uintptr_t>(dst) & 7u) == 0) {
    *reinterpret_cast<uint2*>(dst) = w;
  } else {
    uint8_t q[8];
    memcpy(q, &w, sizeof q);
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = q[i];
  }
}

// E4M3 codes to float (exact).
__device__ __forceinline__ float Fp8E4M3ToFloat(uint32_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ void UnpackFp8x8(const uint2& raw, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[i] = Fp8E4M3ToFloat((raw.x >> (8 * i)) & 0xFFu);
    f[4 + i] = Fp8E4M3ToFloat((raw.y >> (8 * i)) & 0xFFu);
  }
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ inline float BlockSum(float v) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpSum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? warp_sums[lane] : 0.0f;
    v = WarpSum(v);
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  return warp_sums[0];
}

// Max over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// fmaxf drops a NaN operand, so NaN values are skipped, as in layers/fp8.h's Amax.
__device__ inline float BlockMax(float v) {
  __shared__ float warp_maxes[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if (lane == 0) warp_maxes[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? warp_maxes[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    if (lane == 0) warp_maxes[0] = v;
  }
  __syncthreads();
  return warp_maxes[0];
}

// The block's largest |bf16(y)| into *amax (zeroed by the launcher): one
// atomic per block. Non-negative floats order as their bit patterns.
__device__ __forceinline__ void BlockAmaxInto(float* amax, float local) {
  const float m = BlockMax(local);
  if (threadIdx.x == 0 && m > 0.0f) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

// |y| after rounding to BF16, as the BF16 output stores it.
__device__ __forceinline__ float AbsBf16(float y) { return fabsf(Bf16ToFloat(FloatToBf16(y))); }

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

}  // namespace tpserve::device
