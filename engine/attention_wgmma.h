// The Hopper (sm_90a) prefill attention kernel behind LaunchCausalAttention
// (engine/cuda_ops.h), internal to engine/: warpgroup MMA (wgmma) with 128-byte swizzled
// shared-memory tiles, BF16 in, FP32 accumulate, head_dim 128, packed rows (not the paged
// cache). LaunchCausalAttention validates the parameters and picks the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/status.h"
#include "engine/cuda_ops.h"

namespace tpserve {

// True iff this build has sm_90a code (TPSERVE_HAS_SM90A) and the current device is compute
// capability 9.0, and head_dim is 128.
bool WgmmaAttentionSupports(int64_t head_dim);

// Launches the kernel over grid (num_seqs * q_heads, tiles); a block takes query tiles
// num_tiles - 1 - y, then gridDim.y fewer each time. `p` was validated by
// LaunchCausalAttention and WgmmaAttentionSupports(p.head_dim) holds.
Status LaunchCausalAttentionWgmma(const AttentionParams& p, int64_t tiles, float scale_log2,
                                  cudaStream_t stream);

// Query rows per block of that kernel (the launcher's grid arithmetic).
inline constexpr int64_t kWgmmaAttentionRows = 128;

}  // namespace tpserve
