// CPU reference implementations of the non-GEMM transformer ops of a Llama
// block: RMSNorm, RoPE, causal (grouped-query) attention over packed
// variable-length sequences, SwiGLU and the embedding lookup.
//
// They are the numeric truth for the GPU kernels, so they favour accuracy
// over speed: FP32 in and out, sums and transcendentals in double, each output
// element rounded to FP32 once. Single-threaded; stateless and thread-safe
// (distinct outputs may be computed concurrently).
//
// All tensors are row-major and contiguous. Sizes that come from outside
// (token ids, positions, sequence boundaries) are checked and reported as
// INVALID_ARGUMENT naming the argument; the void functions only assert their
// preconditions (shapes fixed by the model). Pointers may be null only when
// the tensor they point to is empty.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/status.h"

namespace tpserve {

// x, out: [rows, dim]; weight: [dim].
// out[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * weight[i].
// out may be x (in place). Preconditions: rows >= 0, dim > 0, eps >= 0.
void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps,
             float* out);

// Rotary position embedding, in place, Llama / GPT-NeoX "rotate_half"
// convention: x: [rows, heads, head_dim]; within each head element i is
// paired with element i + head_dim/2 (i < head_dim/2) and the pair is rotated
// by the angle positions[r] * inv_freq[i]:
//   x'[i]          = x[i] * cos - x[i + half] * sin
//   x'[i + half]   = x[i + half] * cos + x[i] * sin
// positions: [rows]; inv_freq: [head_dim/2], the model's inverse frequencies
// (RopeInverseFrequencies in engine/model_config.h: plain or scaled RoPE).
// The angle is computed in double (HF computes it in FP32, which drifts by
// ~1e-4 rad at positions in the thousands).
// INVALID_ARGUMENT for negative sizes, heads or head_dim < 1, odd head_dim,
// an inv_freq of another size or with an entry that is not positive and
// finite (naming the index), or a negative position (naming the row and
// position); x is untouched then.
Status ApplyRope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                 const std::vector<double>& inv_freq);
// Plain RoPE of base theta: inv_freq[i] = theta^(-2i / head_dim).
// INVALID_ARGUMENT also for theta <= 0 or not finite.
Status ApplyRope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                 double theta);

// Causal attention over packed variable-length sequences (flash-attn
// "varlen" layout):
//   q:   [tokens, q_heads, head_dim]
//   k,v: [tokens, kv_heads, head_dim]
//   cu_seqlens: [num_seqs + 1], cu_seqlens[0] == 0, non-decreasing,
//     cu_seqlens[num_seqs] == tokens; sequence s owns rows
//     cu_seqlens[s] .. cu_seqlens[s+1]-1 (empty sequences are allowed)
//   out: [tokens, q_heads, head_dim]; must not overlap q, k or v.
// Grouped-query: q head h reads kv head h / (q_heads / kv_heads). Scores are
// scaled by 1/sqrt(head_dim); token i of a sequence attends to tokens 0..i of
// the same sequence only, so a sequence's output does not depend on (is
// bit-identical whatever) the other sequences in the pack.
// Softmax with max subtraction, in double. Scratch: one row of scores
// (O(longest sequence)) plus one head_dim accumulator; never a full
// [seq, seq] matrix.
// INVALID_ARGUMENT (naming the argument) for non-positive head counts or
// head_dim, q_heads not a multiple of kv_heads, or bad cu_seqlens.
Status CausalAttentionVarlen(const float* q, const float* k, const float* v, int64_t tokens,
                             int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                             const std::vector<int32_t>& cu_seqlens, float* out);

// gate_up: [rows, 2 * inter], each row = [gate (inter) | up (inter)] (the
// fused gate/up projection's output); out: [rows, inter].
// out[r, j] = silu(gate[r, j]) * up[r, j], silu(g) = g / (1 + exp(-g)).
// out may be gate_up (in-place compaction: rows are written in order and
// never overtake the input still to be read). Preconditions: rows >= 0,
// inter > 0.
void SwiGlu(const float* gate_up, int64_t rows, int64_t inter, float* out);

// table: [vocab, dim]; ids: [n]; out: [n, dim], out[t, :] = table[ids[t], :].
// All ids are checked before anything is written: INVALID_ARGUMENT naming
// the position and id when an id is < 0 or >= vocab (out untouched), or for
// vocab, dim < 1 or n < 0.
Status EmbeddingLookup(const float* table, int64_t vocab, int64_t dim, const int32_t* ids,
                       int64_t n, float* out);

}  // namespace tpserve
