// The Hopper (sm_90a) prefill attention kernel behind LaunchCausalAttention
// (engine/cuda_ops.h), internal to engine/: warpgroup MMA (wgmma) with 128-byte swizzled
// shared-memory tiles, BF16 in, FP32 accumulate, head_dim 128, packed rows (not the paged
// cache). LaunchCausalAttention validates the parameters and picks the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/status.h"
#include "engine/attention_fp8.h"
#include "engine/cuda_ops.h"

namespace tpserve {

// True iff this build has sm_90a code (TPSERVE_HAS_SM90A) and the current device is compute
// capability 9.0, and head_dim is 128.
bool WgmmaAttentionSupports(int64_t head_dim);

// Launches the kernel over num_seqs * q_heads * tile_slots units, tile_slots chosen from the
// sequences' most and average query tiles: unit (y, sequence, head) takes the sequence's
// query tiles num_tiles - 1 - y, then tile_slots fewer each time, and a block copies its next
// tile in while it writes the current one. With p.work_counter, where the persistent grid
// measured faster (one tile on average, or more than 16), at most `sms` blocks take units
// from the counter, heaviest (smallest y) first; otherwise a block per unit. `p` was
// validated by LaunchCausalAttention and WgmmaAttentionSupports(p.head_dim) holds.
Status LaunchCausalAttentionWgmma(const AttentionParams& p, int64_t most_tiles,
                                  int64_t average_tiles, int sms, float scale_log2,
                                  cudaStream_t stream);

// LaunchCausalAttention's checks of `p` (engine/attention.cu). reads_qkv: p.q, p.k and p.v
// are read (their pointers and strides are checked); writes_out: the outputs are written
// (checked, and out_amax zeroed on `stream`).
Status CheckCausalAttentionParams(const AttentionParams& p, bool reads_qkv, bool writes_out,
                                  cudaStream_t stream);

// The checks of `in` against p's shape (engine/attention_fp8.cu): head_dim 128 where
// Fp8AttentionSupports holds (UNIMPLEMENTED otherwise), q, k and vt 16-byte aligned, scales
// 4-byte aligned, vt_columns a multiple of 16 and at least Fp8AttentionVtColumns.
Status CheckFp8AttentionInputs(const AttentionParams& p, const Fp8AttentionInputs& in);

// The E4M3 variant (engine/attention_fp8.h): `p` and `in` were validated by
// LaunchCausalAttentionFp8; the grid as above.
Status LaunchCausalAttentionWgmmaFp8(const AttentionParams& p, const Fp8AttentionInputs& in,
                                     int64_t most_tiles, int64_t average_tiles, int sms,
                                     float scale_log2, cudaStream_t stream);

// Where the paged variant finds keys and values (LaunchPagedPrefillAttention's sequences of
// two or more query rows, BF16 cache): the cache viewed as rows of 128 BF16 in KvCacheLayout
// order, and the sequences it takes (as PagedAttentionParams).
struct WgmmaPagedKeys {
  const void* cache = nullptr;
  int64_t cache_rows = 0;  // layout.Elements() / 128
  int64_t k_row0 = 0;      // row of (layer, K, block 0, KV head 0, slot 0)
  int64_t v_row0 = 0;      // row of (layer, V, block 0, KV head 0, slot 0)
  int64_t block_rows = 0;  // rows from one block to the next: kv_heads * block_size
  int block_size = 0;
  int num_blocks = 0;
  const int32_t* seqs = nullptr;          // [num_seqs of the AttentionParams]: sequence indexes
  const int32_t* context_lens = nullptr;  // per sequence index
  const int32_t* block_tables = nullptr;  // [sequence index * max_blocks + i]
  int64_t max_blocks = 0;
};

// True iff WgmmaAttentionSupports(head_dim), block_size is a multiple of 8 dividing 128 (a
// block's rows are whole 1024-byte swizzle atoms of a tile), and the cache's rows fit the
// copies' 32-bit coordinates.
bool WgmmaPagedAttentionSupports(int64_t head_dim, int64_t block_size, int64_t cache_rows);

// The paged variant: p holds q, q_row_stride, out (BF16), out_row_stride, cu_seqlens,
// num_seqs (the listed sequences), tokens, q_heads, kv_heads and head_dim; checked by
// LaunchPagedAttention, and WgmmaPagedAttentionSupports holds. most_tiles: the longest
// listed sequence's query tiles (a block per unit: never persistent).
Status LaunchPagedPrefillAttentionWgmma(const AttentionParams& p, const WgmmaPagedKeys& pk,
                                        int64_t most_tiles, int sms, float scale_log2,
                                        cudaStream_t stream);

// Query rows per block of that kernel (the launcher's grid arithmetic).
inline constexpr int64_t kWgmmaAttentionRows = 128;

}  // namespace tpserve
