// What the engine's prefill attention kernels (engine/attention.cu, engine/attention_wgmma.cu)
// share: the online softmax's step of the running row maximum, and the output stage (one
// thread's share of one output row, normalised, stored as BF16 and/or as the E4M3 codes of
// those BF16 values, with the running |BF16| maximum). Both keep a row in the four lanes of a
// quad (the MMA accumulator layout). CUDA C++17, device code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_ops.h"
#include "engine/device_math.cuh"
#include "engine/mma.cuh"
#include "layers/fp8_divide.cuh"

namespace tpserve::device {

// One row's step over a key tile: tile_max is this thread's maximum of the row's raw scores
// in the tile (Q.K; scale_log2 turns them into log2 units), row_max the running maximum
// (-inf before any visible key), updated here. Returns alpha, the factor on the row's earlier
// sums, and sets base, the new maximum in log2 units: 0 while no key is visible, which keeps
// exp2(-inf - -inf) = NaN out (every weight and alpha is then 0).
__device__ __forceinline__ float SoftmaxRowStep(float tile_max, float& row_max, float scale_log2,
                                                float& base) {
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  const float new_max = fmaxf(row_max, tile_max);
  base = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
  const float alpha = Exp2Approx(fmaf(row_max, scale_log2, -base));
  row_max = new_max;
  return alpha;
}

// The E4M3 divisor of AttentionParams::out_fp8_scale (1 without out_fp8): read once at the
// kernel's start, where the load's latency hides behind its setup, not at each output stage.
__device__ __forceinline__ Fp8Divisor AttentionOutDivisor(const AttentionParams& p) {
  return MakeFp8Divisor(p.out_fp8 != nullptr ? *p.out_fp8_scale : 1.0f);
}

// Where one (sequence, head) of AttentionParams goes: its first row in `out` and `out_fp8`
// (either may be null) and the E4M3 divisor. Formed after the key loop, not held through it
// (registers).
struct AttentionOut {
  uint16_t* out = nullptr;
  int64_t out_stride = 0;
  uint8_t* fp8 = nullptr;
  int64_t fp8_stride = 0;
  Fp8Divisor divisor;
  bool track_amax = false;
};

__device__ __forceinline__ AttentionOut MakeAttentionOut(const AttentionParams& p, int begin,
                                                         int head, int head_dim,
                                                         const Fp8Divisor& divisor) {
  AttentionOut o;
  const int64_t col = int64_t{head} * head_dim;
  if (p.out != nullptr) {
    o.out =
        reinterpret_cast<uint16_t*>(p.out) + static_cast<int64_t>(begin) * p.out_row_stride + col;
    o.out_stride = p.out_row_stride;
  }
  if (p.out_fp8 != nullptr) {
    o.fp8 = p.out_fp8 + static_cast<int64_t>(begin) * p.out_fp8_row_stride + col;
    o.fp8_stride = p.out_fp8_row_stride;
  }
  o.divisor = divisor;
  o.track_amax = p.out_amax != nullptr;
  return o;
}

// Row `row` (from the sequence's first; not stored when it is `len` or more) of this
// thread's output. sum_share is this thread's share of the row's softmax sum, added over the
// four lanes of its quad here (every lane must call). Pair dt of the row (from pair_at(dt), a
// float2) holds dims 8 dt + 2t and 8 dt + 2t + 1, the accumulator order of mma.sync m16n8 and
// of wgmma m64nN. kFast: out.divisor.inv != 0 (the branch-free division; checked once by the
// caller, since a per-value branch costs the epilogue dearly).
template <bool kFast, int kDimTiles, typename PairAt>
__device__ __forceinline__ void StoreAttentionRow(const AttentionOut& out, int row, int len, int t,
                                                  float sum_share, float& amax, PairAt pair_at) {
  float sum = sum_share;
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  // Every real row sees its own key, so its sum is >= 1; rows past len are not stored.
  const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
  if (row >= len) return;
  uint32_t* dst =
      out.out != nullptr ? reinterpret_cast<uint32_t*>(out.out + row * out.out_stride) : nullptr;
  uint16_t* dst_fp8 =
      out.fp8 != nullptr ? reinterpret_cast<uint16_t*>(out.fp8 + row * out.fp8_stride) : nullptr;
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt) {
    const float2 v = pair_at(dt);
    const uint32_t pair = PackBf16x2(v.x * inv_sum, v.y * inv_sum);
    if (dst != nullptr) dst[dt * 4 + t] = pair;
    const float lo = Bf16ToFloat(pair & 0xFFFFu), hi = Bf16ToFloat(pair >> 16);
    if (dst_fp8 != nullptr) {
      dst_fp8[dt * 4 + t] = QuantizeToE4M3x2<kFast>(lo, hi, out.divisor);
    }
    if (out.track_amax) amax = fmaxf(amax, fmaxf(fabsf(lo), fabsf(hi)));
  }
}

}  // namespace tpserve::device
