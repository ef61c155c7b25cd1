// Shared by the paged attention kernels (paged_kv_ops.cu: prefill rows, split combine, launch
// logic; paged_decode_attention.cu: the decode kernel): their argument block and the launch
// entry of the decode kernel. Internal to engine/; include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/dtype.h"
#include "engine/device_math.cuh"
#include "layers/fp8_divide.cuh"

namespace tpserve::paged_attn {

// Warps of every paged attention CTA.
constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * 32;

struct AttnArgs {
  const BFloat16* q;
  int64_t q_row_stride;
  const uint8_t* cache;  // bytes
  int64_t k_offset;      // elements: (layer, K, block 0, head 0, slot 0)
  int64_t v_offset;
  int num_blocks;
  int block_size;
  int kv_heads;
  int q_heads;
  int group;
  const int32_t* cu_seqlens;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int64_t max_blocks;
  int tokens;
  BFloat16* out;  // or null
  int64_t out_row_stride;
  uint8_t* out_fp8;  // or null: PagedAttentionParams::out_fp8
  int64_t out_fp8_row_stride;
  const float* out_fp8_scale;
  float* ws_acc;  // [splits][tokens][q_heads][head_dim]
  float* ws_ml;   // [splits][tokens][q_heads][2]: running max (log2 units), sum
  int splits;
  int chunk;  // keys per split (a multiple of kKeyTile); the last split takes the rest
  // log2(e) / sqrt(head_dim), times the layer's key scale over an E4M3 cache (the codes'
  // products are the keys' over that scale).
  float scale_log2;
  // PagedAttentionParams::scales over an E4M3 cache (1 and 1 over BF16): k_scale for the keys
  // the RoPE path stores, v_scale multiplies every output (StoreOutput), for the values'
  // codes the products read.
  float k_scale;
  float v_scale;
  int max_rows;     // sequences of more query rows are another kernel's (multi_row_seqs)
  int block_shift;  // log2(block_size) when it is a power of two, else -1
  // PagedAttentionParams::context_constant: the decode kernel reads cu_seqlens, context_lens,
  // block_tables and its first tiles of keys below each sequence's first query row before its
  // PDL wait, the combine pass cu_seqlens and context_lens (the exception layers/pdl.cuh's
  // contract allows for memory that held its values before the kernel ahead started).
  bool context_constant;
  // The decode kernel only, 1 < splits <= kDecodeMaxClusterSplits: the splits of a (sequence,
  // KV head) are one cluster and merge their partials themselves (no combine pass, no
  // workspace).
  bool cluster_merge;
  // PagedAttentionParams::rope, the decode kernel only (rope_positions null: none). The step's
  // rows' keys and values (unrotated keys) and their slots; the cache, writable.
  const int32_t* rope_positions;
  const double* rope_inv_freq;
  double rope_theta;
  const BFloat16* rope_k;
  int64_t rope_k_row_stride;
  const BFloat16* rope_v;
  int64_t rope_v_row_stride;
  const int32_t* rope_slots;
  int64_t num_slots;  // num_blocks * block_size
  void* rope_cache;
};

// The query rows of sequence s, clamped: [*begin, *begin + *n), and its context length.
__device__ __forceinline__ void SequenceRows(const AttnArgs& a, int s, int* begin, int* n,
                                             int* ctx) {
  int b = a.cu_seqlens[s], e = a.cu_seqlens[s + 1];
  b = min(max(b, 0), a.tokens);
  e = min(max(e, b), a.tokens);
  *begin = b;
  *n = e - b;
  const int64_t cap = a.max_blocks * a.block_size;
  const int64_t c = a.context_lens[s];
  *ctx = static_cast<int>(c < 0 ? 0 : (c > cap ? cap : c));
}

// The divisor of a.out_fp8's codes (a placeholder without out_fp8): formed once per thread,
// after the kernel's PDL wait (the scale is read from the device).
__device__ __forceinline__ Fp8Divisor OutDivisor(const AttnArgs& a) {
  return MakeFp8Divisor(a.out_fp8 != nullptr ? *a.out_fp8_scale : 1.0f);
}

// Stores output element (token, col) = y * a.v_scale: its BF16 rounding into a.out, and the E4M3
// code of that BF16 value over the divisor (OutDivisor) into a.out_fp8 (LaunchQuantizeToFp8E4M3's
// code), each where set.
__device__ __forceinline__ void StoreOutput(const AttnArgs& a, const Fp8Divisor& divisor,
                                            int64_t tok, int64_t col, float y) {
  const uint32_t bits = device::FloatToBf16(y * a.v_scale);
  if (a.out != nullptr) {
    reinterpret_cast<uint16_t*>(a.out)[tok * a.out_row_stride + col] = static_cast<uint16_t>(bits);
  }
  if (a.out_fp8 != nullptr) {
    a.out_fp8[tok * a.out_fp8_row_stride + col] =
        QuantizeToE4M3(device::Bf16ToFloat(bits), divisor);
  }
}

// Keys per split at least, for the decode kernel's device-side split of a context.
constexpr int kDecodeMinSplitKeys = 16 * kAttnWarps;
// The most splits the decode kernel merges within a thread-block cluster (Hopper's largest,
// non-portable, cluster); the launcher's own split choice for it stays within this.
constexpr int kDecodeMaxClusterSplits = 16;
// The decode kernel's CTAs an SM (its shared memory: three stages of K and V tiles over a
// BF16 cache, two over E4M3, three over E4M3 with RoPE: paged_decode_attention.cu).
constexpr int kDecodeCtasPerSmBf16 = 2;
constexpr int kDecodeCtasPerSmFp8 = 4;
constexpr int kDecodeCtasPerSmFp8Rope = 3;
// The grid, in CTAs an SM, from which the split rule leaves the decode kernel over an E4M3
// cache unsplit: the slots of the shape the rule was measured with, three CTAs an SM (over a
// BF16 cache the rule counts kDecodeCtasPerSmBf16).
constexpr int kDecodeUnsplitCtasPerSmFp8 = 3;

// Launches the decode kernel (one query row per sequence; a->group in 1, 2, 4, 8; head_dim 64
// or 128) on grid (num_seqs * kv_heads, 1, splits). Returns the launch's error. Clears
// a->cluster_merge when the device cannot place a cluster of a->splits CTAs: the splits' partials
// are then in the workspace, for the combine pass.
cudaError_t LaunchPagedDecodeKernel(int head_dim, dim3 grid, bool fp8, AttnArgs* a,
                                    cudaStream_t stream);

}  // namespace tpserve::paged_attn
