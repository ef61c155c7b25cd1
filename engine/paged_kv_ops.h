// CUDA kernels of the generation step's paged KV cache: writing a step's keys and values into
// it, and paged attention over it (decode and prefill chunks). The CPU references they follow
// are engine/kv_cache.h (layout, CpuKvCache::Write, PagedAttention). The step's token sampling
// is in engine/sampling_kernels.h.
//
// Launchers only; the kernels live in paged_kv_ops.cu and paged_decode_attention.cu, so .cc
// files can include this. As in engine/cuda_ops.h, each launcher checks its host-side arguments
// (INVALID_ARGUMENT naming the field), enqueues onto `stream` and returns; none allocates,
// synchronises or reads device memory on the host, so all can be captured in a CUDA graph. Values
// that live on the device (slot mappings, block tables, lengths) are therefore not validated by the
// launchers; the kernels clamp or skip bad entries so that they never access memory out of bounds
// (each op says how), which gives wrong numbers for corrupt inputs, never a fault. Pointers are
// device pointers; row strides are in elements.
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "comm/dtype.h"
#include "comm/status.h"
#include "engine/kv_cache.h"

namespace tpserve {

struct RopeParams;  // engine/cuda_ops.h

// Stores a step's keys and values of one layer into the paged cache, as CpuKvCache::Write
// does: row r goes to slot slot_mapping[r] = block * block_size + slot_in_block, each element
// rounded to the cache's type (BF16: the bits as they are; FP8 E4M3: the code of x / the
// layer's scale, saturating, round to nearest even, the division as the CPU's FP32 one).
//   k, v: [rows, kv_heads, head_dim] BF16 with row strides (column slices of the fused QKV
//         output [rows, (q_heads + 2 kv_heads) head_dim], RoPE already applied to k)
//   cache: the whole pool, layout.Elements() elements of layout.dtype, in KvCacheLayout's order
// A negative slot_mapping entry is a padding row and is skipped; so is an entry at or past
// num_blocks * block_size (corrupt). Two rows mapped to one slot: one of them wins.
// head_dim a multiple of 8; k, v and cache 16-byte aligned, row strides multiples of 8.
struct PagedKvWriteParams {
  const BFloat16* k = nullptr;
  int64_t k_row_stride = 0;  // >= kv_heads * head_dim
  const BFloat16* v = nullptr;
  int64_t v_row_stride = 0;               // >= kv_heads * head_dim
  const int32_t* slot_mapping = nullptr;  // [rows]
  int64_t rows = 0;                       // >= 0; 0 launches nothing
  void* cache = nullptr;
  KvCacheLayout layout;  // must Validate()
  int64_t layer = 0;     // in [0, layout.layers)
  KvScales scales;       // the layer's (an E4M3 cache's; CheckKvScales)
};
Status LaunchPagedKvWrite(const PagedKvWriteParams& p, cudaStream_t stream);
// LaunchPagedKvWrite's checks of `p` alone (INVALID_ARGUMENT naming the field), for a launcher
// that stores the rows in a kernel of its own (RopeParams::kv_store).
Status CheckPagedKvWrite(const PagedKvWriteParams& p);

// Causal grouped-query attention of a step's query rows over the paged cache, as
// engine/kv_cache.h's PagedAttention: sequence s owns query rows cu_seqlens[s] ..
// cu_seqlens[s+1]-1 (n_s rows); its context after the step is context_lens[s] tokens; row j
// sits at position context_lens[s] - n_s + j and attends to positions 0 .. itself, whose keys
// and values are read through block table row s (block_tables[s * max_blocks + pos /
// block_size]). Query head h reads KV head h / (q_heads / kv_heads); scores are scaled by
// 1/sqrt(head_dim). FP32 math with an online softmax (the reference is double); decode rows
// (one query row per sequence) go through BF16 tensor-core products with FP32 accumulation
// whose P keeps about 16 bits over a BF16 cache (a BF16 high part and remainder), within
// FP32-math error, and is rounded to BF16 over an E4M3 cache (within 2^-8 of max |v|).
//   q:   [tokens, q_heads, head_dim] BF16, row stride q_row_stride (a slice of the QKV output)
//   out: [tokens, q_heads, head_dim] BF16, row stride out_row_stride, and/or its E4M3 codes
//        in out_fp8; must not overlap q
// Rows outside every sequence are not written.
//
// Work split: a CTA takes up to 16 (query row, head) pairs of one (sequence, KV head), or in
// pure decode all query heads of one (sequence, KV head), and a range of the context. Long
// contexts are split over several CTAs (flash-decoding) whose partial results go to `workspace`
// and are merged by a second kernel; in pure decode, up to 16 splits are one thread-block
// cluster and merge among themselves (the workspace then only bounds the split count, as
// below). The split count is chosen on the host from the sizes given here (never from device
// data), so a captured graph stays valid: `splits` if set, else enough splits that the launch
// covers the GPU (at most 16 in pure decode), at most PagedAttentionMaxSplits(max_context), and
// never more than the workspace holds (a null or small workspace gives fewer splits, down to 1,
// which needs none). Size the workspace once with PagedAttentionWorkspaceBytes for the largest
// launch.
//
// Device data is clamped, never trusted: cu_seqlens to [0, tokens] (non-decreasing),
// context_lens to [0, max_blocks * block_size]; a block table entry outside [0, num_blocks)
// makes its keys count as masked (skipped). A row that attends to no key (corrupt lengths:
// n_s > context) is written as zeros.
// head_dim 64 or 128 (UNIMPLEMENTED otherwise); q, out, cache 16-byte aligned; q_row_stride
// and out_row_stride multiples of 8.
struct PagedAttentionParams {
  const BFloat16* q = nullptr;
  int64_t q_row_stride = 0;  // >= q_heads * head_dim
  int64_t q_heads = 0;       // a positive multiple of layout.kv_heads
  const void* cache = nullptr;
  KvCacheLayout layout;  // must Validate()
  int64_t layer = 0;     // in [0, layout.layers)
  // The layer's scales (an E4M3 cache's; CheckKvScales): a key code c counts as c * scales.k,
  // a value code as c * scales.v, as CpuKvCache::Read gives them. The kernels fold them into
  // the score scale and the output instead of widening each element with them.
  KvScales scales;
  const int32_t* cu_seqlens = nullptr;    // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs * max_blocks]
  int64_t num_seqs = 0;                   // >= 0; 0 launches nothing
  int64_t tokens = 0;                     // >= 0; 0 launches nothing
  int64_t max_blocks = 0;                 // >= 1: block table row length
  // Sizes the grid only: the most query rows one sequence has in this step (0: tokens). An
  // underestimate is slower (CTAs loop) but correct.
  int64_t max_query_rows = 0;
  // The longest context the caller expects (0: max_blocks * block_size); sizes the split
  // chunks. A longer context is still attended in full (the last split takes the rest).
  int64_t max_context = 0;
  BFloat16* out = nullptr;     // optional when out_fp8 is set
  int64_t out_row_stride = 0;  // >= q_heads * head_dim (when out is set)
  // Optional fused quantization for an FP8 consumer (o's input), as AttentionParams::out_fp8:
  // E4M3 codes of the BF16-rounded output divided by *out_fp8_scale, bit-identical to
  // LaunchQuantizeToFp8E4M3 run over `out`. Row stride out_fp8_row_stride (>= q_heads *
  // head_dim, a multiple of 8), 16-byte aligned.
  uint8_t* out_fp8 = nullptr;
  int64_t out_fp8_row_stride = 0;
  const float* out_fp8_scale = nullptr;  // required iff out_fp8 is set; finite and > 0
  void* workspace = nullptr;             // optional: 16-byte aligned, workspace_bytes long
  size_t workspace_bytes = 0;
  int64_t splits = 0;  // 0: chosen by the launcher; > 0: this many (clamped as above)
  // Optional: the sequences of two or more query rows in this step (prefill chunks),
  // multi_row_count indexes in [0, num_seqs) on the device, 4-byte aligned. Those are attended
  // by a tensor-core kernel (a BF16 cache at head_dim 128 with blocks of a multiple of 8 that
  // divides 128, on sm_90a: the Hopper kernel of engine/attention_wgmma.h, blocks copied by
  // TMA; otherwise flash-attention-2 style on BF16 MMAs, K and V read block by block, E4M3
  // widened to BF16 exactly; both round the probabilities to BF16 for P.V), every other
  // sequence by the kernels above, which then size their launch for one
  // row per sequence. The list must name every sequence of two or more rows: one left out is
  // not written. Null or a count of 0: the kernels above take everything.
  const int32_t* multi_row_seqs = nullptr;
  int64_t multi_row_count = 0;
  // A promise, for a launch that follows another PDL kernel in its stream (layers/pdl.cuh):
  // cu_seqlens, context_lens, block_tables and every key and value at a position below its
  // sequence's first query row of this launch held their values before the kernel ahead of
  // this launch started. A generation step uploads the former before its first kernel and
  // writes only its own rows' keys and values. The decode kernel then reads those before it
  // waits for the kernel ahead (the keys of the query rows, q and everything it writes come
  // after), so that its loads overlap that kernel, and the split combine pass reads
  // cu_seqlens and context_lens before its own wait. false: nothing is read before a wait.
  bool context_constant = false;
  // Whether the decode kernel's splits may merge in a thread-block cluster (as above); false:
  // the combine pass merges them, through the workspace (for measuring what the cluster saves;
  // the results differ only in the rounding of the merge).
  bool cluster_merge = true;
  // Optional (host pointer, read at launch), for a pure decode launch only, one that the decode
  // kernel takes whole (PagedAttentionTakesRope): q and the step's key rows arrive unrotated,
  // and the launch does what LaunchRope(*rope) right before it would have done, in its one
  // kernel: every CTA rotates its query heads as it loads them, and the CTA whose share of
  // the context holds a step row's position rotates that row's key heads and stores them, with
  // its value heads, into the cache (rope->kv_store) before it reads them. A decode step then
  // runs one kernel fewer a layer. Outputs and cache bytes are bit-identical to LaunchRope then
  // this launch; unlike LaunchRope, q is not written (it stays unrotated), and rows outside
  // every sequence are neither rotated nor stored. rope must pass CheckRope with kv_store
  // set, and agree with this launch: rope->q, q_row_stride, q_heads, rows (= tokens),
  // kv_heads and head_dim; kv_store->cache, layout and layer (INVALID_ARGUMENT naming the field
  // otherwise). With context_constant, rope->positions and kv_store->slot_mapping count among
  // the step's metadata (read before the wait).
  const RopeParams* rope = nullptr;
};
Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream);

// Whether a launch with `p` is one the decode kernel takes whole, so that it may carry `rope`:
// no multi_row_seqs, at most one query row per sequence in its sizing (max_query_rows 1, or
// 0 with tokens <= 1), and q_heads / layout.kv_heads in 1, 2, 4, 8. Pure arithmetic.
bool PagedAttentionTakesRope(const PagedAttentionParams& p);

// LaunchPagedAttention's tensor-core part (engine/attention.cu), for p.multi_row_seqs; its
// caller has checked the rest of `p`.
Status LaunchPagedPrefillAttention(const PagedAttentionParams& p, cudaStream_t stream);

// The most context splits a launch with this max_context (after its 0 default is resolved)
// may use: one per 256 keys, at most 32.
int64_t PagedAttentionMaxSplits(int64_t max_context);
// Workspace bytes that let every launch with tokens <= max_tokens and this max_context use
// as many splits as it wants (0 when one split is all it may use). Pure arithmetic.
size_t PagedAttentionWorkspaceBytes(int64_t max_tokens, int64_t q_heads, int64_t head_dim,
                                    int64_t max_context);
// The split count LaunchPagedAttention would use for `p` on a GPU of `sm_count`
// multiprocessors (exposed for tests and for sizing decisions).
int64_t PagedAttentionSplitsFor(const PagedAttentionParams& p, int sm_count);

}  // namespace tpserve
