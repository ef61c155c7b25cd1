// CUDA kernels for the non-GEMM ops of a Llama block: RMSNorm (with fused residual add and
// FP8 quantization), RoPE, causal varlen attention, SwiGLU, the embedding lookup and the
// gather of each sequence's last token. The CPU reference they are tested against is
// engine/cpu_ops.h.
//
// Launchers only; the kernels live in cuda_ops.cu, so .cc files can include this. Each
// launcher checks its arguments (INVALID_ARGUMENT naming the field), enqueues onto `stream`
// and returns. None allocates, synchronises or reads device memory on the host, so all can be
// captured in a CUDA graph; values that live on the device (positions, ids, cu_seqlens) are
// therefore not validated by the launcher, and the kernels stay in bounds whatever they hold
// (see each op). Pointers are device pointers; row strides are in elements.
//
// Unless an op says otherwise, BF16 tensors must be 16-byte aligned and their row strides
// multiples of 8 elements (the kernels move 8 BF16 values per load); cudaMalloc'd buffers and
// column slices of them at multiples of 8 elements qualify. FP8 outputs use a per-tensor
// *dequantization* scale read from device memory, as in layers/quantize_kernels.h:
// code = saturate_e4m3(x / *scale), round to nearest even, +-448 on overflow.
//
// All math is FP32. Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/dtype.h"
#include "comm/status.h"
#include "layers/quantize_kernels.h"

namespace tpserve {

struct PagedKvWriteParams;  // engine/paged_kv_ops.h

// Llama's "add & norm": with a residual, h = bf16(input + residual) is written to
// residual_out and then normalised; without one, h = input. With residual2 as well, the
// residual is itself the two-part sum bf16(residual + residual2) (FP32 sum rounded once, as
// layers/sum_kernels.h adds two slots, but for the sign of -0 + -0, which stays -0 here): a
// GEMM+RS layer that leaves its last addition to its consumer (CudaLinear::SplitOutput) is
// added here without a pass of its own.
//   y[r, i] = h[r, i] * rsqrt(mean_i(h[r, :]^2) + eps) * weight[i]    (FP32)
//   out[r, i] = bf16(y[r, i]);  out_fp8[r, i] = saturate_e4m3(y[r, i] / *out_fp8_scale)
// The FP8 output quantizes the FP32 y (not its BF16 rounding). At least one of out and out_fp8
// is required. In place is fine when pointers are equal: out may be input, and residual_out may
// be residual or (when out is not) input. Other overlaps are not allowed. All tensors are
// [rows, dim], contiguous.
struct RmsNormParams {
  const BFloat16* input = nullptr;
  const BFloat16* residual = nullptr;    // optional; needs residual_out
  const BFloat16* residual2 = nullptr;   // optional; needs residual
  BFloat16* residual_out = nullptr;      // required iff residual is set
  const BFloat16* weight = nullptr;      // [dim]
  BFloat16* out = nullptr;               // optional
  uint8_t* out_fp8 = nullptr;            // optional; any alignment
  const float* out_fp8_scale = nullptr;  // required iff out_fp8 is set; finite and > 0
  // Optional (needs out): max |out| over every row, NaN skipped; zeroed by
  // the launcher on the stream first (0 for 0 rows). Dynamic FP8 scaling
  // reads it instead of a separate AbsMax pass over out.
  float* out_amax = nullptr;
  // Optional instead of out_fp8_scale: out_fp8 quantized with scales of its own, computed from
  // the BF16-rounded output exactly as LaunchQuantizeFp8Dynamic (layers/quantize_kernels.h)
  // computes them from a BF16 tensor (codes and scales bit for bit the same, in one pass
  // instead of a BF16 output and a second pass): one float per row (kPerRow) or per 1x128
  // group at out_fp8_scales[g * rows + r] (kPerGroup128; needs dim a multiple of 128).
  // 4-byte aligned; not with out_amax.
  float* out_fp8_scales = nullptr;
  Fp8ScaleGranularity out_fp8_granularity = Fp8ScaleGranularity::kPerRow;
  int64_t rows = 0;   // >= 0; 0 launches nothing
  int64_t dim = 0;    // multiple of 8, 8..16384
  float eps = 1e-5f;  // >= 0
  // Vectors of 8 values each thread of a row's block holds: 1, 2, 4 or 8 (raised where a row
  // would need more than 1024 threads). The results do not depend on it beyond the order of
  // the sum of squares; it trades rows in flight per SM against work per thread
  // (benchmarks/bench_elementwise.cc times the choices).
  int vecs_per_thread = 2;
};
Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream);

// Rotary position embedding in place on q and (optionally) k, the rotate_half convention of
// engine/cpu_ops.h's ApplyRope: within a head, element i pairs with i + head_dim/2 and the
// pair is rotated by positions[r] * inv_freq[i]. inv_freq is a device table [head_dim/2] of
// the model's inverse frequencies, plain or scaled (RopeInverseFrequencies in
// engine/model_config.h, uploaded once: the launch reads it, so a graph captures only its
// address); without one (nullptr) plain RoPE of base theta, inv_freq[i] = theta^(-2i /
// head_dim), computed on the device.
// q: [rows, q_heads, head_dim] with row stride q_row_stride; k likewise with kv_heads, so both
// can be slices of a fused QKV output [rows, (q_heads + 2 kv_heads) * head_dim].
// The angle, its cosine and its sine are computed in double on the device (as the reference
// does) and rounded to FP32 once; the rotation itself is FP32.
// Any 2-byte alignment works; 16-byte aligned tensors whose row strides and head_dim/2 are
// multiples of 8 take the vectorised path. A negative position (the launcher cannot check device
// data) is rotated as the formula says, which is harmless but wrong; callers validate positions
// when they build the batch.
struct RopeParams {
  BFloat16* q = nullptr;
  int64_t q_row_stride = 0;  // >= q_heads * head_dim
  int64_t q_heads = 0;       // >= 1
  BFloat16* k = nullptr;     // optional: nullptr rotates q only (kv_heads is then ignored)
  int64_t k_row_stride = 0;  // >= kv_heads * head_dim
  int64_t kv_heads = 0;      // >= 1 when k is set
  int64_t head_dim = 0;      // even, 2..512
  const int32_t* positions = nullptr;  // [rows]
  int64_t rows = 0;                    // >= 0; 0 launches nothing
  double theta = 10000.0;              // finite, > 0; read only when inv_freq is null
  // Device [head_dim/2], 8-byte aligned, positive finite entries (not checked: device data);
  // nullptr: plain RoPE of base theta.
  const double* inv_freq = nullptr;
  // Optional (host pointer, read at launch), with k set: the launch also stores each row's K
  // heads as rotated (their BF16 rounding, the values written to k) and its V heads into a
  // paged KV cache, as LaunchPagedKvWrite(*kv_store) after this launch would: one kernel
  // instead of two (a decode step's). kv_store->k, k_row_stride and rows must be this
  // launch's k, k_row_stride and rows, its layout's kv_heads and head_dim this launch's
  // kv_heads and head_dim (INVALID_ARGUMENT naming the field otherwise).
  const PagedKvWriteParams* kv_store = nullptr;
};
Status LaunchRope(const RopeParams& p, cudaStream_t stream);
// LaunchRope's checks of `p` alone (INVALID_ARGUMENT naming the field), for a launcher that
// rotates in a kernel of its own (PagedAttentionParams::rope).
Status CheckRope(const RopeParams& p);

// Causal grouped-query attention over packed variable-length sequences (flash-attn "varlen"
// layout), as engine/cpu_ops.h's CausalAttentionVarlen: sequence s owns token rows
// cu_seqlens[s] .. cu_seqlens[s+1]-1, query head h reads kv head h / (q_heads / kv_heads),
// scores are scaled by 1/sqrt(head_dim) and row i attends to rows 0..i of its own sequence.
//   q: [tokens, q_heads, head_dim], row stride q_row_stride
//   k, v: [tokens, kv_heads, head_dim], row strides k_row_stride, v_row_stride
//   out: [tokens, q_heads, head_dim], row stride out_row_stride; must not overlap q, k or v
//   out_fp8 (and/or out): the same in E4M3 codes, row stride out_fp8_row_stride
// Flash-attention-2 style: tensor-core BF16 MMAs with FP32 accumulation, online softmax in
// FP32, the probabilities rounded to BF16 for the P.V product. Memory is O(tokens): no
// [seq, seq] matrix exists anywhere.
// cu_seqlens ([num_seqs + 1], on the device) must be non-decreasing from 0 to tokens; the
// launcher cannot check it. max_seqlen only sizes the grid: blocks loop over the query tiles
// of their sequence, so an underestimate is slower but still correct. Sequence lengths are
// clamped to [0, tokens] and rows outside [0, tokens) are never touched, so a corrupt
// cu_seqlens gives wrong numbers, never an out-of-bounds access.
// head_dim 64 or 128 (UNIMPLEMENTED otherwise). Needs sm_80 or newer; tokens < 2^31 (the
// cu_seqlens are int32).
// Which kernel LaunchCausalAttention runs: kAuto takes the Hopper kernel (warpgroup MMA,
// engine/attention_wgmma.h) where it applies (an sm_90a build on a compute capability 9.0
// device, head_dim 128) and the mma.sync kernel otherwise; the others force one (kWgmma is
// UNIMPLEMENTED where it does not apply). Both give the same results up to the order of
// FP32 sums (benchmarks and tests compare them).
enum class AttentionKernel { kAuto, kMmaSync, kWgmma };

struct AttentionParams {
  const BFloat16* q = nullptr;
  int64_t q_row_stride = 0;  // >= q_heads * head_dim
  const BFloat16* k = nullptr;
  int64_t k_row_stride = 0;  // >= kv_heads * head_dim
  const BFloat16* v = nullptr;
  int64_t v_row_stride = 0;    // >= kv_heads * head_dim
  BFloat16* out = nullptr;     // optional when out_fp8 is set
  int64_t out_row_stride = 0;  // >= q_heads * head_dim (when out is set)
  // Optional fused quantization for an FP8 consumer (o's input): E4M3 codes of the
  // BF16-rounded output divided by *out_fp8_scale, bit-identical to LaunchQuantizeToFp8E4M3
  // run over `out`. Row stride out_fp8_row_stride (>= q_heads * head_dim, a multiple of 8).
  uint8_t* out_fp8 = nullptr;
  int64_t out_fp8_row_stride = 0;
  const float* out_fp8_scale = nullptr;  // required iff out_fp8 is set; finite and > 0
  float* out_amax = nullptr;             // optional (needs out): as RmsNormParams::out_amax
  const int32_t* cu_seqlens = nullptr;   // [num_seqs + 1]
  int64_t num_seqs = 0;                  // >= 0; 0 launches nothing
  int64_t tokens = 0;                    // >= 0; 0 launches nothing
  int64_t max_seqlen = 0;                // longest sequence (>= 1 when tokens > 0)
  int64_t q_heads = 0;                   // multiple of kv_heads
  int64_t kv_heads = 0;                  // >= 1
  int64_t head_dim = 0;                  // 64 or 128
  AttentionKernel kernel = AttentionKernel::kAuto;
  // Optional, read by the Hopper kernel (and its E4M3 variant) only: two int32 in device
  // memory, zero before the launch, which the kernel leaves zero again when it completes.
  // With it, where it measured faster (sequences of one query tile or of more than 16, on
  // average), the grid is persistent (a block per SM) and blocks take their (sequence, head,
  // tiles) units from this counter, heaviest first, copying the next unit's first tiles in
  // while they write the current one's output; otherwise a block per unit.
  // Either way the outputs are the same bits. One counter must not serve launches that can
  // run at the same time. 4-byte aligned.
  int32_t* work_counter = nullptr;
};
Status LaunchCausalAttention(const AttentionParams& p, cudaStream_t stream);

// out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j], silu(g) = g / (1 + exp(-g)), as
// engine/cpu_ops.h's SwiGlu. gate_up: [rows, 2 * inter]; out: [rows, inter] BF16 and/or
// out_fp8: [rows, inter] E4M3 codes of the FP32 product (fused quantize for the down
// projection). At least one output is required; outputs must not overlap gate_up (unlike the
// CPU reference, rows are not written in order). Any inter >= 1 and 2-byte alignment work;
// inter a multiple of 8 with 16-byte aligned tensors takes the vectorised path.
struct SwiGluParams {
  const BFloat16* gate_up = nullptr;
  BFloat16* out = nullptr;               // optional
  uint8_t* out_fp8 = nullptr;            // optional
  const float* out_fp8_scale = nullptr;  // required iff out_fp8 is set; finite and > 0
  float* out_amax = nullptr;             // optional (needs out): as RmsNormParams::out_amax
  // Optional instead of out_fp8_scale: out_fp8 quantized with scales of its own, computed from
  // the BF16-rounded output exactly as LaunchQuantizeFp8Dynamic (layers/quantize_kernels.h)
  // computes them from a BF16 tensor (codes and scales bit for bit the same, in one pass
  // instead of a BF16 output and a second pass): one float per row (kPerRow) or per 1x128
  // group at out_fp8_scales[g * rows + r] (kPerGroup128; needs inter a multiple of 128).
  // 4-byte aligned; not with out_amax; needs inter a multiple of 8 up to 32768 and
  // gate_up and out 16-byte aligned.
  float* out_fp8_scales = nullptr;
  Fp8ScaleGranularity out_fp8_granularity = Fp8ScaleGranularity::kPerRow;
  int64_t rows = 0;   // >= 0; 0 launches nothing
  int64_t inter = 0;  // >= 1
};
Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream);

// out[t, :] = table[ids[t], :]. table: [vocab, dim]; ids: [n] (device); out: [n, dim].
// Ids cannot be checked on the host, so the kernel does it: a row whose id is outside
// [0, vocab) is written as zeros (the table is never read out of bounds) and *error_flag
// becomes the smallest such position + 1. The launcher zeroes *error_flag first (an async
// memset on `stream`), so after the work completes 0 means every id was valid; read it back
// to turn a bad id into an INVALID_ARGUMENT. Any dim >= 1 and 2-byte alignment work; dim a
// multiple of 8 with 16-byte aligned tensors takes the vectorised path.
struct EmbeddingParams {
  const BFloat16* table = nullptr;
  int64_t vocab = 0;  // 1 .. 2^31 - 1
  int64_t dim = 0;    // >= 1
  const int32_t* ids = nullptr;
  int64_t n = 0;  // 0 .. 2^31 - 2 (the flag holds position + 1); 0 only zeroes the flag
  BFloat16* out = nullptr;
  int32_t* error_flag = nullptr;  // one int32; required
};
Status LaunchEmbeddingLookup(const EmbeddingParams& p, cudaStream_t stream);

// out[s, :] = float(input[cu_seqlens[s+1] - 1, :]): each sequence's last token, widened to
// FP32 (the rows whose logits a request needs). input: [tokens, dim] with row stride
// input_row_stride; out: [num_seqs, dim] contiguous. An empty sequence, or a row outside
// [0, tokens) from a corrupt cu_seqlens, gives a row of zeros. Any alignment (2 bytes for
// input, 4 for out) works.
struct GatherLastTokensParams {
  const BFloat16* input = nullptr;
  int64_t input_row_stride = 0;         // >= dim
  int64_t tokens = 0;                   // >= 0
  int64_t dim = 0;                      // >= 1
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  int64_t num_seqs = 0;                 // >= 0; 0 launches nothing
  float* out = nullptr;
};
Status LaunchGatherLastTokens(const GatherLastTokensParams& p, cudaStream_t stream);

}  // namespace tpserve
