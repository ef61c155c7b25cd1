// The output stage shared by the engine's prefill attention kernels (engine/attention.cu,
// engine/attention_wgmma.cu): one thread's share of one output row, normalised, stored as
// BF16 and/or as the E4M3 codes of those BF16 values, with the running |BF16| maximum. CUDA
// C++17, device code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine/device_math.cuh"
#include "layers/fp8_divide.cuh"

namespace tpserve::device {

// Pair dt of the row (from pair_at(dt), a float2) holds dims 8 dt + 2t and 8 dt + 2t + 1, the
// accumulator order of mma.sync m16n8 and of wgmma m64nN. dst / dst_fp8 point at the row's
// first element of this head (either may be null). kFast: fp8.inv != 0 (the branch-free
// division; checked once by the caller, since a per-value branch costs the epilogue dearly).
template <bool kFast, int kDimTiles, typename PairAt>
__device__ __forceinline__ void StoreAttentionRow(uint16_t* dst, uint8_t* dst_fp8, int t,
                                                  float inv_sum, const Fp8Divisor& fp8,
                                                  bool track_amax, float& amax, PairAt pair_at) {
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  uint16_t* out_fp8 = reinterpret_cast<uint16_t*>(dst_fp8);
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt) {
    const float2 v = pair_at(dt);
    const uint32_t pair = PackBf16x2(v.x * inv_sum, v.y * inv_sum);
    if (out != nullptr) out[dt * 4 + t] = pair;
    const float lo = Bf16ToFloat(pair & 0xFFFFu), hi = Bf16ToFloat(pair >> 16);
    if (out_fp8 != nullptr) {
      out_fp8[dt * 4 + t] = static_cast<uint16_t>(QuantizeToE4M3<kFast>(lo, fp8) |
                                                  (QuantizeToE4M3<kFast>(hi, fp8) << 8));
    }
    if (track_amax) amax = fmaxf(amax, fmaxf(fabsf(lo), fabsf(hi)));
  }
}

}  // namespace tpserve::device
