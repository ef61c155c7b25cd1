// Kernels and launchers for engine/paged_kv_ops.h. Plain CUDA C++17: host logic beyond
// argument checks and launch shapes belongs in .cc files (nvcc 13.0's front end is fragile,
// see GPU_HOST.md).
//
// BF16 travels as its raw bits (uint16_t), eight to a 16-byte vector.
#include "engine/paged_kv_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "comm/cuda_check.h"
#include "engine/cuda_ops.h"
#include "engine/device_math.cuh"
#include "engine/launch_checks.h"
#include "engine/paged_attention_args.cuh"
#include "layers/kernel_grid.h"
#include "layers/pdl.cuh"

namespace tpserve {
namespace {

using namespace launch_checks;
using namespace device;
using namespace paged_attn;

std::string Str(int64_t v) { return std::to_string(v); }

// ---------------------------------------------------------------------------------------------
// Paged attention.
//
// A CTA of kAttnWarps warps owns up to kPairsPerCta = kAttnWarps x kPpw (query row, head) pairs
// of one (sequence, KV head), kPpw being PairsPerWarp's 1, 2 or 4: the pairs of a sequence and KV
// head are numbered row-major (pair = j * group + g), and tile t is pairs [t * kPairsPerCta, ...).
// Warp w holds pairs w, w + kAttnWarps, ... in registers (its running max, sum and kHeadDim / 32
// output dims per lane). The keys go by tiles of 32, staged in shared memory as FP32 (K padded by
// one column so that lane = key reads are conflict-free); a lane scores one key against each of the
// warp's pairs, then the warp's pairs accumulate P.V with lane = output dims. Scores are in log2
// units (q is scaled by log2(e) / sqrt(head_dim) when staged).

// Pairs per warp: 4 when a CTA's tile has query rows enough (prefill), fewer when it has
// only one row's group of heads (decode), so that no warp computes scores for pairs that do
// not exist; the kernel is instantiated for 1, 2 and 4.
constexpr int kMaxPairsPerWarp = 4;
constexpr int kKeyTile = 32;
constexpr int64_t kMinSplitKeys = 256;
constexpr int64_t kMaxSplits = 32;

template <int kHeadDim, bool kFp8, int kPpw>
__global__ void __launch_bounds__(kAttnThreads) PagedAttentionKernel(AttnArgs a) {
  constexpr int kPairsPerCta = kAttnWarps * kPpw;
  constexpr int kPerLane = kHeadDim / 32;
  constexpr int kVecs = kHeadDim / 8;
  __shared__ float k_s[kKeyTile][kHeadDim + 1];
  __shared__ __align__(16) float v_s[kKeyTile][kHeadDim];
  __shared__ __align__(16) float q_s[kPairsPerCta][kHeadDim];
  __shared__ float p_s[kAttnWarps][kPpw][32];
  __shared__ int64_t key_off_s[kKeyTile];  // element offset of the key's (block, head, slot); -1

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int s = blockIdx.x / a.kv_heads, kvh = blockIdx.x % a.kv_heads;
  const int split = blockIdx.z;
  int row_begin, n, ctx;
  SequenceRows(a, s, &row_begin, &n, &ctx);
  if (n > a.max_rows) return;
  const int total_pairs = n * a.group;
  const int num_tiles = (total_pairs + kPairsPerCta - 1) / kPairsPerCta;
  const int key_lo = split * a.chunk;
  const int key_hi = split == a.splits - 1 ? INT_MAX : key_lo + a.chunk;
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks;
  const int64_t head_stride = static_cast<int64_t>(a.block_size) * kHeadDim;
  const int64_t block_stride = a.kv_heads * head_stride;
  const int first_pos = ctx - n;  // position of query row 0 (negative: corrupt lengths)

  for (int tile = blockIdx.y; tile < num_tiles; tile += gridDim.y) {
    const int pair0 = tile * kPairsPerCta;
    const int npairs = min(kPairsPerCta, total_pairs - pair0);
    for (int i = threadIdx.x; i < kPairsPerCta * kVecs; i += kAttnThreads) {
      const int pr = i / kVecs, c = i % kVecs;
      float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (pr < npairs) {
        const int pair = pair0 + pr, j = pair / a.group, g = pair % a.group;
        const int head = kvh * a.group + g;
        const BFloat16* src = a.q + static_cast<int64_t>(row_begin + j) * a.q_row_stride +
                              static_cast<int64_t>(head) * kHeadDim + c * 8;
        UnpackBf16x8(*reinterpret_cast<const uint4*>(src), f);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) q_s[pr][c * 8 + e] = f[e] * a.scale_log2;
    }
    // Keys this tile needs: up to the last pair's position, inside this split's range.
    const int last_row = (pair0 + npairs - 1) / a.group;
    const int key_end = min(first_pos + last_row + 1, key_hi);
    int my_pos[kPpw];
    float m[kPpw], l[kPpw], acc[kPpw][kPerLane];
#pragma unroll
    for (int k = 0; k < kPpw; ++k) {
      const int pr = warp + k * kAttnWarps;
      my_pos[k] = pr < npairs ? first_pos + (pair0 + pr) / a.group : -1;
      m[k] = -INFINITY;
      l[k] = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[k][i] = 0.0f;
    }
    __syncthreads();  // q_s

    for (int t0 = key_lo; t0 < key_end; t0 += kKeyTile) {
      if (threadIdx.x < kKeyTile) {
        const int pos = t0 + threadIdx.x;
        int64_t off = -1;
        if (pos < key_end) {
          const int b = table[pos / a.block_size];
          if (b >= 0 && b < a.num_blocks) {
            off = b * block_stride + kvh * head_stride +
                  static_cast<int64_t>(pos % a.block_size) * kHeadDim;
          }
        }
        key_off_s[threadIdx.x] = off;
      }
      __syncthreads();
      for (int i = threadIdx.x; i < kKeyTile * kVecs; i += kAttnThreads) {
        const int key = i / kVecs, c = i % kVecs;
        const int64_t off = key_off_s[key];
        float kf[8] = {0, 0, 0, 0, 0, 0, 0, 0}, vf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (off >= 0) {
          if (kFp8) {
            UnpackFp8x8(*reinterpret_cast<const uint2*>(a.cache + a.k_offset + off + c * 8), kf);
            UnpackFp8x8(*reinterpret_cast<const uint2*>(a.cache + a.v_offset + off + c * 8), vf);
          } else {
            const uint16_t* base = reinterpret_cast<const uint16_t*>(a.cache);
            UnpackBf16x8(*reinterpret_cast<const uint4*>(base + a.k_offset + off + c * 8), kf);
            UnpackBf16x8(*reinterpret_cast<const uint4*>(base + a.v_offset + off + c * 8), vf);
          }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) k_s[key][c * 8 + e] = kf[e];
        *reinterpret_cast<float4*>(&v_s[key][c * 8]) = make_float4(vf[0], vf[1], vf[2], vf[3]);
        *reinterpret_cast<float4*>(&v_s[key][c * 8 + 4]) = make_float4(vf[4], vf[5], vf[6], vf[7]);
      }
      __syncthreads();

      // Scores: lane = key.
      float sc[kPpw];
#pragma unroll
      for (int k = 0; k < kPpw; ++k) sc[k] = 0.0f;
#pragma unroll 8
      for (int d = 0; d < kHeadDim; d += 4) {
        const float k0 = k_s[lane][d], k1 = k_s[lane][d + 1], k2 = k_s[lane][d + 2],
                    k3 = k_s[lane][d + 3];
#pragma unroll
        for (int k = 0; k < kPpw; ++k) {
          const float4 qv = *reinterpret_cast<const float4*>(&q_s[warp + k * kAttnWarps][d]);
          sc[k] = fmaf(qv.x, k0, sc[k]);
          sc[k] = fmaf(qv.y, k1, sc[k]);
          sc[k] = fmaf(qv.z, k2, sc[k]);
          sc[k] = fmaf(qv.w, k3, sc[k]);
        }
      }
      const int key_pos = t0 + lane;
      const bool key_ok = key_off_s[lane] >= 0;
#pragma unroll
      for (int k = 0; k < kPpw; ++k) {
        const float score = key_ok && key_pos <= my_pos[k] ? sc[k] : -INFINITY;
        const float m_new = fmaxf(m[k], WarpMax(score));
        float p = 0.0f, alpha = 1.0f;
        if (m_new != -INFINITY) {  // warp-uniform
          p = exp2f(score - m_new);
          alpha = exp2f(m[k] - m_new);
        }
        l[k] = l[k] * alpha + WarpSum(p);
        m[k] = m_new;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[k][i] *= alpha;
        p_s[warp][k][lane] = p;
      }
      __syncwarp();
      for (int key = 0; key < kKeyTile; ++key) {
        float vv[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) vv[i] = v_s[key][lane + 32 * i];
#pragma unroll
        for (int k = 0; k < kPpw; ++k) {
          const float p = p_s[warp][k][key];
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) acc[k][i] = fmaf(p, vv[i], acc[k][i]);
        }
      }
      __syncthreads();  // k_s, v_s, p_s and key_off_s are rewritten next
    }

#pragma unroll
    for (int k = 0; k < kPpw; ++k) {
      const int pr = warp + k * kAttnWarps;
      if (pr >= npairs) continue;
      const int pair = pair0 + pr, j = pair / a.group, g = pair % a.group;
      const int head = kvh * a.group + g;
      const int64_t tok = row_begin + j;
      if (a.splits == 1) {
        const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
        const Fp8Divisor divisor = OutDivisor(a);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          StoreOutput(a, divisor, tok, static_cast<int64_t>(head) * kHeadDim + lane + 32 * i,
                      acc[k][i] * inv);
        }
      } else {
        const int64_t slot = (static_cast<int64_t>(split) * a.tokens + tok) * a.q_heads + head;
        float* dst = a.ws_acc + slot * kHeadDim;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) dst[lane + 32 * i] = acc[k][i];
        if (lane == 0) {
          a.ws_ml[2 * slot] = m[k];
          a.ws_ml[2 * slot + 1] = l[k];
        }
      }
    }
    // The next tile rewrites q_s: every warp must be done reading it (a tile with no keys
    // runs no key loop, whose barriers would otherwise cover this).
    __syncthreads();
  }
}

// Merges the splits' partial results: out = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i.
// Grid (sequence, row slots, query head), one thread per output dimension; a CTA loops over
// its sequence's rows. The first warp turns the splits' (m, l) into weights (one split per
// lane: splits <= kMaxSplits = 32), so each dimension is one pass over the splits' partials.
// The pass is a chain of latencies (a few KB a row): its sequence metadata is read before the
// PDL wait where it is constant (AttnArgs::context_constant), and every split's partial of a
// row is loaded at once, beside the (m, l) pairs, so the loads wait out one memory latency,
// not one per few splits; the sums keep split order.
static_assert(kMaxSplits <= 32, "the combine kernel's first warp holds one split per lane");
template <int kHeadDim>
__global__ void __launch_bounds__(kHeadDim) PagedAttentionCombineKernel(AttnArgs a) {
  __shared__ float w_s[32];
  if (!a.context_constant) PdlEnter();
  const int s = blockIdx.x, head = blockIdx.z;
  int row_begin, n, ctx;
  SequenceRows(a, s, &row_begin, &n, &ctx);
  if (a.context_constant) PdlEnter();
  if (n > a.max_rows) return;
  const int64_t split_stride = static_cast<int64_t>(a.tokens) * a.q_heads;
  for (int j = blockIdx.y; j < n; j += gridDim.y) {
    const int64_t tok = row_begin + j;
    const int64_t slot0 = tok * a.q_heads + head;
    float part[kMaxSplits];
#pragma unroll
    for (int sp = 0; sp < kMaxSplits; ++sp) {
      part[sp] =
          sp < a.splits ? a.ws_acc[(sp * split_stride + slot0) * kHeadDim + threadIdx.x] : 0.0f;
    }
    if (threadIdx.x < 32) {
      const int sp = threadIdx.x;
      const int64_t slot = sp * split_stride + slot0;
      const float m = sp < a.splits ? a.ws_ml[2 * slot] : -INFINITY;
      const float l = sp < a.splits ? a.ws_ml[2 * slot + 1] : 0.0f;
      const float big = WarpMax(m);
      const float w = big != -INFINITY ? exp2f(m - big) : 0.0f;  // 0 for an empty split
      const float den = WarpSum(w * l);
      w_s[sp] = den > 0.0f ? w / den : 0.0f;
    }
    __syncthreads();
    float y = 0.0f;
#pragma unroll
    for (int sp = 0; sp < kMaxSplits; ++sp) {
      if (sp < a.splits) y = fmaf(w_s[sp], part[sp], y);
    }
    StoreOutput(a, OutDivisor(a), tok, static_cast<int64_t>(head) * kHeadDim + threadIdx.x, y);
    __syncthreads();  // w_s is rewritten for the next row
  }
}

template <int kHeadDim, int kPpw>
void LaunchAttentionKernel(dim3 grid, bool fp8, const AttnArgs& a, cudaStream_t stream) {
  if (fp8) {
    PagedAttentionKernel<kHeadDim, true, kPpw><<<grid, kAttnThreads, 0, stream>>>(a);
  } else {
    PagedAttentionKernel<kHeadDim, false, kPpw><<<grid, kAttnThreads, 0, stream>>>(a);
  }
}

// pairs_per_warp 0: the decode kernel (one query row per sequence, a.group in 1, 2, 4, 8).
template <int kHeadDim>
cudaError_t LaunchAttentionKernels(dim3 grid, int64_t combine_rows, bool fp8, int pairs_per_warp,
                                   AttnArgs a, cudaStream_t stream) {
  if (pairs_per_warp == 0) {
    const cudaError_t e = LaunchPagedDecodeKernel(kHeadDim, grid, fp8, &a, stream);
    if (e != cudaSuccess) return e;
  } else if (pairs_per_warp == 1) {
    LaunchAttentionKernel<kHeadDim, 1>(grid, fp8, a, stream);
  } else if (pairs_per_warp == 2) {
    LaunchAttentionKernel<kHeadDim, 2>(grid, fp8, a, stream);
  } else {
    LaunchAttentionKernel<kHeadDim, kMaxPairsPerWarp>(grid, fp8, a, stream);
  }
  if (a.splits > 1 && !a.cluster_merge) {
    const dim3 cgrid(grid.x / static_cast<unsigned>(a.kv_heads),
                     static_cast<unsigned>(combine_rows), static_cast<unsigned>(a.q_heads));
    const cudaError_t e =
        LaunchPdl(PagedAttentionCombineKernel<kHeadDim>, cgrid, dim3(kHeadDim), 0, stream, a);
    if (e != cudaSuccess) return e;
  }
  return cudaGetLastError();
}

// Bytes of workspace one split takes per (token, head).
int64_t SplitBytes(int64_t head_dim) {
  return (head_dim + 2) * static_cast<int64_t>(sizeof(float));
}

int64_t ResolvedMaxContext(const PagedAttentionParams& p) {
  const int64_t cap = p.max_blocks * p.layout.block_size;
  return p.max_context > 0 ? std::min(p.max_context, cap) : cap;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

int64_t PagedAttentionMaxSplits(int64_t max_context) {
  const int64_t splits = (max_context + kMinSplitKeys - 1) / kMinSplitKeys;
  return std::max<int64_t>(1, std::min(splits, kMaxSplits));
}

size_t PagedAttentionWorkspaceBytes(int64_t max_tokens, int64_t q_heads, int64_t head_dim,
                                    int64_t max_context) {
  const int64_t splits = PagedAttentionMaxSplits(max_context);
  if (splits <= 1 || max_tokens <= 0 || q_heads <= 0 || head_dim <= 0) return 0;
  return static_cast<size_t>(splits * max_tokens * q_heads * SplitBytes(head_dim));
}

namespace {

bool HasMultiRowList(const PagedAttentionParams& p) {
  return p.multi_row_seqs != nullptr && p.multi_row_count > 0;
}

// The most query rows the split kernels see in one sequence (1 when the multi-row sequences
// go to the tensor-core kernel).
int64_t QueryRows(const PagedAttentionParams& p) {
  if (HasMultiRowList(p)) return std::min<int64_t>(1, p.tokens);
  return p.max_query_rows > 0 ? std::min(p.max_query_rows, p.tokens) : p.tokens;
}

// The smallest of 1, 2, 4 pairs per warp that holds every pair of a sequence's longest
// query-row range in one tile, else 4.
int PairsPerWarp(const PagedAttentionParams& p) {
  const int64_t pairs = QueryRows(p) * (p.q_heads / p.layout.kv_heads);
  if (pairs <= kAttnWarps) return 1;
  if (pairs <= 2 * kAttnWarps) return 2;
  return kMaxPairsPerWarp;
}

// A group size (query heads per KV head) the decode kernel has.
bool UsesDecodeKernelGroup(const PagedAttentionParams& p) {
  const int64_t group = p.q_heads / p.layout.kv_heads;
  return group == 1 || group == 2 || group == 4 || group == 8;
}

// Pure decode (one query row per sequence) with a group size the decode kernel has.
bool UsesDecodeKernel(const PagedAttentionParams& p) {
  return QueryRows(p) == 1 && UsesDecodeKernelGroup(p);
}

int64_t PairTiles(const PagedAttentionParams& p) {
  const int64_t group = p.q_heads / p.layout.kv_heads;
  const int64_t per_cta = int64_t{kAttnWarps} * PairsPerWarp(p);
  return std::min((QueryRows(p) * group + per_cta - 1) / per_cta, kMaxGridY);
}

// PagedAttentionParams::rope's checks (with p's own fields checked already).
Status CheckRopeInAttention(const PagedAttentionParams& p) {
  constexpr const char* kP = "PagedAttentionParams.rope";
  if (!PagedAttentionTakesRope(p)) {
    return InvalidArgumentError(std::string(kP) +
                                ": only a launch the decode kernel takes whole rotates (no "
                                "multi_row_seqs, max_query_rows 1, q_heads / kv_heads in 1, 2, "
                                "4, 8)");
  }
  const RopeParams& r = *p.rope;
  TP_RETURN_IF_ERROR(CheckRope(r).WithContext(kP));
  if (r.kv_store == nullptr) return NullField(kP, "kv_store", "(the launch stores the keys)");
  const PagedKvWriteParams& kv = *r.kv_store;
  const struct {
    const char* name;
    bool same;
  } agree[] = {{"q", r.q == p.q},
               {"q_row_stride", r.q_row_stride == p.q_row_stride},
               {"q_heads", r.q_heads == p.q_heads},
               {"rows", r.rows == p.tokens},
               {"kv_heads", r.kv_heads == p.layout.kv_heads},
               {"head_dim", r.head_dim == p.layout.head_dim},
               {"kv_store->cache", kv.cache == p.cache},
               {"kv_store->layout", kv.layout == p.layout},
               {"kv_store->layer", kv.layer == p.layer},
               {"kv_store->scales", kv.scales.k == p.scales.k && kv.scales.v == p.scales.v}};
  for (const auto& a : agree) {
    if (!a.same) {
      return InvalidArgumentError(std::string(kP) + "->" + a.name + " differs from the launch's");
    }
  }
  return Status::Ok();
}

}  // namespace

bool PagedAttentionTakesRope(const PagedAttentionParams& p) {
  if (p.layout.kv_heads <= 0 || p.q_heads % p.layout.kv_heads != 0) return false;
  return !HasMultiRowList(p) && QueryRows(p) <= 1 && UsesDecodeKernelGroup(p);
}

int64_t PagedAttentionSplitsFor(const PagedAttentionParams& p, int sm_count) {
  if (p.tokens <= 0 || p.num_seqs <= 0 || p.layout.kv_heads <= 0 || p.q_heads <= 0) return 1;
  const int64_t cap = PagedAttentionMaxSplits(ResolvedMaxContext(p));
  int64_t splits = p.splits;
  if (splits <= 0) {
    // Enough CTAs for two per SM (four for the decode kernel, whose CTAs are lighter); the
    // combine pass costs little next to an idle GPU. But a decode grid that fills every CTA
    // slot of the SMs already (two an SM with a BF16 cache, three with E4M3) is not split:
    // splitting it only adds waves and a combine pass.
    const int64_t ctas = p.num_seqs * p.layout.kv_heads * std::max<int64_t>(1, PairTiles(p));
    const bool decode = UsesDecodeKernel(p);
    const int64_t slots = (p.layout.dtype == KvCacheDtype::kFloat8E4M3 ? kDecodeUnsplitCtasPerSmFp8
                                                                       : kDecodeCtasPerSmBf16) *
                          int64_t{sm_count};
    const int64_t per_sm = decode ? 4 : 2;
    splits = decode && ctas >= slots ? 1 : (per_sm * int64_t{sm_count} + ctas - 1) / ctas;
    // The decode kernel's splits merge in a cluster (no combine pass) up to a cluster's size;
    // the same cap with cluster_merge off, so that the two merges compare at one split count.
    if (decode) splits = std::min<int64_t>(splits, kDecodeMaxClusterSplits);
  }
  splits = std::max<int64_t>(1, std::min(splits, cap));
  if (splits > 1) {
    const int64_t per_split = p.tokens * p.q_heads * SplitBytes(p.layout.head_dim);
    const int64_t fit =
        p.workspace == nullptr ? 0 : static_cast<int64_t>(p.workspace_bytes) / per_split;
    splits = std::max<int64_t>(1, std::min(splits, fit));
  }
  return splits;
}

Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  constexpr const char* kP = "PagedAttentionParams";
  TP_RETURN_IF_ERROR(CheckKvLayout(kP, p.layout, p.layer));
  const int64_t hd = p.layout.head_dim, kv_heads = p.layout.kv_heads;
  if (hd != 64 && hd != 128) {
    return UnimplementedError(std::string(kP) + ".layout.head_dim = " + Str(hd) +
                              " is unsupported; supported: 64, 128");
  }
  if (p.q_heads < 1 || p.q_heads % kv_heads != 0) {
    return BadField(kP, "q_heads", p.q_heads,
                    "must be a positive multiple of layout.kv_heads (" + Str(kv_heads) + ")");
  }
  if (p.num_seqs < 0) return BadField(kP, "num_seqs", p.num_seqs, "must be >= 0");
  if (p.tokens < 0 || p.tokens > std::numeric_limits<int32_t>::max()) {
    return BadField(kP, "tokens", p.tokens, "must be in [0, 2^31 - 1]");
  }
  if (p.max_blocks < 1) return BadField(kP, "max_blocks", p.max_blocks, "must be >= 1");
  if (p.max_blocks * p.layout.block_size > std::numeric_limits<int32_t>::max() / 2) {
    return BadField(kP, "max_blocks", p.max_blocks, "times block_size must be below 2^30");
  }
  if (p.max_query_rows < 0) return BadField(kP, "max_query_rows", p.max_query_rows, "must be >= 0");
  if (p.max_context < 0) return BadField(kP, "max_context", p.max_context, "must be >= 0");
  if (p.splits < 0) return BadField(kP, "splits", p.splits, "must be >= 0");
  TP_RETURN_IF_ERROR(CheckKvScales(p.scales, std::string(kP) + ".scales"));
  if (p.out == nullptr && p.out_fp8 == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": out and out_fp8 are both null");
  }
  if (p.out_fp8 != nullptr && p.out_fp8_scale == nullptr) {
    return NullField(kP, "out_fp8_scale", "when out_fp8 is set");
  }
  const int64_t width = p.q_heads * hd;
  const struct {
    const char* name;
    int64_t stride;
    bool used;
  } strides[] = {{"q_row_stride", p.q_row_stride, true},
                 {"out_row_stride", p.out_row_stride, p.out != nullptr},
                 {"out_fp8_row_stride", p.out_fp8_row_stride, p.out_fp8 != nullptr}};
  for (const auto& st : strides) {
    if (st.used && (st.stride < width || st.stride % 8 != 0)) {
      return BadField(kP, st.name, st.stride,
                      "must be a multiple of 8 and >= q_heads * head_dim (" + Str(width) + ")");
    }
  }
  if (p.rope != nullptr) TP_RETURN_IF_ERROR(CheckRopeInAttention(p));
  if (p.num_seqs == 0 || p.tokens == 0) return Status::Ok();
  if (p.tokens * (p.q_heads / kv_heads) > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(std::string(kP) +
                                ": tokens * (q_heads / kv_heads) exceeds 2^31 - 1");
  }
  if (p.q_heads > 65535) {  // the combine pass's grid has a z index per query head
    return BadField(kP, "q_heads", p.q_heads, "must be at most 65535");
  }
  if (p.num_seqs * kv_heads > kMaxGridX) {
    return InvalidArgumentError(std::string(kP) + ": num_seqs * kv_heads (" +
                                Str(p.num_seqs * kv_heads) + ") exceeds 2^31 - 1");
  }
  TP_RETURN_IF_ERROR(CheckPointers(kP, {{"q", p.q, 16},
                                        {"cache", p.cache, 16},
                                        {"out", p.out, 16, false},
                                        {"out_fp8", p.out_fp8, 16, false},
                                        {"cu_seqlens", p.cu_seqlens, 4},
                                        {"context_lens", p.context_lens, 4},
                                        {"block_tables", p.block_tables, 4},
                                        {"workspace", p.workspace, 16, false},
                                        {"multi_row_seqs", p.multi_row_seqs, 4, false}}));
  if (p.out_fp8 != nullptr) TP_RETURN_IF_ERROR(CheckScale(kP, "out_fp8_scale", p.out_fp8_scale));
  const bool flash = HasMultiRowList(p);
  if (p.multi_row_count < 0 || p.multi_row_count > p.num_seqs) {
    return BadField(kP, "multi_row_count", p.multi_row_count,
                    "must be in [0, num_seqs = " + Str(p.num_seqs) + "]");
  }
  if (flash) {
    TP_RETURN_IF_ERROR(LaunchPagedPrefillAttention(p, stream));
    if (p.multi_row_count == p.num_seqs) return Status::Ok();  // nothing left for the others
  }

  TP_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSms());
  const int64_t splits = PagedAttentionSplitsFor(p, sms);
  const int64_t max_context = ResolvedMaxContext(p);
  int64_t chunk = (max_context + splits - 1) / splits;
  chunk = (chunk + kKeyTile - 1) / kKeyTile * kKeyTile;

  AttnArgs a;
  a.q = p.q;
  a.q_row_stride = p.q_row_stride;
  a.cache = static_cast<const uint8_t*>(p.cache);
  a.k_offset = p.layout.Offset(p.layer, 0, 0, 0, 0);
  a.v_offset = p.layout.Offset(p.layer, 1, 0, 0, 0);
  a.num_blocks = static_cast<int>(p.layout.num_blocks);
  a.block_size = static_cast<int>(p.layout.block_size);
  a.kv_heads = static_cast<int>(kv_heads);
  a.q_heads = static_cast<int>(p.q_heads);
  a.group = static_cast<int>(p.q_heads / kv_heads);
  a.cu_seqlens = p.cu_seqlens;
  a.context_lens = p.context_lens;
  a.block_tables = p.block_tables;
  a.max_blocks = p.max_blocks;
  a.tokens = static_cast<int>(p.tokens);
  a.out = p.out;
  a.out_row_stride = p.out_row_stride;
  a.out_fp8 = p.out_fp8;
  a.out_fp8_row_stride = p.out_fp8_row_stride;
  a.out_fp8_scale = p.out_fp8_scale;
  a.splits = static_cast<int>(splits);
  a.chunk = static_cast<int>(chunk);
  a.ws_acc = splits > 1 ? static_cast<float*>(p.workspace) : nullptr;
  a.ws_ml = splits > 1 ? a.ws_acc + splits * p.tokens * p.q_heads * hd : nullptr;
  constexpr double kLog2E = 1.4426950408889634;
  const bool fp8 = p.layout.dtype == KvCacheDtype::kFloat8E4M3;
  a.k_scale = fp8 ? p.scales.k : 1.0f;
  a.v_scale = fp8 ? p.scales.v : 1.0f;
  a.scale_log2 = static_cast<float>(kLog2E / std::sqrt(static_cast<double>(hd)) * a.k_scale);
  a.max_rows = flash ? 1 : INT_MAX;
  a.context_constant = p.context_constant;
  a.cluster_merge =
      p.cluster_merge && UsesDecodeKernel(p) && splits > 1 && splits <= kDecodeMaxClusterSplits;
  const RopeParams* rope = p.rope;
  a.rope_positions = rope != nullptr ? rope->positions : nullptr;
  a.rope_inv_freq = rope != nullptr ? rope->inv_freq : nullptr;
  a.rope_theta = rope != nullptr ? rope->theta : 0.0;
  a.rope_k = rope != nullptr ? rope->k : nullptr;
  a.rope_k_row_stride = rope != nullptr ? rope->k_row_stride : 0;
  a.rope_v = rope != nullptr ? rope->kv_store->v : nullptr;
  a.rope_v_row_stride = rope != nullptr ? rope->kv_store->v_row_stride : 0;
  a.rope_slots = rope != nullptr ? rope->kv_store->slot_mapping : nullptr;
  a.num_slots = p.layout.num_blocks * p.layout.block_size;
  a.rope_cache = rope != nullptr ? rope->kv_store->cache : nullptr;
  a.block_shift = -1;
  for (int sh = 0; sh < 31; ++sh) {
    if ((int64_t{1} << sh) == p.layout.block_size) a.block_shift = sh;
  }

  const dim3 grid(static_cast<unsigned>(p.num_seqs * kv_heads),
                  static_cast<unsigned>(std::max<int64_t>(1, PairTiles(p))),
                  static_cast<unsigned>(splits));
  const int64_t combine_rows = std::max<int64_t>(1, std::min(QueryRows(p), kMaxGridY));
  const int kernel = UsesDecodeKernel(p) ? 0 : PairsPerWarp(p);
  if (hd == 64) {
    TP_CUDA_CHECK(LaunchAttentionKernels<64>(grid, combine_rows, fp8, kernel, a, stream));
  } else {
    TP_CUDA_CHECK(LaunchAttentionKernels<128>(grid, combine_rows, fp8, kernel, a, stream));
  }
  return Status::Ok();
}

}  // namespace tpserve
