// E4M3 (FP8) prefill attention on Hopper: the causal varlen attention of LaunchCausalAttention
// (engine/cuda_ops.h) with Q, K and V as E4M3 codes and both products on 8-bit warpgroup MMA
// (engine/attention_wgmma.cu), the probabilities rounded to E4M3 for P V. Two launches: the
// producer quantizes BF16 Q, K and V (RoPE applied) into Fp8AttentionInputs, V transposed;
// the attention reads those. Packed rows only (not the paged cache); head_dim 128; an sm_90a
// build on a compute capability 9.0 device (UNIMPLEMENTED elsewhere).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/status.h"
#include "engine/cuda_ops.h"

namespace tpserve {

// Where the E4M3 inputs live. Codes are value / scale, rounded to nearest, saturating at
// +-448 (NaN stays NaN).
//   q:  [tokens, q_heads * 128], rows contiguous (q_heads * 128 bytes a row)
//   k:  [tokens, kv_heads * 128], rows contiguous
//   vt: [kv_heads * 128, vt_columns]: row kv_head * 128 + d holds dim d of that KV head's
//       values. Sequence s's keys start at column Fp8VtBegin(cu_seqlens[s], s) = the first
//       multiple of 16 at or after cu_seqlens[s], plus 32 s; within each group of 16 keys,
//       key 2j + (i & 1) + 8 (i >> 1) (j < 4, i < 4) sits at column 4j + i, the order in which
//       the P V product's register fragments hold the probabilities. The slots of the last
//       group past the sequence hold zeros.
struct Fp8AttentionInputs {
  uint8_t* q = nullptr;
  uint8_t* k = nullptr;
  uint8_t* vt = nullptr;
  int64_t vt_columns = 0;  // >= Fp8AttentionVtColumns(tokens, num_seqs), a multiple of 16
  // [3] on the device: the dequantization scales of q, k and v (finite, > 0).
  const float* scales = nullptr;
};

// The V^T columns a batch of `tokens` rows in `num_seqs` sequences needs: the tokens rounded
// up to 16, plus 32 a sequence (each sequence's columns start at a multiple of 16 and its last
// group is whole).
int64_t Fp8AttentionVtColumns(int64_t tokens, int64_t num_seqs);

// True iff LaunchCausalAttentionFp8 runs here for head_dim (as WgmmaAttentionSupports).
bool Fp8AttentionSupports(int64_t head_dim);

// Writes `in` from p.q, p.k, p.v (BF16, p's strides), p.cu_seqlens, num_seqs, tokens,
// max_seqlen (sizes the grid; an underestimate is slower, still correct), q_heads, kv_heads,
// head_dim. Validated as LaunchCausalAttention validates them, plus `in`'s fields.
// rope (optional): p.q and p.k are not yet rotated; the launch rotates them as LaunchRope
// with rope's positions, inv_freq and theta would (checked as LaunchRope checks them; rows
// must be p.tokens and head_dim p.head_dim), each rotated value rounded to BF16 before it is
// quantized, so the codes are those of LaunchRope's output. p.q and p.k are not written.
Status LaunchFp8AttentionInputs(const AttentionParams& p, const Fp8AttentionInputs& in,
                                const RopeParams* rope, cudaStream_t stream);

// Causal attention over `in` (written by LaunchFp8AttentionInputs for the same cu_seqlens):
// p's out / out_fp8 / out_amax, cu_seqlens, num_seqs, tokens, max_seqlen, q_heads, kv_heads and
// head_dim as LaunchCausalAttention takes them; p.q, p.k and p.v are not read.
Status LaunchCausalAttentionFp8(const AttentionParams& p, const Fp8AttentionInputs& in,
                                cudaStream_t stream);

}  // namespace tpserve
